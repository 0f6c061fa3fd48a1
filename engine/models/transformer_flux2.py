"""FLUX.2's denoiser ([klein] 4B and 9B, and [dev]), mirroring diffusers' `Flux2Transformer2DModel`.

FLUX.1's MMDiT (`transformer_flux.py`) with these changes: no biases anywhere; the adaLN modulation is computed
once per step and shared by every block of a stream (`double_stream_modulation_img` / `_txt` with 6 vectors,
`single_stream_modulation` with 3), so the blocks have no norm parameters of their own; the conditioning is the
timestep (and, for [dev], the guidance scale) alone, with no pooled text; the MLPs are SwiGLU (gate and value
from one fused `linear_in`, `mlp_ratio` 3); a single-stream block projects q, k, v and the MLP's input in one
matrix (`to_qkv_mlp_proj`) and its attention and MLP out in one (`to_out`); RoPE has 4 axes (time, row, column,
text position) with theta 2000.

Tokens: the VAE's 32-channel latents, patchified 2x2 and normalised (`vae_flux2.py`), are a grid [h/16, w/16, 128]
whose cells are the tokens. Flux2KleinPipeline joins text, latent and reference tokens as
[text, latent, reference 1, reference 2, ...] with ids (0, 0, 0, l) for text token l, (0, row, col, 0) for the
latent and (10 + 10 i, row, col, 0) for reference i; the prediction is read back from the latent's tokens.

Our interface, NHWC inside the engine: `__call__` takes the latent grid [batch, rows, cols, in_channels] (the
pipeline's latents before `_pack_latents`) and the references' grids, and returns the velocity on the latent's
grid. The text goes through `context_embedder` once per request (`project_context`), not at every step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..nn.dit import AdaLayerNorm, RMSNorm, modulate
from ..nn.int8_weights import widened
from ..nn.layers import TimestepEmbedding, linear, timestep_embedding
from .config import _FromJson, _require
from .transformer_flux import TIME_FACTOR, FluxAttention, Rope, double_stream, rope_attention, rope_tables

REFERENCE_TIME_STEP = 10  # `_prepare_image_ids(scale=10)`: reference i sits at time 10 + 10 i


@dataclasses.dataclass(frozen=True)
class Flux2TransformerConfig(_FromJson):
    """`Flux2Transformer2DModel` config (transformer/config.json); the defaults are diffusers' (FLUX.2 [dev])."""

    patch_size: int = 1  # the pipeline patchifies 2x2 itself; the transformer's own patch is 1
    in_channels: int = 128  # 4 x the VAE's 32 latent channels (2x2 patches)
    out_channels: int | None = None  # None: in_channels
    num_layers: int = 8  # double-stream blocks (`transformer_blocks`)
    num_single_layers: int = 48  # single-stream blocks (`single_transformer_blocks`)
    attention_head_dim: int = 128  # the width of one head
    num_attention_heads: int = 48
    joint_attention_dim: int = 15360  # the text encoder's hidden states, 3 layers stacked (Klein: 3 x Qwen3's)
    timestep_guidance_channels: int = 256  # the sinusoid's width
    mlp_ratio: float = 3.0
    axes_dims_rope: tuple[int, ...] = (32, 32, 32, 32)  # rotary dims per position axis: time, row, column, text
    rope_theta: int = 2000
    eps: float = 1e-6  # every LayerNorm and q/k RMSNorm
    guidance_embeds: bool = True  # [dev]: the guidance scale is embedded beside the timestep; Klein: false

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_hidden_dim(self) -> int:
        return int(self.inner_dim * self.mlp_ratio)

    @property
    def packed_out_channels(self) -> int:
        return self.out_channels or self.in_channels

    def validate(self, where: str) -> None:
        _require(self.patch_size == 1, where, f"patch_size {self.patch_size} is not supported (only 1)")
        _require(self.in_channels % 4 == 0, where, f"in_channels {self.in_channels} is not 4 x latent channels")
        _require(len(self.axes_dims_rope) == 4, where, f"axes_dims_rope {self.axes_dims_rope} must name 4 axes")
        _require(all(d % 2 == 0 for d in self.axes_dims_rope), where, "every axes_dims_rope entry must be even")
        _require(
            sum(self.axes_dims_rope) == self.attention_head_dim,
            where,
            f"axes_dims_rope {self.axes_dims_rope} must sum to attention_head_dim {self.attention_head_dim}",
        )


def position_ids(text_tokens: int, rows: int, cols: int, references: Sequence[tuple[int, int]] = ()) -> np.ndarray:
    """[text + rows * cols + the references' tokens, 4]: the ids Flux2KleinPipeline builds, in its order.

    `_prepare_text_ids` (0, 0, 0, l), `_prepare_latent_ids` (0, row, col, 0), then `_prepare_image_ids` for each
    reference grid (rows_i, cols_i): (10 + 10 i, row, col, 0).
    """

    def grid(t: int, r: int, c: int) -> np.ndarray:
        ids = np.zeros((r, c, 4))
        ids[..., 0] = t
        ids[..., 1] = np.arange(r)[:, None]
        ids[..., 2] = np.arange(c)[None, :]
        return ids.reshape(r * c, 4)

    text = np.zeros((text_tokens, 4))
    text[:, 3] = np.arange(text_tokens)
    refs = [grid(REFERENCE_TIME_STEP * (i + 1), r, c) for i, (r, c) in enumerate(references)]
    return np.concatenate([text, grid(0, rows, cols), *refs])


def swiglu(h: jax.Array) -> jax.Array:
    """`Flux2SwiGLU`: silu(first half) * second half; the silu in f32 and rounded, as torch's kernels do."""
    gate, value = jnp.split(h, 2, axis=-1)
    return jax.nn.silu(gate.astype(jnp.float32)).astype(h.dtype) * value


class Flux2FeedForward(nnx.Module):
    """`Flux2FeedForward`: `linear_in` gives gate and value at once, `linear_out` maps the product back."""

    def __init__(self, dim: int, hidden: int, rngs: nnx.Rngs):
        self.linear_in = linear(dim, 2 * hidden, rngs, bias=False)
        self.linear_out = linear(hidden, dim, rngs, bias=False)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear_out(swiglu(self.linear_in(x)))


class Flux2TimestepGuidanceEmbeddings(nnx.Module):
    """The timestep's sinusoid (and the guidance scale's, for [dev]) embedded by bias-free MLPs and summed.

    The sinusoid is taken in f32 and cast to the activations' dtype, as diffusers casts it to the timestep's.
    """

    def __init__(self, channels: int, dim: int, guidance: bool, rngs: nnx.Rngs):
        self.channels = channels
        self.timestep_embedder = TimestepEmbedding(channels, dim, rngs, bias=False)
        self.guidance_embedder = TimestepEmbedding(channels, dim, rngs, bias=False) if guidance else None

    def __call__(self, timestep: jax.Array, guidance: jax.Array | None, dtype) -> jax.Array:
        """timestep, guidance [batch], already x1000 -> [batch, dim] in `dtype`."""

        def embedded(embedder: TimestepEmbedding, value: jax.Array) -> jax.Array:
            sinusoid = timestep_embedding(value, self.channels, flip_sin_to_cos=True, freq_shift=0)
            return embedder(sinusoid.astype(dtype))

        temb = embedded(self.timestep_embedder, timestep)
        if guidance is not None:
            temb = temb + embedded(self.guidance_embedder, guidance)
        return temb


class Flux2TransformerBlock(nnx.Module):
    """Double stream (FLUX.1's arithmetic, `transformer_flux.double_stream`) under the shared modulation."""

    def __init__(self, dim: int, heads: int, head_dim: int, mlp_hidden: int, eps: float, rngs: nnx.Rngs):
        self.eps = eps
        self.attn = FluxAttention(dim, heads, head_dim, True, rngs, bias=False, eps=eps)
        self.ff = Flux2FeedForward(dim, mlp_hidden, rngs)
        self.ff_context = Flux2FeedForward(dim, mlp_hidden, rngs)

    def __call__(self, x, context, image_mod, text_mod, rope: Rope) -> tuple[jax.Array, jax.Array]:
        return double_stream(self, x, context, image_mod, text_mod, rope, self.eps)


class Flux2ParallelSelfAttention(nnx.Module):
    """`Flux2ParallelSelfAttention`: q, k, v and the SwiGLU's input from one matrix, attention and MLP out by one."""

    def __init__(self, dim: int, heads: int, head_dim: int, mlp_hidden: int, eps: float, rngs: nnx.Rngs):
        self.heads, self.head_dim, self.mlp_hidden = heads, head_dim, mlp_hidden
        inner = heads * head_dim
        self.to_qkv_mlp_proj = linear(dim, 3 * inner + 2 * mlp_hidden, rngs, bias=False)
        self.norm_q = RMSNorm(head_dim, eps, rngs)
        self.norm_k = RMSNorm(head_dim, eps, rngs)
        self.to_out = linear(inner + mlp_hidden, dim, rngs, bias=False)

    def __call__(self, x: jax.Array, rope: Rope) -> jax.Array:
        h = self.to_qkv_mlp_proj(x)
        inner = self.heads * self.head_dim
        q, k, v = (
            h[..., i * inner : (i + 1) * inner].reshape(*h.shape[:2], self.heads, self.head_dim) for i in range(3)
        )
        attn = rope_attention(self.norm_q(q), self.norm_k(k), v, rope, x.dtype)  # [batch, tokens, inner]
        mlp = swiglu(h[..., 3 * inner :])  # [batch, tokens, mlp_hidden]
        return self.to_out(jnp.concatenate([attn, mlp], axis=-1))


class Flux2SingleTransformerBlock(nnx.Module):
    """Single stream over [text, latent, references]: x + gate * attn(modulate(x)) with the parallel MLP inside."""

    def __init__(self, dim: int, heads: int, head_dim: int, mlp_hidden: int, eps: float, rngs: nnx.Rngs):
        self.eps = eps
        self.attn = Flux2ParallelSelfAttention(dim, heads, head_dim, mlp_hidden, eps, rngs)

    def __call__(self, x: jax.Array, mod: list[jax.Array], rope: Rope) -> jax.Array:
        shift, scale, gate = mod
        return x + gate[:, None] * self.attn(modulate(x, shift, scale, self.eps), rope)


class Flux2Transformer2DModel(nnx.Module):
    """Embedders and shared modulations in, double- then single-stream blocks, `norm_out` and `proj_out` out."""

    # `--quantize int8`: the programs leave these lists' kernels int8 and each block's are widened only once its input
    # exists (`nn.int8_weights.widened`), so about one block is wide at a time, not the whole network; a float block
    # runs as it is
    WIDENED_BLOCKS = ("transformer_blocks", "single_transformer_blocks")

    def __init__(self, config: Flux2TransformerConfig, rngs: nnx.Rngs):
        cfg = self.config = config
        dim, heads, head_dim, mlp, eps = (
            cfg.inner_dim,
            cfg.num_attention_heads,
            cfg.attention_head_dim,
            cfg.mlp_hidden_dim,
            cfg.eps,
        )
        self.time_guidance_embed = Flux2TimestepGuidanceEmbeddings(
            cfg.timestep_guidance_channels, dim, cfg.guidance_embeds, rngs
        )
        self.double_stream_modulation_img = AdaLayerNorm(dim, 6, rngs, bias=False)  # Flux2Modulation, 2 sets
        self.double_stream_modulation_txt = AdaLayerNorm(dim, 6, rngs, bias=False)
        self.single_stream_modulation = AdaLayerNorm(dim, 3, rngs, bias=False)
        self.x_embedder = linear(cfg.in_channels, dim, rngs, bias=False)
        self.context_embedder = linear(cfg.joint_attention_dim, dim, rngs, bias=False)
        self.transformer_blocks = nnx.List(
            [Flux2TransformerBlock(dim, heads, head_dim, mlp, eps, rngs) for _ in range(cfg.num_layers)]
        )
        self.single_transformer_blocks = nnx.List(
            [Flux2SingleTransformerBlock(dim, heads, head_dim, mlp, eps, rngs) for _ in range(cfg.num_single_layers)]
        )
        self.norm_out = AdaLayerNorm(dim, 2, rngs, bias=False)  # AdaLayerNormContinuous: scale, then shift
        self.proj_out = linear(dim, cfg.patch_size**2 * cfg.packed_out_channels, rngs, bias=False)

    @property
    def dtype(self):
        return self.x_embedder.kernel.dtype

    def project_context(self, encoder_hidden_states: jax.Array) -> jax.Array:
        """The text encoder's [batch, tokens, joint_attention_dim] -> [batch, tokens, inner]: what `__call__` takes.

        `context_embedder` of diffusers' forward, run once per request by a server.
        """
        return self.context_embedder(encoder_hidden_states.astype(self.dtype))

    def __call__(
        self,
        x: jax.Array,
        timestep: jax.Array,
        context: jax.Array,
        references: Sequence[jax.Array] = (),
        guidance: jax.Array | None = None,
    ) -> jax.Array:
        """The velocity [batch, rows, cols, out_channels] for the latent grid x [batch, rows, cols, in_channels].

        x: the latents as Flux2KleinPipeline denoises them (patchified 2x2 and normalised: `vae_flux2.py`), NHWC.
        timestep [batch] (or scalar): t / 1000, as the pipeline passes it; multiplied by 1000 inside as diffusers
        does. context [batch, tokens, inner]: `project_context`'s output. references: the reference pictures'
        latent grids, each [batch or 1, rows_i, cols_i, in_channels] in the same space, joined after the latent's
        tokens in this order. guidance [batch]: the guidance scale, only where `config.guidance_embeds` ([dev]);
        Klein's pipeline passes none.
        """
        cfg = self.config
        b, rows, cols, c = x.shape
        for grid in (x, *references):
            if grid.ndim != 4 or grid.shape[-1] != cfg.in_channels:
                raise ValueError(f"a latent grid of shape {grid.shape} is not [batch, rows, cols, {cfg.in_channels}]")
        if guidance is not None and not cfg.guidance_embeds:
            raise ValueError("this transformer has no guidance embedding (guidance_embeds is false): pass None")
        dtype = self.dtype
        # diffusers casts t / 1000 to the activations' dtype before x1000; in f32 here, so bf16 does not round t.
        timestep = jnp.broadcast_to(timestep, (b,)).astype(jnp.float32) * TIME_FACTOR
        if guidance is not None:
            guidance = jnp.broadcast_to(guidance, (b,)).astype(jnp.float32) * TIME_FACTOR
        temb = self.time_guidance_embed(timestep, guidance, dtype)  # [batch, inner]
        image_mod = self.double_stream_modulation_img(temb)
        text_mod = self.double_stream_modulation_txt(temb)
        single_mod = self.single_stream_modulation(temb)

        text = context.shape[1]
        ids = position_ids(text, rows, cols, [r.shape[1:3] for r in references])
        rope = tuple(jnp.asarray(t) for t in rope_tables(cfg.axes_dims_rope, ids, cfg.rope_theta))
        grids = [x, *(jnp.broadcast_to(r, (b, *r.shape[1:])) for r in references)]
        tokens = jnp.concatenate([g.astype(dtype).reshape(b, -1, c) for g in grids], axis=1)  # `_pack_latents`
        image = self.x_embedder(tokens)  # [batch, latent + reference tokens, inner]
        context = context.astype(dtype)
        for block in self.transformer_blocks:
            image, context = widened(block, image)(image, context, image_mod, text_mod, rope)
        joined = jnp.concatenate([context, image], axis=1)  # [batch, text + image tokens, inner]
        for block in self.single_transformer_blocks:
            joined = widened(block, joined)(joined, single_mod, rope)
        scale, shift = self.norm_out(temb)
        latent = joined[:, text : text + rows * cols]  # the pipeline keeps the latent's tokens only
        out = self.proj_out(modulate(latent, shift, scale, cfg.eps))  # [batch, rows * cols, out_channels]
        return out.reshape(b, rows, cols, -1)
