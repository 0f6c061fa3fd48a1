"""int8 compute (`load_pipeline(quantize="w8a8")`, engine/nn/int8.py): the UNet's linear layers and convolutions
with int8 weights per output channel and activations quantized per call.

The int32 sums are exact: oneDNN's int8 convolution (int8.cc; skipped where the kernels cannot be built) and XLA's
own int8 path each equal numpy's integer arithmetic, at the extremes of the ranges too (u8 255 times s8 +-63, where
AVX2's s16 pair sums would saturate if the weights took 8 bits). Each quantized layer equals its f32 layer within the
bound that the quantization steps themselves give, element by element. The weights quantize within half a step and
only the chosen kernels change; the embedded model's w8a8 pictures stay near its f32 ones (PSNR), and so does a
TAESD decoder's picture with its inner convolutions in int8.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from engine import load_pipeline
from engine.errors import ConfigError
from engine.families.base import Models, scaled_decode
from engine.families.loader import load_model_folder
from engine.loading.quantize import computes_in_int8, quantize_params, quantize_tiny_decoder, streaming
from engine.models.autoencoder_tiny import AutoencoderTiny
from engine.models.config import AutoencoderTinyConfig
from engine.nn import int8, layers, onednn
from engine.sampling.prompts import tokenize_plain


def _onednn_or_skip() -> None:
    if onednn.registered():
        return
    try:
        reason = f"the oneDNN kernels are not loaded here: {onednn.build()}"
    except RuntimeError as err:
        reason = str(err)
    if os.environ.get("JAX_SD_TEST_ONEDNN") == "required":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(params=["onednn", "xla"])
def path(request, monkeypatch):
    """Which computes the int32 sums: oneDNN's int8 kernels, or XLA's own int8 convolution (where they are off)."""
    if request.param == "onednn":
        _onednn_or_skip()
    else:
        monkeypatch.setattr(int8.onednn, "registered", lambda: False)
    return request.param


def integer_conv(q: np.ndarray, values: np.ndarray, stride: int) -> np.ndarray:
    """The exact sums of an unpadded NHWC x HWIO convolution, in int64."""
    kh, kw, _, _ = values.shape
    out_h, out_w = (q.shape[1] - kh) // stride + 1, (q.shape[2] - kw) // stride + 1
    out = np.zeros((q.shape[0], out_h, out_w, values.shape[-1]), np.int64)
    for i in range(kh):
        for j in range(kw):
            taps = q[:, i : i + stride * (out_h - 1) + 1 : stride, j : j + stride * (out_w - 1) + 1 : stride]
            out += np.einsum("bhwc,co->bhwo", taps.astype(np.int64), values[i, j].astype(np.int64))
    return out


# (batch, h, w, in, kernel, out, stride): a 3x3, a strided 3x3 (the downsamplers), a 1x1 over tokens (a linear)
SHAPES = [(1, 10, 12, 40, 3, 24, 1), (2, 9, 9, 16, 3, 8, 2), (1, 37, 1, 64, 1, 48, 1)]


@pytest.mark.parametrize("shape", SHAPES)
def test_the_int32_sums_equal_integer_arithmetic(path, shape):
    b, h, w, c, k, o, stride = shape
    rng = np.random.default_rng(0)
    q = rng.integers(0, 256, (b, h, w, c)).astype(np.uint8)
    values = rng.integers(-63, 64, (k, k, c, o)).astype(np.int8)
    q[0, :k, :k] = 255  # the extremes: 255 * 63 twice in a pair is the largest s16 pair sum, and it fits
    values[..., 0], values[..., 1] = 63, -63
    sums = jnp.asarray(values.astype(np.int32).reshape(-1, o).sum(0))
    got = np.asarray(jax.jit(lambda q, v: int8.int_conv(q, v, sums, (stride, stride)))(q, values))
    want = integer_conv(q, values, stride)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    assert want[0, 0, 0, 0] == 255 * 63 * k * k * c  # the corner saw only extremes


def test_a_kernel_quantizes_within_half_a_step_in_7_bits():
    w = np.random.default_rng(0).standard_normal((3, 3, 16, 8)).astype(np.float32) * np.logspace(-3, 1, 8)
    w[..., 2] = 0.0
    q = int8.quantize_kernel(w)
    assert q.values.dtype == np.int8 and np.abs(q.values).max() == 63
    assert np.all(np.abs(q.values * q.scale - w) <= q.scale / 2 * (1 + 1e-6))
    assert q.scale[2] == 0 and not q.values[..., 2].any()
    np.testing.assert_array_equal(q.sums, q.values.reshape(-1, 8).astype(np.int32).sum(0))


def error_bound(x, w, q, step, per_token: bool) -> np.ndarray:
    """Worst-case |int8 layer - f32 layer| per output: each product x * w off by at most |x| * scale / 2 (the
    weight's rounding) + |w| * step / 2 (the activation's) + step * scale / 4, summed over the inputs each output
    reads (x and w as patches [outputs, inputs] for a convolution)."""
    step = step if per_token else np.full((x.shape[0], 1), step)
    return (
        np.abs(x) @ np.broadcast_to(q.scale / 2, w.shape)
        + step / 2 * np.abs(w).sum(0)
        + step * x.shape[1] * q.scale / 4
    )


def test_a_linear_layer_stays_within_its_quantization_steps(path):
    rng = np.random.default_rng(1)
    layer = layers.linear(96, 40, nnx.Rngs(0))
    x = rng.standard_normal((2, 33, 96)).astype(np.float32) * np.linspace(0.1, 4.0, 33)[:, None]  # tokens' sizes
    want = np.asarray(layer(jnp.asarray(x)))
    q = int8.quantize_kernel(layer.kernel[...])
    layer.kernel.set_value(q)
    got = np.asarray(jax.jit(lambda x: layer(x))(x))
    _, step, _ = int8.quantize_activations(jnp.asarray(x.reshape(-1, 96)), per_token=True)
    bound = error_bound(x.reshape(-1, 96), np.asarray(layer.kernel.get_value().dequantize()), q, np.asarray(step), True)
    err = np.abs(got - want).reshape(-1, 40)
    assert np.all(err <= bound * 1.001 + 1e-5)
    assert 0 < err.max() and err.max() < 0.02 * np.abs(want).max()  # quantized, and close


@pytest.mark.parametrize("stride", [1, 2])
def test_a_convolution_stays_within_its_quantization_steps(path, stride):
    rng = np.random.default_rng(2)
    layer = layers.conv(24, 16, 3, nnx.Rngs(0), stride=stride)
    x = jax.nn.silu(rng.standard_normal((1, 11, 11, 24)).astype(np.float32))  # as a ResNet block feeds it
    want = np.asarray(layer(x))
    q = int8.quantize_kernel(layer.kernel[...])
    layer.kernel.set_value(q)
    got = np.asarray(jax.jit(lambda x: layer(x))(x))
    _, step, _ = int8.quantize_activations(x)
    padded = np.pad(np.asarray(x), ((0, 0), (1, 1), (1, 1), (0, 0)))
    oh = got.shape[1]
    patches = np.stack([padded[0, stride * i : stride * i + 3, stride * j : stride * j + 3].reshape(-1)
                        for i in range(oh) for j in range(oh)])  # fmt: skip
    bound = error_bound(patches, np.asarray(q.dequantize()).reshape(-1, 16), q, float(step), False)
    err = np.abs(got - want).reshape(-1, 16)
    assert np.all(err <= bound * 1.001 + 1e-5)
    assert 0 < err.max() and err.max() < 0.02 * np.abs(want).max()


def test_an_upsampling_convolution_runs_as_four_phase_convolutions_within_their_quantization_steps(path):
    """Nearest 2x then a 3x3 convolution equals, in f32, four 2x2 convolutions over x (`int8.phase_kernels`); in int8
    each output phase stays within the bound its own phase kernel's quantization and x's give."""
    rng = np.random.default_rng(4)
    layer = layers.conv(24, 16, 3, nnx.Rngs(0))
    x = jax.nn.silu(rng.standard_normal((1, 5, 7, 24)).astype(np.float32))
    want = np.asarray(layer(jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)))
    kernel = np.asarray(layer.kernel[...])
    q = int8.quantize_upsampling_kernel(kernel)
    layer.kernel.set_value(q)
    got = np.asarray(jax.jit(layer.upsampled)(x))
    assert got.shape == (1, 10, 14, 16)
    _, step, _ = int8.quantize_activations(x)  # the upsampled x's too: the same values
    padded = np.pad(np.asarray(x), ((0, 0), (1, 1), (1, 1), (0, 0)))
    for index, (phase, phase_q) in enumerate(zip(int8.phase_kernels(kernel), q.phases, strict=True)):
        py, px = divmod(index, 2)
        patches = np.stack([padded[0, py + i : py + i + 2, px + j : px + j + 2].reshape(-1)
                            for i in range(5) for j in range(7)])  # fmt: skip
        np.testing.assert_allclose(  # the phase kernels' f32 convolution is the upsampled one
            (patches @ phase.reshape(-1, 16)).reshape(5, 7, 16), want[0, py::2, px::2], rtol=1e-5, atol=1e-5
        )
        bound = error_bound(patches, np.asarray(phase_q.dequantize()).reshape(-1, 16), phase_q, float(step), False)
        err = np.abs(got[0, py::2, px::2] - want[0, py::2, px::2]).reshape(-1, 16)
        assert np.all(err <= bound * 1.001 + 1e-5)
    assert 0 < np.abs(got - want).max() < 0.02 * np.abs(want).max()


def test_an_upsampling_to_an_odd_size_computes_with_the_whole_kernel(path):
    """A UNet's upsampling to an odd skip (9 -> 17) is no 2x: the kernel itself, quantized beside its phases."""
    upsample = layers.Upsample2D(16, nnx.Rngs(0))
    x = jax.nn.silu(np.random.default_rng(5).standard_normal((1, 9, 9, 16)).astype(np.float32))
    want = np.asarray(upsample(x, (17, 17)))
    upsample.conv.kernel.set_value(int8.quantize_upsampling_kernel(upsample.conv.kernel[...]))
    got = np.asarray(jax.jit(lambda x: upsample(x, (17, 17)))(x))
    assert got.shape == want.shape and 0 < np.abs(got - want).max() < 0.02 * np.abs(want).max()


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.conv_in = layers.conv(4, 64, 3, rngs)  # the first and last convolutions stay in float
        self.conv_shortcut = layers.conv(64, 64, 1, rngs)  # so do the ResNet blocks' 1x1 shortcuts
        self.mid = layers.conv(64, 64, 3, rngs)
        self.proj = layers.linear(64, 48, rngs)
        self.head = layers.linear(48, 4, rngs)  # 192 entries: too small to quantize
        self.conv_out = layers.conv(64, 4, 3, rngs)


def test_w8a8_quantizes_the_denoisers_linear_and_inner_convolution_kernels_only():
    _, params = nnx.split(Models(unet=Net(nnx.Rngs(0)), vae=Net(nnx.Rngs(1))))
    quantized = quantize_params(params, "unet", mode="w8a8")
    before, after = dict(nnx.to_flat_state(params)), dict(nnx.to_flat_state(quantized))
    changed = sorted(path for path in before if after[path].get_value() is not before[path].get_value())
    assert changed == [("unet", "mid", "kernel"), ("unet", "proj", "kernel")]
    assert all(isinstance(after[p].get_value(), int8.QuantizedKernel) for p in changed)
    assert computes_in_int8(quantized) and not computes_in_int8(params)


class Upsampling(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.mid = layers.conv(64, 64, 3, rngs)
        self.upsamplers = nnx.List([layers.Upsample2D(64, rngs)])  # diffusers' `upsamplers.0.conv`


def test_w8a8_quantizes_a_unets_upsampling_convolutions_with_their_phase_kernels():
    _, params = nnx.split(Models(unet=Upsampling(nnx.Rngs(0))))
    for quantized in (
        quantize_params(params, "unet", mode="w8a8"),
        nnx.from_flat_state(  # as the loader quantizes each kernel it reads
            [
                (
                    p,
                    v.replace(streaming(None, ("unet", None))(p, v.get_value())(v.get_value()))
                    if p[-1] == "kernel"
                    else v,
                )
                for p, v in nnx.to_flat_state(params)
            ]  # fmt: skip
        ),
    ):
        after = dict(nnx.to_flat_state(quantized))
        assert after["unet", "mid", "kernel"].get_value().phases is None
        phases = after["unet", "upsamplers", 0, "conv", "kernel"].get_value().phases
        assert [p.shape for p in phases] == [(2, 2, 64, 64)] * 4
        assert len(int8.kernel_values(quantized)) == 1 + 1 + 4  # pinned with the rest


def test_w8a8_is_refused_for_a_denoiser_whose_family_gives_no_rule():
    _, params = nnx.split(Models(transformer=Net(nnx.Rngs(0))))
    with pytest.raises(
        ConfigError, match="SD 1.x/2.x/XL, Z-Image and FLUX.2 .klein. in int8; this model.s transformer takes"
    ):
        quantize_params(params, "transformer", mode="w8a8")


def test_w8a8_is_refused_off_the_cpu(monkeypatch):
    _, params = nnx.split(Models(unet=Net(nnx.Rngs(0))))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(ConfigError, match="computes in int8 on a CPU; on gpu start without it"):
        quantize_params(params, "unet", mode="w8a8")


TINY = AutoencoderTinyConfig(decoder_block_out_channels=(32,) * 4, num_decoder_blocks=(1, 1, 1, 1))


def test_w8a8_quantizes_a_tiny_decoders_inner_convolutions_only():
    _, params = nnx.split(Models(unet=Net(nnx.Rngs(0)), vae=AutoencoderTiny(TINY, nnx.Rngs(1))))
    quantized = quantize_tiny_decoder(params)
    before, after = dict(nnx.to_flat_state(params)), dict(nnx.to_flat_state(quantized))
    changed = {path for path in before if after[path].get_value() is not before[path].get_value()}
    assert all(p[:3] == ("vae", "decoder", "layers") and p[-1] == "kernel" for p in changed)  # no encoder, no UNet
    assert {p[3] for p in changed} == {2, 4, 5, 7, 8, 10, 11}  # blocks, upsamplings' convolutions; not 0 and 12
    assert len(changed) == 4 * 3 + 3  # a block's three convolutions, each upsampling's one
    assert all(isinstance(after[p].get_value(), int8.QuantizedKernel) for p in changed)
    with_phases = {p[3] for p in changed if after[p].get_value().phases is not None}
    assert with_phases == {4, 7, 10}  # the convolutions after the upsamplings
    _, kl = nnx.split(Models(unet=Net(nnx.Rngs(0)), vae=Net(nnx.Rngs(1))))  # a decoder not laid out as TAESD's
    assert quantize_tiny_decoder(kl) is kl


# The tiny decoder's output in w8a8 against f32 (random weights, smooth latents, PSNR over the f32 output's range):
# measured 45.2 dB on a Zen 3 (AVX2, oneDNN's kernels; 46.7 before the upsamplings ran on phase kernels; TAESD's own
# widths: 41 dB); the bound sits 5 under.
DECODE_PSNR_BOUND = 40.0


def test_a_tiny_decoder_in_w8a8_decodes_near_its_f32_picture():
    graphdef, params = nnx.split(Models(vae=AutoencoderTiny(TINY, nnx.Rngs(1))))
    latents = np.random.default_rng(0).standard_normal((1, 4, 4, 4)).astype(np.float32)
    latents = np.repeat(np.repeat(latents, 2, axis=1), 2, axis=2)  # 8x8, smooth as a picture's latents are
    decode = jax.jit(lambda p, x: nnx.merge(graphdef, p).vae.decode(x))
    want = np.asarray(decode(params, latents), np.float64)
    got = np.asarray(decode(quantize_tiny_decoder(params), latents), np.float64)
    psnr = float(10 * np.log10(np.ptp(want) ** 2 / np.mean((got - want) ** 2)))
    print(f"tiny decoder w8a8 against f32: PSNR {psnr:.1f} dB")
    assert want.std() > 0.05  # a picture, not a flat field
    assert psnr > DECODE_PSNR_BOUND
    assert np.abs(got - want).max() > 0  # computed in int8


# The embedded model's pictures in w8a8 against its f32 ones, same prompt and latents: two DDIM steps (t 999 and 499,
# unguided) at 64x64, the UNet's one program per params called at each step, one text encoder and one decode for
# both. Measured 30.4 dB on a Zen 3 (AVX2, oneDNN's kernels; 30.9 before the upsamplings ran on phase kernels); the
# bound sits 3.4 dB under.
PSNR_BOUND = 27.0
STEPS = ((999, 499), (499, None))  # (t, the next step's t): DDIM, eta 0


@pytest.mark.slow  # about 25 s on two busy cores: the UNet's program compiled for each params, one decode
def test_w8a8_pictures_stay_near_the_f32_ones():
    quantized = load_pipeline(None, quantize="w8a8", safety_checker=False, previews=False, dtype="float32")
    try:  # load_pipeline's own choice and its one-line account of it; its programs are not compiled here
        by = "oneDNN's int8 kernels" if onednn.registered() else "XLA"
        assert quantized.compute_path.startswith(f"float32, the denoiser's products in int8 (w8a8) by {by}")
        model = quantized.model
        plain = load_model_folder(None, "float32")  # the same folder's params in float
        assert computes_in_int8(model.params) and not computes_in_int8(plain.params)
    finally:
        quantized.close()
    graphdef, cfg = plain.graphdef, plain.scheduler_config
    assert cfg.beta_schedule == "scaled_linear"
    betas = np.linspace(cfg.beta_start**0.5, cfg.beta_end**0.5, cfg.num_train_timesteps) ** 2
    alphas = np.cumprod(1 - betas)
    ids = jnp.asarray(tokenize_plain(plain.tokenizers, "a red house by a lake").ids)
    context = jax.jit(lambda p, ids: nnx.merge(graphdef, p).text_encoder(ids).last_hidden_state)(plain.params, ids)
    noise_of = jax.jit(lambda p, x, t, c: nnx.merge(graphdef, p).unet(x, t[None], c))
    decode = jax.jit(lambda p, z: jnp.clip(scaled_decode(nnx.merge(graphdef, p).vae, z) / 2 + 0.5, 0, 1))

    def picture(params) -> np.ndarray:
        x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 8, 8, 4)).astype(np.float32))
        for t, s in STEPS:
            eps = noise_of(params, x, jnp.float32(t), context)
            x0 = (x - np.sqrt(1 - alphas[t]) * eps) / np.sqrt(alphas[t])
            x = x0 if s is None else np.sqrt(alphas[s]) * x0 + np.sqrt(1 - alphas[s]) * eps
        return np.asarray(decode(plain.params, x), np.float64)  # the VAE in float in both

    want, got = picture(plain.params), picture(model.params)
    psnr = float(10 * np.log10(1.0 / np.mean((got - want) ** 2)))
    print(f"w8a8 against f32: PSNR {psnr:.1f} dB")
    assert want.std() > 0.02  # a picture, not a flat field
    assert psnr > PSNR_BOUND
    assert np.abs(got - want).max() > 0  # computed in int8: not the f32 arrays by accident


def test_pinned_int8_kernels_are_reordered_once_and_give_the_same_sums():
    _onednn_or_skip()
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((1, 12, 12, 64)).astype(np.float32))
    kernel = jax.tree.map(jnp.asarray, int8.quantize_kernel(rng.standard_normal((3, 3, 64, 32)).astype(np.float32)))
    run = jax.jit(lambda x, k: int8.conv(x, k, None, (1, 1), ((1, 1), (1, 1))))
    want = np.asarray(run(x, kernel))  # reordered at the call
    before = onednn.reordered_bytes()
    params = {"unet": {"kernel": kernel}}
    pinned = onednn.pin(params, int8_values=int8.kernel_values(params))
    try:
        assert len(pinned.buffers) == 1  # the int8 values; not their scales or sums
        np.testing.assert_array_equal(np.asarray(run(x, kernel)), want)
        assert onednn.reordered_bytes() - before >= kernel.values.nbytes  # kept in oneDNN's layout
        np.testing.assert_array_equal(np.asarray(run(x, kernel)), want)
    finally:
        pinned.release()
    assert onednn.reordered_bytes() == before


def test_w8a8_through_onednn_asks_for_no_core_pairs(monkeypatch):
    from engine.sampling import pairs

    environ = {}  # this process's own environment stays as it is
    monkeypatch.setattr(pairs.os, "environ", environ)
    monkeypatch.setattr(pairs, "backends_started", lambda: False)
    monkeypatch.setattr(pairs.cpus, "fit_threads", lambda: None)
    monkeypatch.setattr(pairs.cpus, "usable_cpus", lambda: 2)
    monkeypatch.setattr(pairs.onednn, "cpu_dtype", lambda: "float32")
    monkeypatch.setattr(pairs.onednn, "handlers", lambda: object())  # the kernels load
    assert pairs.pair_cores(int8=True) is False and not environ
    assert pairs.pair_cores() is True  # f32 in XLA: a pair
    environ.clear()
    monkeypatch.setattr(pairs.onednn, "handlers", lambda: None)  # no kernels: XLA's own int8 takes a pair
    assert pairs.pair_cores(int8=True) is True
