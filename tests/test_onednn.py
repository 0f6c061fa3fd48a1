"""The CPU's oneDNN kernels: matrix products and convolutions as XLA custom calls (engine/nn/onednn.py).

Each bf16 kernel is compared with XLA computing the same products in f32 from the same bf16-rounded inputs: both
accumulate exact bf16 products in f32, so they agree to f32 rounding. The f32 kernels (the same calls with f32
kernels, which layers take with JAX_SD_ONEDNN=1) equal XLA's f32 to f32 rounding. The whole engine in bf16 is compared
with its f32 pictures (themselves equal to diffusers'). Skipped where the kernels cannot be built (no oneDNN, no
compiler), unless JAX_SD_TEST_ONEDNN=required (CI), where that fails; the bf16 tests are skipped on a CPU without
native bf16 (AVX2 only, AVX-512 without BF16), for which oneDNN 2.x has no bf16 kernels at all, and the f32 ones run
on any x86-64 CPU.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from multidevice import run_with_devices

from engine import cpus
from engine.errors import ConfigError
from engine.nn import kernel_build, layers, onednn
from engine.sampling import pairs


def _built_or_skip() -> None:
    """Skips (or, under JAX_SD_TEST_ONEDNN=required, fails) where the kernels cannot be built and loaded."""
    if onednn.registered():
        return
    try:
        reason = f"the oneDNN kernels are not loaded here: {onednn.build()}"
    except RuntimeError as err:
        reason = str(err)
    if os.environ.get("JAX_SD_TEST_ONEDNN") == "required":
        pytest.fail(reason)
    pytest.skip(reason)


def _kernels_or_skip() -> None:
    if not onednn.native_bf16():
        pytest.skip(onednn.NO_NATIVE_BF16)  # also under JAX_SD_TEST_ONEDNN=required: nothing to build them for
    _built_or_skip()
    assert onednn.available()


@pytest.fixture
def kernels():
    """The bf16 kernels: a CPU with native bf16, the library built."""
    _kernels_or_skip()


@pytest.fixture
def f32_kernels(monkeypatch):
    """The library built (any x86-64 CPU), and layers sending f32 to it (JAX_SD_ONEDNN=1)."""
    _built_or_skip()
    monkeypatch.setenv(onednn.SWITCH, "1")


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


@pytest.mark.parametrize("add_dtype", [None, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("relu", [False, True])
def test_a_bf16_conv_adds_its_residual_and_takes_its_relu_in_the_same_call(kernels, add_dtype, relu):
    conv = _bf16_layer(layers.conv(32, 32, 3, nnx.Rngs(0)))
    x = jax.random.normal(jax.random.key(1), (2, 9, 11, 32)).astype(jnp.bfloat16)
    add = None if add_dtype is None else jax.random.normal(jax.random.key(2), (2, 9, 11, 32)).astype(add_dtype)
    program = jax.jit(lambda x, add: conv(x, add=add, relu=relu))
    text = program.lower(x, add).as_text()
    assert text.count(onednn.CONV) == 1 and "stablehlo.maximum" not in text and "stablehlo.add" not in text
    got = program(x, add)
    want = jax.lax.conv_general_dilated(
        exact(x), exact(conv.kernel[...]), (1, 1), conv.padding, dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    want = want + conv.bias[...] + (0.0 if add is None else add.astype(jnp.float32))
    want = jax.nn.relu(want) if relu else want
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2**-8, atol=1e-5)  # rounded once, to bf16


def _upsample_then_conv(x: jax.Array, kernel: jax.Array, bias: jax.Array | None) -> jax.Array:
    """Nearest 2x, then the 3x3 convolution, in f32 from the bf16-rounded inputs: the plain order."""
    up = jnp.repeat(jnp.repeat(exact(x), 2, axis=1), 2, axis=2)
    out = jax.lax.conv_general_dilated(
        up, exact(kernel), (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return out if bias is None else out + bias


@pytest.mark.parametrize(
    "network, shape",
    [
        ("unet", (2, 5, 7, 64)),  # Upsample2D (the UNet's and the VAE's), odd sides, two images
        ("taesd", (1, 8, 6, 32)),  # TAESD's Upsample then its bias-free conv
    ],
)
@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
def test_a_bf16_upsampling_conv_runs_as_four_phase_convs_and_equals_upsample_then_conv(
    kernels, network, shape, x_dtype
):
    from engine.models import autoencoder_tiny as tiny

    c = shape[-1]
    if network == "unet":
        layer = layers.Upsample2D(c, nnx.Rngs(0))
        conv = _bf16_layer(layer.conv)
        run = layer
    else:
        conv = _bf16_layer(tiny.conv_no_bias(c, c, nnx.Rngs(0)))
        run = lambda x: tiny._run([tiny.Upsample(2), conv], x)  # noqa: E731
    x = jax.random.normal(jax.random.key(1), shape).astype(x_dtype)
    program = jax.jit(lambda x: run(x))
    text = program.lower(x).as_text()
    # one call over x itself: no convolution of XLA's or of ours over an upsampled x
    assert text.count(onednn.UPSAMPLE_CONV) == 1 and onednn.CONV not in text and "stablehlo.convolution" not in text
    got = program(x)
    want = _upsample_then_conv(x, conv.kernel[...], None if conv.bias is None else conv.bias[...])
    assert got.dtype == x_dtype and got.shape == (shape[0], 2 * shape[1], 2 * shape[2], c)
    # Each phase kernel's tap is a sum of up to four bf16 taps rounded once more to bf16; a bf16 output is rounded.
    scale = float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=0, atol=2**-7 * scale)


def test_an_upsampling_conv_to_an_odd_size_upsamples_first(kernels):
    layer = layers.Upsample2D(16, nnx.Rngs(0))
    _bf16_layer(layer.conv)
    x = jax.random.normal(jax.random.key(1), (1, 4, 4, 16))
    program = jax.jit(lambda x: layer(x, (7, 9)))  # the UNet's skip size where a side is no multiple of 2**depth
    assert onednn.UPSAMPLE_CONV not in program.lower(x).as_text()
    assert program(x).shape == (1, 7, 9, 16)


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


def test_f32_layers_keep_xla_s_own_kernels(monkeypatch):
    monkeypatch.delenv(onednn.SWITCH, raising=False)  # not asked for: XLA's f32 is as fast (bench/kernels_f32.py)
    conv, linear = layers.conv(8, 8, 3, nnx.Rngs(0)), layers.linear(8, 8, nnx.Rngs(0))
    x = jnp.ones((1, 4, 4, 8))
    assert "onednn" not in jax.jit(lambda x: linear(conv(x))).lower(x).as_text()


@pytest.mark.parametrize(
    "kernel, stride, padding, shape",
    [
        (3, 1, 1, (2, 17, 20, 64)),  # the UNet's and VAE's 3x3, odd sides
        (3, 2, ((0, 1), (0, 1)), (1, 16, 12, 32)),  # the VAE encoder's downsample
        (1, 1, 0, (2, 8, 8, 96)),  # a 1x1 shortcut
    ],
)
def test_an_f32_conv_asked_for_runs_in_onednn_and_equals_xla_s(f32_kernels, kernel, stride, padding, shape):
    conv = layers.conv(shape[-1], 40, kernel, nnx.Rngs(0), stride=stride, padding=padding)
    x = jax.random.normal(jax.random.key(1), shape)
    program = jax.jit(lambda x: conv(x))
    assert onednn.CONV in program.lower(x).as_text()
    got = program(x)
    want = jax.lax.conv_general_dilated(
        x, conv.kernel[...], conv.strides, conv.padding, dimension_numbers=("NHWC", "HWIO", "NHWC"),
        precision=jax.lax.Precision.HIGHEST,
    ) + conv.bias[...]  # fmt: skip
    assert got.dtype == jnp.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # f32 sums in another order


@pytest.mark.parametrize("shape", [(5, 64), (2, 77, 64)])
def test_an_f32_linear_asked_for_runs_in_onednn_and_equals_xla_s(f32_kernels, shape):
    linear = layers.linear(64, 96, nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), shape)
    program = jax.jit(lambda x: linear(x))
    assert onednn.MATMUL in program.lower(x).as_text()
    got = program(x)
    want = jnp.matmul(x, linear.kernel[...], precision=jax.lax.Precision.HIGHEST) + linear.bias[...]
    assert got.dtype == jnp.float32 and got.shape == shape[:-1] + (96,)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_f32_asked_for_keeps_xla_s_own_norms_and_gates(f32_kernels):
    # Our own f32 loops measured no faster than XLA's passes: only the products go to oneDNN.
    norm, geglu = layers.group_norm(32, 8, 1e-5, nnx.Rngs(0)), layers.GEGLU(32, 16, nnx.Rngs(0))
    x = jnp.ones((1, 4, 4, 32))
    text = jax.jit(lambda x: geglu(norm(x, silu=True))).lower(x).as_text()
    assert onednn.GROUP_NORM not in text and onednn.GEGLU not in text and onednn.MATMUL in text


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
    before = onednn.reordered_bytes()  # what engines of other tests, still open, keep
    full = load_pipeline(dtype="float32", previews=False)
    half = load_pipeline(dtype="bfloat16", previews=False)
    try:
        want, got = full.generate(**args).arrays, half.generate(**args).arrays
        assert onednn.reordered_bytes() > before  # the served bf16 kernels are kept in oneDNN's layout
    finally:
        full.close()
        half.close()
    assert onednn.reordered_bytes() == before  # and freed with the engine
    difference = np.abs(got.astype(np.float64) - want)
    psnr = 10 * np.log10(1.0 / np.mean(difference**2))
    # Stated tolerance: bf16 (8 bits of mantissa) through every layer of the embedded model, 4 steps.
    assert psnr > 30 and difference.mean() < 0.02, (psnr, difference.mean())


@pytest.mark.parametrize(
    "shape, groups",
    [
        ((2, 17, 20, 64), 32),  # two images, a pixel count that is no multiple of the kernel's 256-pixel runs
        ((1, 8, 8, 1280), 32),  # the UNet's deepest level
        ((1, 300, 96), 8),  # a [batch, tokens, channels] input
    ],
)
@pytest.mark.parametrize("silu", [False, True])
def test_a_bf16_group_norm_runs_in_one_call_and_equals_its_f32_numbers(kernels, shape, groups, silu):
    norm = layers.group_norm(shape[-1], groups, 1e-5, nnx.Rngs(0))
    norm.scale.set_value(jax.random.normal(jax.random.key(2), shape[-1:]))
    norm.bias.set_value(jax.random.normal(jax.random.key(3), shape[-1:]))
    x = (jax.random.normal(jax.random.key(1), shape) * 3 + 2).astype(jnp.bfloat16)
    program = jax.jit(lambda x: norm(x, silu=silu))
    assert program.lower(x).as_text().count(onednn.GROUP_NORM) == 1
    got = program(x)
    want = norm(x.astype(jnp.float32), silu=silu)  # XLA's passes in f32 over the same bf16 input
    assert got.dtype == jnp.bfloat16 and got.shape == shape
    # within the output's bf16 rounding (2^-8 relative), plus the f32 statistics' summation order
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2**-8, atol=2e-3)


def test_a_group_norm_with_nan_in_one_image_leaves_the_other_image_alone(kernels):
    norm = layers.group_norm(32, 8, 1e-5, nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 6, 6, 32)).astype(jnp.bfloat16)
    broken = x.at[0, 3, 3, 5].set(jnp.nan)
    got = np.asarray(norm(broken, silu=True), np.float32)
    assert np.isnan(got[0]).any() and not np.isnan(got[1]).any()
    np.testing.assert_array_equal(got[1], np.asarray(norm(x, silu=True), np.float32)[1])


@pytest.mark.parametrize("shape", [(4096 // 16, 2 * 320), (2, 33, 2 * 64)])
def test_bf16_geglu_runs_in_one_call_and_equals_its_f32_numbers(kernels, shape):
    geglu = layers.GEGLU(64, shape[-1] // 2, nnx.Rngs(0))
    _bf16_layer(geglu.proj)
    x = jax.random.normal(jax.random.key(1), shape[:-1] + (64,)).astype(jnp.bfloat16)
    program = jax.jit(lambda x: geglu(x))
    assert program.lower(x).as_text().count(onednn.GEGLU) == 1
    got = program(x)
    y = geglu.proj(x).astype(jnp.float32)  # the projection's bf16 output, which the call reads
    hidden, gate = jnp.split(y, 2, axis=-1)
    want = hidden * jax.nn.gelu(gate, approximate=False)
    assert got.dtype == jnp.bfloat16 and got.shape == shape[:-1] + (shape[-1] // 2,)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2**-8, atol=1e-5)


@pytest.mark.parametrize("layer", ["conv", "upsample_conv", "linear"])
def test_a_pinned_kernel_is_reordered_once_and_gives_the_same_numbers(kernels, layer):
    if layer == "upsample_conv":
        kernel = (jax.random.normal(jax.random.key(1), (3, 3, 64, 128)) * 0.05).astype(jnp.bfloat16)
        x = jax.random.normal(jax.random.key(0), (1, 8, 8, 64))
        run = jax.jit(lambda x, w: onednn.upsample_conv(x, w, None, jnp.float32))
    elif layer == "conv":
        kernel = (jax.random.normal(jax.random.key(1), (3, 3, 64, 128)) * 0.05).astype(jnp.bfloat16)
        x = jax.random.normal(jax.random.key(0), (1, 16, 16, 64))
        run = jax.jit(lambda x, w: onednn.conv(x, w, None, (1, 1), ((1, 1), (1, 1)), jnp.float32))
    else:
        kernel = (jax.random.normal(jax.random.key(1), (256, 384)) * 0.05).astype(jnp.bfloat16)
        x = jax.random.normal(jax.random.key(0), (77, 256))
        run = jax.jit(lambda x, w: onednn.matmul(x, w, None, jnp.float32))
    want = np.asarray(run(x, kernel))  # reordered at every call
    before = onednn.reordered_bytes()
    pinned = onednn.pin({"kernel": kernel, "bias": jnp.zeros(128, jnp.bfloat16)})
    assert len(pinned.buffers) == 1  # the kernel, not the 1-D bias
    try:
        np.testing.assert_array_equal(run(x, kernel), want)
        assert onednn.reordered_bytes() - before >= kernel.nbytes  # kept after its first call
        np.testing.assert_array_equal(run(x, kernel), want)  # from the kept copy
    finally:
        pinned.release()
    assert onednn.reordered_bytes() == before
    # After release the buffer is not trusted any more: an array that takes it over gets its own numbers.
    shape = kernel.shape
    del kernel
    other = (jax.random.normal(jax.random.key(5), shape) * 0.05).astype(jnp.bfloat16)
    if layer == "upsample_conv":
        fresh = _upsample_then_conv(x, other, None)
        np.testing.assert_allclose(run(x, other), fresh, rtol=0, atol=2**-7 * float(jnp.max(jnp.abs(fresh))))
        return
    if layer == "conv":
        fresh = jax.lax.conv_general_dilated(
            exact(x), other.astype(jnp.float32), (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NHWC", "HWIO", "NHWC")
        )
    else:
        fresh = exact(x) @ other.astype(jnp.float32)
    np.testing.assert_allclose(run(x, other), fresh, rtol=1e-5, atol=1e-5)


def _huge_page_mappings() -> dict[int, int]:
    """This process's mappings advised for transparent huge pages (VmFlags "hg"): start address -> length."""
    found, start, length = {}, 0, 0
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):
                low, high = (int(end, 16) for end in first.split("-"))
                start, length = low, high - low
            elif first == "VmFlags:" and "hg" in line.split()[1:]:
                found[start] = length
    return found


@pytest.mark.skipif(not os.path.isdir("/sys/kernel/mm/transparent_hugepage"), reason="no transparent huge pages here")
def test_a_kept_kernel_of_a_huge_page_or_more_is_mapped_for_huge_pages(f32_kernels):
    # A step reads every kept kernel once from memory; in 4 KB pages each page costs a TLB miss. A kernel that spans
    # a 2 MB page gets a mapping of its own, on a 2 MB boundary, advised for huge pages, and loses it on release.
    kernel = jax.random.normal(jax.random.key(1), (3, 3, 256, 512)) * 0.05  # 4.7 MB in f32, reordered on any CPU
    x = jax.random.normal(jax.random.key(0), (1, 8, 8, 256))
    run = jax.jit(lambda x, w: onednn.conv(x, w, None, (1, 1), ((1, 1), (1, 1)), jnp.float32))
    want = np.asarray(run(x, kernel))  # reordered at every call, nothing kept
    before, kept = _huge_page_mappings(), onednn.reordered_bytes()
    pinned = onednn.pin({"kernel": kernel}, dtypes=(jnp.float32,))
    try:
        np.testing.assert_array_equal(run(x, kernel), want)
        size = onednn.reordered_bytes() - kept
        assert size >= kernel.nbytes
        new = {start: length for start, length in _huge_page_mappings().items() if start not in before}
        assert list(new.values()) == [-(-size // 4096) * 4096]  # the copy's bytes to the page, no more
        assert all(start % (2 << 20) == 0 for start in new)
    finally:
        pinned.release()
    assert not set(_huge_page_mappings()) & set(new)  # unmapped with the kept copy


def test_f32_params_pin_nothing(kernels):
    assert onednn.pin({"kernel": jnp.ones((3, 3, 8, 8)), "dense": jnp.ones((8, 8))}).buffers == []


def test_without_the_kernels_a_bf16_layer_runs_in_xla(monkeypatch):
    monkeypatch.setattr(onednn, "handlers", lambda: None)  # as where they cannot be built, whatever the CPU
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
    monkeypatch.setattr(pairs, "backends_started", lambda: False)
    monkeypatch.setattr(pairs.cpus, "fit_threads", lambda: None)
    monkeypatch.setattr(pairs.os, "sched_getaffinity", lambda _: {0, 1})
    monkeypatch.setattr(onednn, "native_bf16", lambda: True)
    monkeypatch.setattr(onednn, "handlers", lambda: object())
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
        (2, 333, 333, 3, 40),  # a token count that is no multiple of the 256-query block
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


def test_bf16_attention_whose_logits_grow_from_chunk_to_chunk_equals_the_plain_formulation(kernels):
    """On AMX the keys are taken 512 at a time with the softmax online: each chunk's weights against the row's
    maximum so far, the earlier chunks' sums rescaled when it grows. Keys that grow along the sequence make every
    chunk's maximum larger than the last, so a rescaling missed or misapplied is off by far more than bf16's
    resolution; 1,100 keys end in a short chunk and 300 queries in a short block (one chunk elsewhere)."""
    from engine.nn import attention as attn

    r = np.random.RandomState(4)
    q, k, v = (r.randn(1, t, 2, 64).astype(np.float32) for t in (300, 1100, 1100))
    k *= np.linspace(0.5, 3.0, 1100, dtype=np.float32)[None, :, None, None]
    q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in (q, k, v))
    got = np.asarray(jax.jit(onednn.attention)(q, k, v), np.float32)
    want = attn.softmax_attention(exact(q), exact(k), exact(v))
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)


def _exact_attention(q, k, v, causal: bool = False, key_mask=None) -> np.ndarray:
    """softmax(q k^T / sqrt(d)) v in float64, of q, k and v as given: [B, N, H, D] each; `causal`: query i sees
    keys 0..i; `key_mask` [B, M]: the keys each image may attend."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    logits = np.einsum("bnhd,bmhd->bhnm", q, k) / np.sqrt(q.shape[-1])
    if causal:
        logits = np.where(np.tril(np.ones(logits.shape[-2:], bool)), logits, -np.inf)
    if key_mask is not None:
        logits = np.where(np.asarray(key_mask)[:, None, None, :], logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    return np.einsum("bhnm,bmhd->bnhd", weights / weights.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("d", [40, 64, 128, 160])
def test_bf16_attention_is_within_bf16_rounding_of_the_exact_one_at_every_head_width(kernels, d):
    """On AMX the products run on tiles of our own packing (attention_amx.cc): the head's width padded to 32, the
    keys in chunks of up to 512 (here two, the last one short and padded to 32), queries 16 at a time (the last
    group short). Against the exact attention of the same bf16 inputs, every value is within what bf16 weights and
    a bf16 output allow, and the mean error is a tenth of that: one key, column or pair out of place moves it by
    far more."""
    r = np.random.RandomState(d)
    q, k, v = (jnp.asarray(r.randn(2, t, 3, d).astype(np.float32), jnp.bfloat16) for t in (50, 601, 601))
    k = k * 2  # sharper weights than random ones: the softmax's maximum matters
    error = np.abs(np.asarray(jax.jit(onednn.attention)(q, k, v), np.float64) - _exact_attention(q, k, v))
    assert error.max() < 1.5e-2 and error.mean() < 1e-3, (error.max(), error.mean())
    if "amx_bf16" in onednn.cpu_flags() and not os.environ.get("ONEDNN_MAX_CPU_ISA"):
        assert onednn.attention_on_amx()


@pytest.mark.parametrize("d", [40, 64])
def test_bf16_causal_attention_is_within_bf16_rounding_of_the_exact_masked_one(kernels, d):
    """Query i sees keys 0..i (the text encoders' self-attention). On AMX a group of 16 queries stops at the last
    chunk of keys it sees (601 keys: two chunks of 512 and 89), and inside a chunk the later keys weigh nothing. One
    key seen too many or too few moves a row by far more than bf16's rounding; the first query sees only the first
    key, so its output is that key's value exactly."""
    r = np.random.RandomState(d)
    q, k, v = (jnp.asarray(r.randn(2, 601, 3, d).astype(np.float32), jnp.bfloat16) for _ in range(3))
    k = k * 2  # sharper weights than random ones: the softmax's maximum matters
    got = np.asarray(jax.jit(lambda q, k, v: onednn.attention(q, k, v, causal=True))(q, k, v), np.float64)
    error = np.abs(got - _exact_attention(q, k, v, causal=True))
    assert error.max() < 1.5e-2 and error.mean() < 1e-3, (error.max(), error.mean())
    np.testing.assert_array_equal(got[:, 0], np.asarray(v[:, 0], np.float64))
    with pytest.raises(ValueError, match="as many keys as queries"):
        onednn.attention(q[:, :600], k, v, causal=True)


@pytest.mark.parametrize("d", [64, 128])
def test_bf16_attention_under_a_key_mask_is_within_bf16_rounding_of_the_exact_one(kernels, d):
    """Each image attends the keys its mask allows (Z-Image's padded captions): here 601 keys, two chunks on AMX, the
    first image seeing keys on both sides of the chunks' boundary, the second only its first 100. A masked key that
    counted would move rows by far more than bf16's rounding; an image whose mask allows no key gets the plain
    formulation's uniform weights (the mean of its values), not NaN."""
    from engine.nn import attention as attn

    r = np.random.RandomState(d)
    q, k, v = (jnp.asarray(r.randn(3, t, 2, d).astype(np.float32), jnp.bfloat16) for t in (50, 601, 601))
    k = k * 2
    mask = np.zeros((3, 601), bool)
    mask[0, 400:560] = mask[0, :30] = True
    mask[1, :100] = True  # the third image: no key at all
    got = np.asarray(jax.jit(lambda q, k, v, m: onednn.attention(q, k, v, key_mask=m))(q, k, v, mask), np.float64)
    error = np.abs(got[:2] - _exact_attention(q[:2], k[:2], v[:2], key_mask=mask[:2]))
    assert error.max() < 1.5e-2 and error.mean() < 1e-3, (error.max(), error.mean())
    uniform = np.asarray(attn.softmax_attention(exact(q), exact(k), exact(v), jnp.asarray(mask)[:, None, None]))
    np.testing.assert_allclose(got[2], uniform[2], atol=2e-2)
    np.testing.assert_allclose(
        got[2], np.broadcast_to(np.asarray(exact(v), np.float64)[2].mean(0), got[2].shape), atol=2e-2
    )
    with pytest.raises(ValueError, match="not with causal"):
        onednn.attention(q, q, q, causal=True, key_mask=mask[:, :50])


def test_f32_attention_under_a_key_mask_in_onednn_equals_the_masked_plain_formulation():
    """Any x86-64 CPU: the same mask over the f32 softmax in place, the second block of queries shorter."""
    _built_or_skip()
    from engine.nn import attention as attn

    r = np.random.RandomState(4)
    q, k, v = (jnp.asarray(r.randn(2, t, 3, 40).astype(np.float32) * 2) for t in (333, 1027, 1027))
    mask = np.arange(1027)[None, :] < np.array([[1000], [77]])
    got = jax.jit(lambda q, k, v, m: onednn.attention(q, k, v, key_mask=m))(q, k, v, mask)
    want = attn.softmax_attention(q, k, v, jnp.asarray(mask)[:, None, None])
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)  # exp's polynomial: 3e-6 relative


def test_f32_causal_attention_in_onednn_equals_the_masked_plain_formulation_to_f32_rounding():
    """Any x86-64 CPU: the f32 softmax in place (AVX-512, AVX2 or plain C++) over logits whose later keys are hidden;
    333 queries: a block of 256 and a shorter one, the second seeing more keys than the first."""
    _built_or_skip()
    from engine.nn import attention as attn

    r = np.random.RandomState(3)
    q, k, v = (jnp.asarray(r.randn(2, 333, 3, 40).astype(np.float32) * 2) for _ in range(3))
    got = jax.jit(lambda q, k, v: onednn.attention(q, k, v, causal=True))(q, k, v)
    want = attn.softmax_attention(q, k, v, jnp.tril(jnp.ones((333, 333), bool)))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)  # exp's polynomial: 3e-6 relative


@pytest.mark.parametrize("activation", sorted(layers.ACTIVATIONS))
def test_a_matmuls_activation_runs_on_its_f32_sums_inside_the_product(kernels, activation):
    """GELU (exact or tanh) and quick GELU as oneDNN post-ops: the activation of the f32 sums, bias added, before the
    output's rounding; against XLA computing the same of the same bf16-rounded inputs in f32."""
    x = jax.random.normal(jax.random.key(0), (77, 256)) * 2
    kernel = (jax.random.normal(jax.random.key(1), (256, 384)) * 0.1).astype(jnp.bfloat16)
    bias = jax.random.normal(jax.random.key(2), (384,))
    sums = jnp.matmul(exact(x), kernel.astype(jnp.float32), precision="highest") + bias
    want = layers.ACTIVATIONS[activation](sums)
    got = jax.jit(lambda x: onednn.matmul(x, kernel, bias, jnp.float32, activation))(x)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    assert float(jnp.abs(want - sums).max()) > 0.1  # what the activation changes, far past the tolerance
    rounded = jax.jit(lambda x: onednn.matmul(x, kernel, bias, jnp.bfloat16, activation))(x)
    np.testing.assert_allclose(rounded.astype(jnp.float32), want, rtol=2**-8, atol=1e-3)  # rounded once


@pytest.mark.parametrize("factor_dtype", [jnp.bfloat16, jnp.float32])
def test_a_matmul_multiplies_its_activated_sums_by_a_factor_inside_the_product(kernels, factor_dtype):
    """SwiGLU's silu(gate x) * up x (Z-Image's and Qwen3's MLPs): the factor, of the output's shape, multiplies the
    activated f32 sums before their rounding; and without an activation, the plain sums."""
    x = jax.random.normal(jax.random.key(0), (2, 40, 256)) * 2
    kernel = (jax.random.normal(jax.random.key(1), (256, 384)) * 0.1).astype(jnp.bfloat16)
    factor = jax.random.normal(jax.random.key(3), (2, 40, 384)).astype(factor_dtype)
    sums = jnp.matmul(exact(x), kernel.astype(jnp.float32), precision="highest")
    for activation in ("silu", None):
        want = (layers.ACTIVATIONS[activation](sums) if activation else sums) * factor.astype(jnp.float32)
        got = jax.jit(lambda x, f, a=activation: onednn.matmul(x, kernel, None, jnp.float32, a, f))(x, factor)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="output's shape"):
        onednn.matmul(x, kernel, None, jnp.float32, "silu", factor[:, :20])


@pytest.mark.parametrize("hidden_act", ["quick_gelu", "gelu"])
def test_the_bf16_text_encoder_with_its_attention_and_gelu_in_onednn_is_its_f32_self_to_bf16_rounding(
    kernels, hidden_act
):
    """The CLIP text encoder in bf16 on the CPU: causal attention in one call, the MLP's activation inside its first
    product. Against the same encoder in f32 in XLA (itself equal to transformers'), bf16's rounding through three
    layers moves the hidden states (up to 3.9) by 0.03 at most here; attention that is not causal, by 3.4."""
    from engine.models.clip import CLIPTextModel
    from engine.models.config import CLIPTextConfig

    cfg = CLIPTextConfig(
        vocab_size=99, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        hidden_act=hidden_act, eos_token_id=98,
    )  # fmt: skip
    graphdef, params = nnx.split(CLIPTextModel(cfg, nnx.Rngs(0)))
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), params)  # the same numbers in both
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 98, (2, 77)), jnp.int32)
    run = jax.jit(lambda params, ids: nnx.merge(graphdef, params)(ids).last_hidden_state)
    want = np.asarray(run(params, ids))
    got = np.asarray(run(jax.tree.map(lambda a: a.astype(jnp.bfloat16), params), ids), np.float32)
    assert np.abs(got - want).max() < 0.1, np.abs(got - want).max()


def test_an_image_with_a_nan_gets_nan_out_and_the_others_their_attention(kernels):
    r = np.random.RandomState(1)
    q, k, v = (jnp.asarray(r.randn(2, 70, 2, 16).astype(np.float32), jnp.bfloat16) for _ in range(3))
    broken = k.at[1, 3, 0, 0].set(jnp.nan)  # a diverged picture in slot 1
    got = np.asarray(onednn.attention(q, broken, v), np.float32)
    assert np.isnan(got[1]).all() and np.isfinite(got[0]).all()
    np.testing.assert_allclose(got[0], np.asarray(onednn.attention(q, k, v), np.float32)[0])


@pytest.mark.parametrize(
    "b, n, m, h, d",
    [
        (1, 1024, 1024, 5, 64),  # self-attention (SD 2.1's first level at 256x256)
        (2, 333, 1027, 3, 40),  # no multiple of the 256-query block, nor of the softmax's 8 or 16 lanes
        (2, 256, 77, 8, 64),  # cross-attention to the text
    ],
)
def test_f32_attention_in_onednn_equals_the_plain_formulation_to_f32_rounding(b, n, m, h, d):
    """Any x86-64 CPU: f32 products in oneDNN and the f32 softmax in place (AVX-512, AVX2 or plain C++)."""
    _built_or_skip()
    from engine.nn import attention as attn

    r = np.random.RandomState(2)
    q, k, v = (jnp.asarray(r.randn(b, t, h, d).astype(np.float32) * 2) for t in (n, m, m))
    got = jax.jit(onednn.attention)(q, k, v)
    assert got.dtype == jnp.float32 and got.shape == (b, n, h, d)
    want = attn.softmax_attention(q, k, v)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)  # exp's polynomial: 3e-6 relative


def test_f32_attention_whose_far_keys_underflow_equals_the_plain_formulation():
    """Logits spread over hundreds: most keys' weights fall to 2^-126 or below, and their products with v underflow
    (flushed to zero, as XLA's own threads compute), which changes nothing the plain formulation keeps. Logits of
    about 200 carry f32 rounding of about 2e-5 each, which the weights carry over: so both are held to the exact
    result (float64), ours no further from it than twice XLA's own f32 formulation (measured on a Xeon with AVX-512:
    1.6x, capped to AVX2 1.6x, to SSE4.1 1.8x)."""
    _built_or_skip()
    from engine.nn import attention as attn

    r = np.random.RandomState(3)
    q, k, v = (r.randn(1, 300, 2, 64).astype(np.float32) * g for g in (40, 1, 1))
    got = np.asarray(jax.jit(onednn.attention)(q, k, v))
    want = np.asarray(attn.softmax_attention(q, k, v))
    logits = np.einsum("bnhd,bmhd->bhnm", q.astype(np.float64), k.astype(np.float64)) / 8
    below = logits.max(axis=-1, keepdims=True) - logits > 88  # exp(-88) < 2^-126, the smallest normal float
    assert float(below.mean()) > 0.5
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    exact = np.einsum("bhnm,bmhd->bnhd", weights / weights.sum(axis=-1, keepdims=True), v.astype(np.float64))
    xla_error = np.abs(want - exact).max()
    assert xla_error < 1e-4
    assert np.abs(got - exact).max() <= 2 * xla_error


def test_an_f32_1x1_convolution_runs_in_onednn_where_the_kernels_are_loaded_and_a_3x3_one_in_xla(monkeypatch):
    """A w8a8 denoiser's f32 shortcuts: oneDNN's 1x1 kernel is twice XLA's on AVX2, its 3x3 ones are not."""
    _built_or_skip()
    monkeypatch.delenv(onednn.SWITCH, raising=False)  # f32 layers otherwise in XLA
    assert onednn.loaded() and onednn.serves_pointwise(jnp.float32) and not onednn.serves(jnp.float32)
    x = jax.random.normal(jax.random.key(0), (1, 6, 5, 24))
    for size, calls in ((1, 1), (3, 0)):
        conv = layers.conv(24, 16, size, nnx.Rngs(0), padding=size // 2)
        program = jax.jit(lambda x, conv=conv: conv(x))
        assert program.lower(x).as_text().count(onednn.CONV) == calls
        want = jax.lax.conv_general_dilated(
            x, conv.kernel[...], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
            precision=jax.lax.Precision.HIGHEST,
        ) + conv.bias[...]  # fmt: skip
        np.testing.assert_allclose(program(x), want, rtol=1e-5, atol=1e-5)
    assert not onednn.serves_pointwise(jnp.bfloat16)


def test_long_f32_self_attention_runs_in_one_onednn_call_where_the_kernels_are_loaded():
    _built_or_skip()
    from engine.nn import attention as attn

    assert onednn.loaded()
    long_q = jax.ShapeDtypeStruct((1, 4096, 5, 64), jnp.float32)
    assert attn.attention_kind("cpu", long_q, long_q) == "onednn"
    text = jax.ShapeDtypeStruct((1, 77, 5, 64), jnp.float32)  # 77 keys: XLA's own is faster
    assert attn.attention_kind("cpu", long_q, text) != "onednn"
    q = jnp.ones((1, attn.CPU_ONEDNN_F32_KEYS, 2, 8), jnp.float32)
    assert jax.jit(attn.dot_product_attention).lower(q, q, q).as_text().count(onednn.ATTENTION) == 1


def test_an_image_with_a_nan_gets_nan_out_in_f32_attention_too():
    _built_or_skip()
    r = np.random.RandomState(1)
    q, k, v = (jnp.asarray(r.randn(2, 70, 2, 16).astype(np.float32)) for _ in range(3))
    broken = k.at[1, 3, 0, 0].set(jnp.inf)
    got = np.asarray(onednn.attention(q, broken, v))
    assert np.isnan(got[1]).all() and np.isfinite(got[0]).all()
    np.testing.assert_allclose(got[0], np.asarray(onednn.attention(q, k, v))[0])


def test_a_cpu_without_native_bf16_gets_no_kernels_whatever_is_installed(monkeypatch):
    monkeypatch.delenv(onednn.SWITCH, raising=False)
    monkeypatch.setattr(onednn, "native_bf16", lambda: False)
    monkeypatch.setattr(onednn, "build", lambda: pytest.fail("nothing is built for a CPU without native bf16"))
    assert onednn.library.__wrapped__() is None


def _fake_onednn(monkeypatch, tmp_path, script: str) -> None:
    """A oneDNN install of one header, and a compiler that runs `script` (sh) and logs each start."""
    header = tmp_path / "include" / "oneapi" / "dnnl" / "dnnl_version.h"
    header.parent.mkdir(parents=True)
    header.write_text("#define DNNL_VERSION_MAJOR 2\n")
    monkeypatch.setattr(kernel_build, "find_onednn", lambda: (tmp_path / "include", tmp_path / "lib"))
    compiler = tmp_path / "fake-c++"
    compiler.write_text(f"#!/bin/sh\necho started >> {tmp_path}/starts\n{script}\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("JAX_SD_KERNEL_DIR", str(tmp_path / "kernels"))


def _starts(tmp_path) -> int:
    return len((tmp_path / "starts").read_text().splitlines())


def test_a_failed_build_is_remembered_with_its_reason_and_not_retried(monkeypatch, tmp_path):
    _fake_onednn(monkeypatch, tmp_path, "echo 'onednn.cc:1: error: no such thing' >&2; exit 1")
    with pytest.raises(RuntimeError, match="failed: onednn.cc:1: error: no such thing"):
        onednn.build()
    (marker,) = (tmp_path / "kernels").glob("*.failed")
    assert "no such thing" in marker.read_text()
    sources = len(kernel_build.units(cpus.usable_cpus()))
    assert _starts(tmp_path) == sources  # each translation unit compiled; no link after a failure
    with pytest.raises(RuntimeError, match="no such thing.*an earlier start"):
        onednn.build()
    assert _starts(tmp_path) == sources  # not run again
    marker.unlink()  # what the message says to do
    with pytest.raises(RuntimeError, match="no such thing"):
        onednn.build()
    assert _starts(tmp_path) == 2 * sources


@pytest.mark.parametrize("most", [1, 2, 3, 4, 16])
def test_the_sources_compile_in_one_translation_unit_per_cpu_each_source_once(most):
    groups = kernel_build.units(most)
    assert len(groups) == min(most, len(kernel_build.SOURCES))
    assert sorted(source for group in groups for source in group) == sorted(kernel_build.SOURCES)


def test_all_the_sources_compile_as_one_translation_unit(tmp_path):
    # A process with one CPU builds them so: no two sources may define the same name (checked, not compiled).
    found = kernel_build.find_onednn()
    if found is None or not (os.environ.get("CXX") or shutil.which("g++")):
        pytest.skip("no oneDNN headers or no C++ compiler here")
    (unit,) = kernel_build.units(1)
    source = tmp_path / "unit.cc"
    source.write_text("".join(f'#include "{member}"\n' for member in unit))
    system = [f"-isystem{jax.ffi.include_dir()}", f"-isystem{found[0]}"]
    command = [os.environ.get("CXX") or "g++", "-fsyntax-only", "-fopenmp", "-std=c++17", "-Wall", "-Werror"]
    done = subprocess.run([*command, *system, str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_build_past_its_timeout_is_stopped_and_remembered(monkeypatch, tmp_path):
    _fake_onednn(monkeypatch, tmp_path, "sleep 30")  # a child of the compiler's that holds its output open
    monkeypatch.setenv(kernel_build.BUILD_TIMEOUT, "0.5")
    with pytest.raises(RuntimeError, match=f"took over 0.5 s \\({kernel_build.BUILD_TIMEOUT}\\)"):
        onednn.build()
    started = _starts(tmp_path)  # the compiles side by side, as many as the CPUs; none once the time is up
    assert 1 <= started <= min(len(kernel_build.SOURCES), cpus.usable_cpus())
    with pytest.raises(RuntimeError, match="took over 0.5 s.*an earlier start"):
        onednn.build()
    assert _starts(tmp_path) == started  # not run again


@pytest.mark.parametrize(
    "native, switch, level", [(True, None, "WARNING"), (False, "1", "WARNING"), (True, "0", "INFO")]
)
def test_kernels_off_are_said_at_warning_where_they_would_serve_with_the_fix(
    monkeypatch, caplog, native, switch, level
):
    monkeypatch.setattr(onednn, "native_bf16", lambda: native)
    if switch is None:
        monkeypatch.delenv(onednn.SWITCH, raising=False)
    else:
        monkeypatch.setenv(onednn.SWITCH, switch)

    def missing():
        raise RuntimeError("no oneDNN under /usr")

    monkeypatch.setattr(onednn, "build", missing)
    with caplog.at_level(logging.INFO, logger=onednn.log.name):
        assert onednn.handlers.__wrapped__() is None
    (record,) = [r for r in caplog.records if r.name == onednn.log.name]
    assert record.levelname == level
    if level == "WARNING":
        assert "no oneDNN under /usr" in record.getMessage() and onednn.FIX in record.getMessage()
    else:
        assert f"{onednn.SWITCH}=0" in record.getMessage()


@pytest.mark.parametrize(
    "dtype, backend, native, served, want",
    [
        ("bfloat16", "cpu", True, True, "bfloat16, oneDNN's bf16 kernels"),
        ("bfloat16", "cpu", False, False, "bfloat16, XLA (avx2, no native bfloat16: slower than float32 here)"),
        ("float32", "cpu", False, False, "float32, XLA (avx2)"),
        ("float32", "cpu", False, True, "float32, oneDNN's f32 kernels (avx2)"),
        ("bfloat16", "gpu", False, False, "bfloat16, XLA on gpu"),
    ],
)
def test_the_compute_path_names_the_dtype_and_what_computes(monkeypatch, dtype, backend, native, served, want):
    monkeypatch.setattr(onednn, "native_bf16", lambda: native)
    monkeypatch.setattr(onednn, "vector_isa", lambda: "avx512_bf16" if native else "avx2")
    monkeypatch.setattr(onednn, "serves", lambda kernel_dtype: served and jnp.dtype(kernel_dtype) == jnp.dtype(dtype))
    assert onednn.compute_path(dtype, backend).startswith(want)
    assert onednn.slow_half(dtype, backend) == ("slower" in want)
