"""On a GPU: cuDNN's fused attention is really used, agrees with ours, and bf16 images stay close to f32.

The suite runs on the CPU (conftest.py); these tests run only when asked for on a GPU:

    JAX_PLATFORMS=cuda python -m pytest tests/test_gpu.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine import load_pipeline
from engine.nn.layers import attention, softmax_attention

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU: JAX_PLATFORMS=cuda")

# [batch, tokens_q, tokens_k, heads, head_dim] of SD1.5 at 512x512 and of SDXL at 1024x1024.
SHAPES = {
    "sd15 self-attention, 64x64": (2, 4096, 4096, 8, 40),
    "sd15 cross-attention": (2, 4096, 77, 8, 40),
    "sd15 self-attention, 8x8, head_dim 160": (2, 64, 64, 8, 160),
    "sdxl self-attention, 32x32": (2, 1024, 1024, 20, 64),
    "vae mid-block, one 512-wide head": (1, 4096, 4096, 1, 512),
}


def random_qkv(shape, dtype):
    b, n, m, h, d = shape
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (b, n, h * d), dtype)
    k, v = (jax.random.normal(key, (b, m, h * d), dtype) for key in keys[1:])
    return q, k, v


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_bf16_attention_agrees_with_f32_softmax(name):
    b, n, m, h, d = SHAPES[name]
    q, k, v = random_qkv(SHAPES[name], jnp.bfloat16)
    got = jax.jit(attention, static_argnums=3)(q, k, v, h).astype(jnp.float32)
    split = lambda x: x.astype(jnp.float32).reshape(b, x.shape[1], h, d)  # noqa: E731 [batch, tokens, heads, head_dim]
    want = softmax_attention(split(q), split(k), split(v)).reshape(b, n, h * d)
    assert float(jnp.abs(got - want).max()) < 0.05 * float(jnp.abs(want).max())


@pytest.mark.parametrize("name", ["sd15 self-attention, 64x64", "sdxl self-attention, 32x32"])
def test_unet_attention_runs_on_cudnn(name):
    q, k, v = random_qkv(SHAPES[name], jnp.bfloat16)
    hlo = jax.jit(attention, static_argnums=3).lower(q, k, v, SHAPES[name][3]).as_text()
    assert "cudnn" in hlo.lower(), "fell back to the einsum attention: cuDNN refused the shape or is missing"


def test_bf16_engine_draws_what_f32_draws():
    args = dict(prompt="a red circle on a blue background", seed=3, num_images=2, num_inference_steps=20)
    f32 = load_pipeline(dtype="float32").generate(**args).arrays
    bf16 = load_pipeline(dtype="bfloat16").generate(**args).arrays
    assert np.abs(f32 - bf16).mean() < 0.02
    assert np.abs(f32 - bf16).max() < 0.25
