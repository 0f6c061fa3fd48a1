"""Pieces of the diffusion transformers (MMDiT: SD 3 / 3.5, FLUX), named after diffusers' modules.

adaLN modulation (`AdaLayerNormZero`, `AdaLayerNormZeroSingle`, `SD35AdaLayerNormZeroX`, `AdaLayerNormContinuous`:
`AdaLayerNorm` with 6, 3, 9 or 2 chunks), the per-head q/k `RMSNorm`, the tanh-GELU `FeedForward` and the
timestep + pooled-text conditioning (`CombinedTimestepTextProjEmbeddings`). Norm statistics are f32 and the
modulation runs in the activations' dtype, as diffusers runs them in bf16.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .layers import Identity, TimestepEmbedding, _inits, linear, timestep_embedding

TIME_CHANNELS = 256  # `Timesteps(num_channels=256, flip_sin_to_cos=True, downscale_freq_shift=0)` of every MMDiT
NORM_EPS = 1e-6  # the LayerNorms and RMSNorms of SD 3 and FLUX
MLP_RATIO = 4


def computed_param(shape: tuple[int, ...], compute: Callable[[], np.ndarray]) -> nnx.Param:
    """A tensor the checkpoint holds but the model can compute (a persistent buffer of diffusers, such as SD 3's
    position table): `compute()` gives its value at init; under `shapes_only` it is only its shape (never computed)."""
    shaped = _inits("init").get("init")
    return nnx.Param(shaped(None, shape) if shaped else jnp.asarray(compute(), jnp.float32).reshape(shape))


def plain_layer_norm(x: jax.Array, eps: float = NORM_EPS) -> jax.Array:
    """`nn.LayerNorm(elementwise_affine=False)`: no parameters, statistics in f32, the input's dtype out."""
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype)


def modulate(x: jax.Array, shift: jax.Array, scale: jax.Array, eps: float = NORM_EPS) -> jax.Array:
    """adaLN: `norm(x) * (1 + scale) + shift`; x [batch, tokens, dim], shift and scale [batch, dim] per image."""
    return plain_layer_norm(x, eps) * (1 + scale[:, None]) + shift[:, None]


class RMSNorm(nnx.Module):
    """diffusers' `RMSNorm` over the last axis (the per-head q/k norm): statistics in f32, then the weight."""

    def __init__(self, dim: int, eps: float, rngs: nnx.Rngs):
        self.eps = eps
        init = _inits("scale_init").get("scale_init", nnx.initializers.ones)
        self.scale = nnx.Param(init(rngs.params(), (dim,), jnp.float32))  # the checkpoint's `weight`

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        normed = (xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + self.eps)).astype(x.dtype)
        return normed * self.scale[...].astype(x.dtype)


class AdaLayerNorm(nnx.Module):
    """The modulation of `AdaLayerNormZero` (6 chunks), `...ZeroSingle` (3), `SD35AdaLayerNormZeroX` (9) and
    `AdaLayerNormContinuous` (2): `linear(silu(temb))` split into per-image vectors, in diffusers' order for each
    (shift, scale, gate, ... for the Zero kinds; scale, shift for Continuous). FLUX.2's `Flux2Modulation` is the
    same map without a bias, shared by all blocks of a stream (6 chunks for the double ones, 3 for the single)."""

    def __init__(self, dim: int, chunks: int, rngs: nnx.Rngs, bias: bool = True):
        self.chunks = chunks
        self.linear = linear(dim, chunks * dim, rngs, bias=bias)

    def __call__(self, temb: jax.Array) -> list[jax.Array]:  # [batch, dim] -> chunks x [batch, dim]
        return jnp.split(self.linear(jax.nn.silu(temb)), self.chunks, axis=-1)


class GELUProj(nnx.Module):
    """diffusers' `GELU(approximate="tanh")`: a linear map, then the tanh GELU (in f32, as torch's kernels do; inside
    oneDNN's product on its f32 sums on the bf16 CPU path)."""

    def __init__(self, dim: int, inner: int, rngs: nnx.Rngs):
        self.proj = linear(dim, inner, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.proj(x, activation="gelu_tanh")


class FeedForward(nnx.Module):
    """diffusers' `FeedForward(activation_fn="gelu-approximate")`; net[1] is its Dropout."""

    def __init__(self, dim: int, rngs: nnx.Rngs, mult: int = MLP_RATIO):
        self.net = nnx.List([GELUProj(dim, dim * mult, rngs), Identity(), linear(dim * mult, dim, rngs)])

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.net[2](self.net[0](x))


class CombinedTimestepTextProjEmbeddings(nnx.Module):
    """`CombinedTimestepTextProjEmbeddings`, or with `guidance` `CombinedTimestepGuidanceTextProjEmbeddings`.

    The sinusoid of the timestep (and guidance) is taken in f32, then cast to the pooled text's dtype as diffusers
    does. The text embedder (`PixArtAlphaTextProjection`, act "silu") is `linear_2(silu(linear_1(x)))`, the shape of
    a `TimestepEmbedding`. Any scaling of the timestep (FLUX's x1000) is the caller's.
    """

    def __init__(self, dim: int, pooled_dim: int, rngs: nnx.Rngs, guidance: bool = False):
        self.timestep_embedder = TimestepEmbedding(TIME_CHANNELS, dim, rngs)
        self.guidance_embedder = TimestepEmbedding(TIME_CHANNELS, dim, rngs) if guidance else None
        self.text_embedder = TimestepEmbedding(pooled_dim, dim, rngs)

    def __call__(self, timestep: jax.Array, pooled: jax.Array, guidance: jax.Array | None = None) -> jax.Array:
        """timestep [batch], pooled [batch, pooled_dim] -> [batch, dim] in pooled's dtype."""

        def sinusoid(value: jax.Array) -> jax.Array:
            return timestep_embedding(value, TIME_CHANNELS, flip_sin_to_cos=True, freq_shift=0).astype(pooled.dtype)

        temb = self.timestep_embedder(sinusoid(timestep))
        if self.guidance_embedder is not None:
            temb = temb + self.guidance_embedder(sinusoid(guidance))
        return temb + self.text_embedder(pooled)
