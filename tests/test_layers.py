"""Every attention path and the GroupNorm agree with the plain formulation they replace.

The TPU flash kernel runs here on the CPU in Pallas's TPU interpret mode
(`pltpu.force_tpu_interpret_mode`): the same kernel, block sizes, padding and segment ids that a TPU
would run, interpreted op by op. What that does not cover: Mosaic's compilation for a real TPU, and speed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import tpu as pltpu

from engine.nn import attention as attn
from engine.nn import layers
from engine.nn.layers import Conv, GroupNorm, gathered_conv


def qkv(b: int, n: int, m: int, h: int, d: int, dtype=jnp.float32, seed: int = 0):
    r = np.random.RandomState(seed)
    q = r.randn(b, n, h, d)
    k, v = r.randn(b, m, h, d), r.randn(b, m, h, d)
    return tuple(jnp.asarray(a.astype(np.float32), dtype) for a in (q, k, v))


@pytest.mark.parametrize(
    "shape, block",
    [
        ((2, 1024, 1024, 8, 8), 32),  # SD 1.5 at a quarter width, 256x256: the first level's self-attention
        ((2, 1024, 77, 8, 8), 128),  # its cross-attention to the text
        ((1, 256, 256, 1, 64), 64),  # SD 2.x: one 64-wide head
        ((2, 64, 64, 8, 40), 16),
        ((1, 96, 50, 3, 24), 96),  # one block: the whole
        ((1, 4429 // 43, 77, 2, 16), 9),  # 103 queries, a prime: padded to whole blocks
    ],
)
def test_blockwise_attention_is_the_plain_one(shape, block):
    q, k, v = qkv(*shape)
    want = attn.softmax_attention(q, k, v)
    got = jax.jit(attn.blockwise_attention, static_argnums=3)(q, k, v, block)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("shape", [(2, 64, 64, 8, 8), (2, 128, 77, 8, 40), (1, 32, 48, 2, 160)])
def test_keys_major_attention_is_the_plain_one(shape):
    q, k, v = qkv(*shape)
    got = jax.jit(attn.keys_major_attention)(q, k, v)
    np.testing.assert_allclose(got, attn.softmax_attention(q, k, v), atol=2e-6, rtol=1e-5)


def masked_reference(q, k, v, key_mask):
    """Each image alone over its attended keys: what a mask must give."""
    return jnp.concatenate(
        [
            attn.softmax_attention(q[i : i + 1], k[i : i + 1][:, key_mask[i]], v[i : i + 1][:, key_mask[i]])
            for i in range(len(q))
        ]
    )


@pytest.mark.parametrize(("dtype", "tol"), [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(2, 64, 96, 2, 16), (2, 1024, 1088, 4, 32)])  # plain; query blocks on the CPU
def test_a_key_mask_weighs_the_masked_keys_nothing(shape, dtype, tol):
    """Unequal texts in one batch (Z-Image's captions): the first image attends to 40 keys fewer."""
    q, k, v = qkv(*shape, dtype=dtype)
    key_mask = jnp.arange(shape[2])[None, :] < jnp.array([shape[2] - 40, shape[2]])[:, None]
    want = masked_reference(*(a.astype(jnp.float32) for a in (q, k, v)), np.asarray(key_mask))
    got = jax.jit(attn.dot_product_attention)(q, k, v, key_mask)
    assert got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("b, n, m, h", [(2, 1024, 1024, 8), (2, 1024, 77, 8), (1, 4096, 4096, 1), (2, 96, 96, 8)])
def test_query_block_divides_the_queries_and_bounds_the_logits(b, n, m, h):
    block = attn.query_block((b, n, h, 64), m)
    assert n % block == 0
    assert 4 * b * h * block * m <= max(attn.CPU_BLOCK_BYTES, 4 * b * h * m)  # one query row at the least


@pytest.mark.parametrize("n", [4429, 4608])  # SD3 (4096 + 333) and FLUX.1 (4096 + 512) at 1024x1024
def test_a_token_count_without_a_near_divisor_gets_whole_padded_blocks_not_single_rows(n):
    block = attn.query_block((1, n, 24, 64), n)
    want = attn.CPU_BLOCK_BYTES // (4 * 24 * n)
    assert want // 2 <= block <= want


@pytest.mark.parametrize(
    "backend, q, k, dtype, kind",
    [
        ("gpu", (2, 4096, 8, 40), (2, 4096, 8, 40), jnp.bfloat16, "cudnn"),
        ("gpu", (2, 4096, 8, 40), (2, 77, 8, 40), jnp.float16, "cudnn"),
        ("gpu", (2, 4096, 8, 40), (2, 4096, 8, 40), jnp.float32, "plain"),  # cuDNN's kernel is half precision
        ("gpu", (2, 64, 1, 3), (2, 64, 1, 3), jnp.bfloat16, "plain"),  # a head size cuDNN does not take
        ("tpu", (2, 4096, 8, 40), (2, 4096, 8, 40), jnp.bfloat16, "flash"),  # SD 1.5 at 512x512, first level
        ("tpu", (2, 16384, 10, 64), (2, 16384, 10, 64), jnp.bfloat16, "flash"),
        ("tpu", (2, 4096, 8, 40), (2, 77, 8, 40), jnp.bfloat16, "plain"),  # cross-attention: 77 keys
        ("tpu", (2, 1024, 8, 80), (2, 1024, 8, 80), jnp.bfloat16, "plain"),  # short
        ("cpu", (2, 1024, 8, 8), (2, 1024, 8, 8), jnp.float32, "blocks"),  # 64 MB of logits
        ("cpu", (2, 64, 8, 160), (2, 64, 8, 160), jnp.float32, "plain"),  # 256 KB
        ("cpu", (2, 256, 8, 80), (2, 77, 8, 80), jnp.float32, "plain"),
    ],
)
def test_attention_kind_by_backend_and_shape(monkeypatch, backend, q, k, dtype, kind):
    monkeypatch.setattr(attn.onednn, "loaded", lambda: False)  # XLA's own choices: the oneDNN kernels not loaded
    assert attn.attention_kind(backend, jax.ShapeDtypeStruct(q, dtype), jax.ShapeDtypeStruct(k, dtype)) == kind


@pytest.mark.parametrize("loaded", [True, False])
def test_long_f32_self_attention_on_the_cpu_goes_to_onednn_only_where_its_kernels_are_loaded(monkeypatch, loaded):
    monkeypatch.setattr(attn.onednn, "loaded", lambda: loaded)
    long = jax.ShapeDtypeStruct((2, attn.CPU_ONEDNN_F32_KEYS, 8, 8), jnp.float32)
    text = jax.ShapeDtypeStruct((2, 77, 8, 8), jnp.float32)
    assert attn.attention_kind("cpu", long, long) == ("onednn" if loaded else "blocks")
    assert attn.attention_kind("cpu", long, text) != "onednn"  # 77 keys: XLA's own is faster
    assert attn.attention_kind("gpu", long, long) == "plain"


def test_dot_product_attention_on_the_cpu_takes_blocks_and_agrees(monkeypatch):
    monkeypatch.setattr(attn.onednn, "loaded", lambda: False)  # XLA's query blocks, not the oneDNN kernel
    q, k, v = qkv(2, 1024, 1024, 8, 8)
    assert attn.attention_kind("cpu", q, k) == "blocks"
    np.testing.assert_allclose(
        jax.jit(attn.dot_product_attention)(q, k, v), attn.softmax_attention(q, k, v), atol=2e-6, rtol=1e-5
    )


@pytest.mark.parametrize(
    "shape",
    [
        (1, 256, 256, 2, 40),  # whole 128-token blocks, SD 1.5's 40-wide heads
        (2, 200, 200, 1, 64),  # queries and keys padded to 256; padded keys masked by segment ids
        (1, 128, 77, 1, 160),  # cross-attention shape; a head wider than 128 zero-padded to 256
    ],
)
def test_tpu_flash_kernel_interpreted_agrees_with_plain(shape):
    q, k, v = qkv(*shape)
    with pltpu.force_tpu_interpret_mode():
        got = attn.flash_attention(q, k, v)
    np.testing.assert_allclose(got, attn.softmax_attention(q, k, v), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "shape, groups, eps",
    [
        ((2, 32, 32, 64), 32, 1e-5),  # UNet resnets
        ((2, 8, 8, 1280), 32, 1e-5),
        ((1, 16, 16, 128), 32, 1e-6),  # VAE
        ((3, 5, 7, 12), 4, 1e-6),  # odd sizes, 3 channels a group
        ((2, 64, 96), 32, 1e-6),  # [batch, tokens, channels]
    ],
)
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
def test_group_norm_is_flaxs(shape, groups, eps, dtype, tol):
    r = np.random.RandomState(1)
    c = shape[-1]
    x = jnp.asarray((r.randn(*shape) * 3 + 2).astype(np.float32), dtype)  # an offset mean, as activations have
    ours = GroupNorm(c, num_groups=groups, epsilon=eps, rngs=nnx.Rngs(0), param_dtype=dtype)
    flax = nnx.GroupNorm(c, num_groups=groups, epsilon=eps, rngs=nnx.Rngs(0), param_dtype=dtype)
    scale, bias = jnp.asarray(r.randn(c), dtype), jnp.asarray(r.randn(c), dtype)
    for m in (ours, flax):
        m.scale[...], m.bias[...] = scale, bias
    got, want = ours(x), flax(x)
    assert got.dtype == dtype and got.shape == x.shape
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "shape, out, kernel, padding",
    [
        ((2, 4, 4, 64), 32, 3, 1),  # the UNet's lowest level: gathered taps, one matrix product
        ((2, 8, 8, 16), 24, 3, 1),  # 128 pixels: gathered
        ((1, 3, 5, 8), 8, 3, ((0, 1), (0, 1))),  # uneven padding
        ((2, 16, 16, 8), 8, 3, 1),  # 512 pixels: XLA's convolution
        ((2, 4, 4, 8), 16, 1, 0),  # 1x1: XLA's convolution
    ],
)
def test_conv_is_flaxs(shape, out, kernel, padding):
    r = np.random.RandomState(2)
    x = jnp.asarray(r.randn(*shape).astype(np.float32))
    pad = ((padding, padding), (padding, padding)) if isinstance(padding, int) else padding
    ours = Conv(shape[-1], out, (kernel, kernel), padding=pad, rngs=nnx.Rngs(0))
    flax = nnx.Conv(shape[-1], out, (kernel, kernel), padding=pad, rngs=nnx.Rngs(0))
    flax.bias[...] = ours.bias[...] = jnp.asarray(r.randn(out).astype(np.float32))
    np.testing.assert_allclose(jax.jit(lambda x: ours(x))(x), flax(x), atol=2e-5, rtol=1e-5)


def test_a_weight_heavy_convolution_is_gathered_and_still_flaxs(monkeypatch):
    # Every kernel counts as heavy: 512 output pixels, which only the kernel-per-pixel rule gathers.
    monkeypatch.setattr(layers, "GATHERED_CONV_MIN_KERNEL_BYTES_PER_PIXEL", 0)
    test_conv_is_flaxs((2, 16, 16, 8), 8, 3, 1)


@pytest.mark.parametrize(
    "pixels, channels, gathered",
    [
        (2 * 8 * 8, (1280, 1280), True),  # SD 1.5's lowest levels at 256x256: few pixels
        (2 * 16 * 16, (1280, 1280), True),  # 59 MB of kernel for 512 pixels
        (2 * 16 * 16, (1920, 640), True),
        (2 * 16 * 16, (1280, 640), False),  # 58 KB a pixel: XLA's convolution is as fast
        (2 * 32 * 32, (1280, 1280), False),
        (2 * 32 * 32, (320, 320), False),
    ],
)
def test_the_cpu_gathers_where_the_kernel_outweighs_the_pixels(pixels, channels, gathered):
    kernel_bytes = 3 * 3 * channels[0] * channels[1] * 4
    assert gathered_conv("cpu", pixels, kernel_bytes) is gathered
    assert gathered_conv("gpu", pixels, kernel_bytes) is False
