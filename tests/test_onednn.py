"""The CPU's bf16 path: oneDNN's matrix products and convolutions as XLA custom calls (engine/nn/onednn.py).

Each kernel is compared with XLA computing the same products in f32 from the same bf16-rounded inputs: both
accumulate exact bf16 products in f32, so they agree to f32 rounding. The whole engine in bf16 is compared with
its f32 pictures (themselves equal to diffusers'). Skipped where the kernels cannot be built (no oneDNN, no
compiler), unless JAX_SD_TEST_ONEDNN=required (CI), where that fails.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from multidevice import run_with_devices

from engine.errors import ConfigError
from engine.nn import layers, onednn
from engine.sampling import pairs


def _kernels_or_skip() -> None:
    if onednn.available():
        return
    try:
        reason = f"the oneDNN kernels are not built here: {onednn.build()}"
    except RuntimeError as err:
        reason = str(err)
    if os.environ.get("JAX_SD_TEST_ONEDNN") == "required":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture
def kernels():
    _kernels_or_skip()


def exact(a: jax.Array) -> jax.Array:
    """a rounded to bf16 and widened back: the numbers the kernel multiplies."""
    return a.astype(jnp.bfloat16).astype(jnp.float32)


def _bf16_layer(layer):
    layer.kernel.set_value(layer.kernel[...].astype(jnp.bfloat16))
    return layer


@pytest.mark.parametrize(
    "kernel, stride, padding, shape",
    [
        (3, 1, 1, (2, 17, 20, 64)),  # the UNet's and VAE's 3x3, odd sides
        (3, 2, ((0, 1), (0, 1)), (1, 16, 12, 32)),  # the VAE encoder's downsample: right and bottom padded
        (3, 2, 1, (2, 9, 9, 48)),  # the UNet's downsample
        (1, 1, 0, (2, 8, 8, 96)),  # a 1x1 shortcut
    ],
)
@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
def test_a_bf16_conv_runs_in_onednn_and_equals_the_f32_products(kernels, kernel, stride, padding, shape, x_dtype):
    conv = _bf16_layer(layers.conv(shape[-1], 40, kernel, nnx.Rngs(0), stride=stride, padding=padding))
    x = jax.random.normal(jax.random.key(1), shape).astype(x_dtype)
    program = jax.jit(lambda x: conv(x))
    assert onednn.CONV in program.lower(x).as_text()  # not XLA's own convolution
    got = program(x)
    want = jax.lax.conv_general_dilated(
        exact(x), exact(conv.kernel[...]), conv.strides, conv.padding, dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    want = want + conv.bias[...]
    assert got.dtype == x_dtype and got.shape == want.shape
    tolerance = 1e-5 if x_dtype == jnp.float32 else 1e-2  # a bf16 output is rounded to bf16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("shape", [(5, 64), (2, 7, 64), (1, 77, 64)])
@pytest.mark.parametrize("bias", [True, False])
def test_a_bf16_linear_runs_in_onednn_and_equals_the_f32_products(kernels, shape, bias):
    linear = _bf16_layer(layers.linear(64, 96, nnx.Rngs(0), bias=bias))
    x = jax.random.normal(jax.random.key(1), shape)
    program = jax.jit(lambda x: linear(x))
    assert onednn.MATMUL in program.lower(x).as_text()
    got = program(x)
    want = exact(x) @ exact(linear.kernel[...]) + (linear.bias[...] if bias else 0.0)
    assert got.dtype == jnp.float32 and got.shape == shape[:-1] + (96,)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_f32_layers_keep_xla_s_own_kernels(kernels):
    conv, linear = layers.conv(8, 8, 3, nnx.Rngs(0)), layers.linear(8, 8, nnx.Rngs(0))
    x = jnp.ones((1, 4, 4, 8))
    assert "onednn" not in jax.jit(lambda x: linear(conv(x))).lower(x).as_text()


def test_devices_running_the_same_kernel_at_once_each_get_their_own_answer(kernels, tmp_path):
    # A program sharded over two devices runs each device's custom calls on threads of their own: with oneDNN's
    # shared scratchpad the two runs overwrote each other (wrong numbers, or a crash).
    code = """
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from engine.nn import onednn
        assert onednn.available() and len(jax.devices()) == 2
        mesh = Mesh(np.array(jax.devices()), ("data",))
        x = jax.device_put(jax.random.normal(jax.random.key(0), (4, 24, 24, 64)), NamedSharding(mesh, P("data")))
        w = (jax.random.normal(jax.random.key(1), (3, 3, 64, 128)) * 0.05).astype(jnp.bfloat16)
        run = jax.jit(lambda x, w: onednn.conv(x, w, None, (1, 1), ((1, 1), (1, 1)), jnp.float32))
        want = jax.lax.conv_general_dilated(x.astype(jnp.bfloat16).astype(jnp.float32), w.astype(jnp.float32),
            (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NHWC", "HWIO", "NHWC"))
        print(max(float(jnp.max(jnp.abs(run(x, w) - want))) for _ in range(20)))
        """
    assert float(run_with_devices(2, code, tmp_path).split()[-1]) < 1e-4


def test_the_engine_in_bf16_on_the_cpu_draws_nearly_the_f32_picture(kernels):
    from engine import load_pipeline

    args = dict(prompt="a red circle", num_inference_steps=4, seed=3, height=64, width=64)
    full = load_pipeline(dtype="float32", previews=False)
    half = load_pipeline(dtype="bfloat16", previews=False)
    try:
        want, got = full.generate(**args).arrays, half.generate(**args).arrays
    finally:
        full.close()
        half.close()
    difference = np.abs(got.astype(np.float64) - want)
    psnr = 10 * np.log10(1.0 / np.mean(difference**2))
    # Stated tolerance: bf16 (8 bits of mantissa) through every layer of the embedded model, 4 steps.
    assert psnr > 30 and difference.mean() < 0.02, (psnr, difference.mean())


def test_without_the_kernels_a_bf16_layer_runs_in_xla(monkeypatch):
    monkeypatch.setattr(onednn, "available", lambda: False)
    linear = _bf16_layer(layers.linear(8, 8, nnx.Rngs(0)))
    x = jnp.ones((2, 8))
    assert "onednn" not in jax.jit(lambda x: linear(x)).lower(x).as_text()
    assert linear(x).dtype == jnp.float32


def test_a_missing_onednn_is_named_with_the_package_that_brings_it(monkeypatch, tmp_path):
    monkeypatch.setenv("DNNL_ROOT", str(tmp_path))
    with pytest.raises(RuntimeError, match="libdnnl-dev"):
        onednn.build()


@pytest.mark.parametrize(
    "native, built, want",
    [(True, True, "bfloat16"), (False, True, "float32"), (True, False, "float32")],
)
def test_the_cpu_runs_bf16_only_with_native_bf16_and_the_kernels(monkeypatch, native, built, want):
    monkeypatch.setattr(onednn, "native_bf16", lambda: native)
    monkeypatch.setattr(onednn, "library", lambda: object() if built else None)
    assert onednn.cpu_dtype() == want


def test_bf16_through_onednn_asks_for_no_core_pairs(monkeypatch):
    monkeypatch.delenv(pairs.SWITCH, raising=False)
    monkeypatch.setattr(pairs, "_backends_started", lambda: False)
    monkeypatch.setattr(pairs.os, "sched_getaffinity", lambda _: {0, 1})
    monkeypatch.setattr(onednn, "library", lambda: object())
    monkeypatch.setenv("XLA_FLAGS", "")
    assert pairs.pair_cores("bfloat16") is False
    assert pairs.DEVICE_COUNT_FLAG not in os.environ["XLA_FLAGS"]


@pytest.mark.parametrize("value", ["float64", "half"])
def test_an_unknown_jax_sd_dtype_is_refused_by_name(monkeypatch, value):
    from engine.serving.start import default_dtype

    monkeypatch.setenv("JAX_SD_DTYPE", value)
    with pytest.raises(ConfigError, match="JAX_SD_DTYPE"):
        default_dtype()


@pytest.mark.parametrize(
    "b, n, m, h, d",
    [
        (1, 1024, 1024, 5, 64),  # self-attention in query blocks (SD 2.1's first level, smaller)
        (2, 333, 333, 3, 40),  # a token count that is no multiple of the 64-query block
        (2, 256, 77, 8, 64),  # cross-attention to the text
    ],
)
def test_bf16_attention_on_the_cpu_runs_in_one_onednn_call(kernels, b, n, m, h, d):
    from engine.nn import attention as attn

    r = np.random.RandomState(0)
    q, k, v = (jnp.asarray(r.randn(b, t, h, d).astype(np.float32), jnp.bfloat16) for t in (n, m, m))
    assert attn.attention_kind("cpu", q, k) == "onednn"
    program = jax.jit(attn.dot_product_attention)
    assert program.lower(q, k, v).as_text().count(onednn.ATTENTION) == 1
    got = program(q, k, v)
    want = attn.softmax_attention(exact(q), exact(k), exact(v))
    assert got.dtype == jnp.bfloat16 and got.shape == (b, n, h, d)
    # bf16 weights into the second product and a bf16 output: about bf16's resolution of the values.
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2, rtol=2e-2)


def test_an_image_with_a_nan_gets_nan_out_and_the_others_their_attention(kernels):
    r = np.random.RandomState(1)
    q, k, v = (jnp.asarray(r.randn(2, 70, 2, 16).astype(np.float32), jnp.bfloat16) for _ in range(3))
    broken = k.at[1, 3, 0, 0].set(jnp.nan)  # a diverged picture in slot 1
    got = np.asarray(onednn.attention(q, broken, v), np.float32)
    assert np.isnan(got[1]).all() and np.isfinite(got[0]).all()
    np.testing.assert_allclose(got[0], np.asarray(onednn.attention(q, k, v), np.float32)[0])
