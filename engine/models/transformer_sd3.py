"""The denoiser of Stable Diffusion 3 and 3.5, mirroring diffusers' `SD3Transformer2DModel` (MMDiT).

Latent patches (a conv with kernel = stride = `patch_size`, plus a centred crop of a fixed 2-D sin-cos position
table) and the text's tokens keep weights of their own and meet in one joint attention per block over the sequence
[image, text] (image first, as diffusers concatenates them). Every block is modulated by adaLN-Zero from one vector,
the timestep's sinusoid embedded plus the pooled CLIP text projected (SD3 paper, Fig. 2). The last block is
`context_pre_only`: the text is attended to but no longer updated. SD 3.5 adds an RMS norm of each head's queries
and keys (`qk_norm`) and, in `dual_attention_layers`, a second attention over the image tokens alone (`attn2`,
modulated by 3 more chunks: `SD35AdaLayerNormZeroX`).

Our interface, NHWC inside the engine: `__call__` takes latents [batch, h, w, in_channels] and returns the
prediction [batch, h, w, out_channels]; the text goes through `context_embedder` once per request
(`project_context`), not at every step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..nn.dit import (
    NORM_EPS,
    AdaLayerNorm,
    CombinedTimestepTextProjEmbeddings,
    FeedForward,
    RMSNorm,
    computed_param,
    modulate,
)
from ..nn.int8_weights import widened
from ..nn.layers import conv, dot_product_attention, linear
from .config import _FromJson, _require

POS_EMBED_THETA = 10000.0  # get_1d_sincos_pos_embed_from_grid's base


@dataclasses.dataclass(frozen=True)
class SD3TransformerConfig(_FromJson):
    """`SD3Transformer2DModel` config (transformer/config.json); diffusers' defaults are SD 3 medium's."""

    sample_size: int = 128  # the latent side it was trained at; sets the position table's scale (its base size)
    patch_size: int = 2  # latent pixels per token side
    in_channels: int = 16
    num_layers: int = 18  # joint blocks; the last is context_pre_only
    attention_head_dim: int = 64  # the width of one head (here not a head count, unlike the UNet's field)
    num_attention_heads: int = 18
    joint_attention_dim: int = 4096  # the text encoders' width (T5-XXL, the CLIPs zero-padded to it)
    caption_projection_dim: int = 1152  # context_embedder's output: the text stream's width (= the inner width)
    pooled_projection_dim: int = 2048  # the two CLIPs' pooled embeddings, concatenated
    out_channels: int | None = 16  # None: in_channels
    pos_embed_max_size: int = 96  # the position table's side in tokens; a latent uses its centred crop
    dual_attention_layers: tuple[int, ...] = ()  # SD 3.5: blocks with a second, image-only attention (attn2)
    qk_norm: str | None = None  # SD 3.5: "rms_norm" of each head's queries and keys

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def output_channels(self) -> int:
        return self.in_channels if self.out_channels is None else self.out_channels

    @property
    def max_latent_side(self) -> int:
        """The largest latent height or width the position table covers."""
        return self.pos_embed_max_size * self.patch_size

    def validate(self, where: str) -> None:
        _require(self.qk_norm in (None, "rms_norm"), where, f"qk_norm {self.qk_norm!r} is not supported")
        _require(
            self.pos_embed_max_size is not None,
            where,
            "pos_embed_max_size None (a position table interpolated per size) is not supported",
        )
        _require(
            self.caption_projection_dim == self.inner_dim,
            where,
            f"caption_projection_dim {self.caption_projection_dim} must equal num_attention_heads x "
            f"attention_head_dim ({self.inner_dim}): the text and image streams share the joint attention's width",
        )
        _require(self.inner_dim % 4 == 0, where, "the inner width must be a multiple of 4 (the 2-D sin-cos table)")
        _require(
            all(0 <= i < self.num_layers for i in self.dual_attention_layers),
            where,
            f"dual_attention_layers {self.dual_attention_layers} name blocks outside 0..{self.num_layers - 1}",
        )


def sincos_1d(dim: int, positions: np.ndarray) -> np.ndarray:
    """`get_1d_sincos_pos_embed_from_grid`: [n] positions -> [n, dim] (the sines, then the cosines), in float64."""
    omega = 1.0 / POS_EMBED_THETA ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2.0))  # [dim / 2]
    angles = np.outer(positions.astype(np.float64), omega)
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=1)


def sincos_pos_embed(dim: int, grid: int, base_size: int) -> np.ndarray:
    """`get_2d_sincos_pos_embed(dim, grid, base_size=base_size)` as PatchEmbed holds it: [1, grid * grid, dim] f32.

    Row-major tokens; the first half of each vector encodes the column and the second the row (diffusers' grid
    puts w first). Positions are `arange(grid) / (grid / base_size)` in f32, the sines and cosines float64, then
    f32. Each half depends on one coordinate, so it is computed per coordinate and broadcast: the same numbers
    without the [grid * grid, dim] float64 intermediates.
    """
    positions = np.arange(grid, dtype=np.float32) / np.float32(grid / base_size)
    axis = sincos_1d(dim // 2, positions).astype(np.float32)  # [grid, dim / 2]
    cols = np.broadcast_to(axis[None, :, :], (grid, grid, dim // 2))  # [row, col, dim / 2]
    rows = np.broadcast_to(axis[:, None, :], (grid, grid, dim // 2))
    return np.concatenate([cols, rows], axis=-1).reshape(1, grid * grid, dim)


class PatchEmbed(nnx.Module):
    """`PatchEmbed` with SD 3's cropping: patches as tokens, plus the centred crop of the position table.

    `pos_embed` is the table diffusers keeps as a persistent buffer (it is in the checkpoint); its value is
    `sincos_pos_embed`, computed here at init.
    """

    def __init__(self, cfg: SD3TransformerConfig, rngs: nnx.Rngs):
        self.patch_size, self.max_size = cfg.patch_size, cfg.pos_embed_max_size
        dim, grid, p = cfg.inner_dim, cfg.pos_embed_max_size, cfg.patch_size
        self.proj = conv(cfg.in_channels, dim, p, rngs, stride=p, padding=0)
        self.pos_embed = computed_param(
            (1, grid * grid, dim), lambda: sincos_pos_embed(dim, grid, cfg.sample_size // p)
        )

    def cropped_pos_embed(self, rows: int, cols: int) -> jax.Array:
        """The table's centred [rows, cols] crop as [rows * cols, dim] (static slices of the full table)."""
        top, left = (self.max_size - rows) // 2, (self.max_size - cols) // 2
        table = self.pos_embed[...].reshape(self.max_size, self.max_size, -1)  # [row, col, dim]
        return table[top : top + rows, left : left + cols].reshape(rows * cols, -1)

    def __call__(self, x: jax.Array) -> jax.Array:  # [batch, h, w, in] -> [batch, h/p * w/p, dim]
        b, h, w, _ = x.shape
        p, most = self.patch_size, self.max_size * self.patch_size
        if h % p or w % p:
            raise ValueError(f"latent {h}x{w}: both sides must be multiples of the patch size {p}")
        if h > most or w > most:
            raise ValueError(
                f"latent {h}x{w} is larger than this transformer's position table allows: at most {most}x{most} "
                f"(pos_embed_max_size {self.max_size} tokens of {p}x{p} latent pixels a side)"
            )
        tokens = self.proj(x)  # [batch, h/p, w/p, dim]
        rows, cols = tokens.shape[1:3]
        tokens = tokens.reshape(b, rows * cols, -1)  # row-major, as diffusers flattens NCHW
        return (tokens + self.cropped_pos_embed(rows, cols).astype(tokens.dtype)).astype(x.dtype)


class JointAttention(nnx.Module):
    """diffusers' `Attention` with `JointAttnProcessor2_0`, bias everywhere.

    With `joint` (`added_kv_proj_dim`), the text has projections of its own (`add_*_proj`, `norm_added_*`) and joins
    the sequence after the image; `context_pre_only` drops its output projection (`to_add_out`). Without `joint`
    (SD 3.5's `attn2`) it is plain self-attention over the image tokens.
    """

    def __init__(
        self, dim: int, heads: int, head_dim: int, qk_norm: str | None, rngs: nnx.Rngs, joint: bool, pre_only: bool
    ):
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        rms = (lambda: RMSNorm(head_dim, NORM_EPS, rngs)) if qk_norm == "rms_norm" else (lambda: None)
        self.to_q, self.to_k, self.to_v = (linear(dim, inner, rngs) for _ in range(3))
        self.norm_q, self.norm_k = rms(), rms()
        self.to_out = nnx.List([linear(inner, dim, rngs)])  # to_out[1] is Dropout
        added = lambda: linear(dim, inner, rngs) if joint else None  # noqa: E731
        self.add_q_proj, self.add_k_proj, self.add_v_proj = added(), added(), added()
        self.norm_added_q, self.norm_added_k = (rms(), rms()) if joint else (None, None)
        self.to_add_out = linear(inner, dim, rngs) if joint and not pre_only else None

    def _qkv(self, x: jax.Array, q, k, v, norm_q, norm_k) -> tuple[jax.Array, jax.Array, jax.Array]:
        heads = lambda a: a.reshape(*a.shape[:2], self.heads, self.head_dim)  # noqa: E731 [batch, tokens, heads, hd]
        q, k, v = heads(q(x)), heads(k(x)), heads(v(x))
        if norm_q is not None:
            q, k = norm_q(q), norm_k(k)
        return q, k, v

    def __call__(self, x: jax.Array, context: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
        """x [batch, tokens, dim], context [batch, text, dim] -> (x's output, context's output or None)."""
        q, k, v = self._qkv(x, self.to_q, self.to_k, self.to_v, self.norm_q, self.norm_k)
        if context is not None:
            added = (self.add_q_proj, self.add_k_proj, self.add_v_proj, self.norm_added_q, self.norm_added_k)
            cq, ck, cv = self._qkv(context, *added)
            q, k, v = (jnp.concatenate(pair, axis=1) for pair in ((q, cq), (k, ck), (v, cv)))  # image first
        out = dot_product_attention(q, k, v)  # [batch, image + text tokens, heads, head_dim]
        out = out.reshape(*out.shape[:2], -1).astype(q.dtype)  # [batch, tokens, inner]
        n = x.shape[1]
        text_out = self.to_add_out(out[:, n:]) if context is not None and self.to_add_out is not None else None
        return self.to_out[0](out[:, :n]), text_out


class JointTransformerBlock(nnx.Module):
    """diffusers' `JointTransformerBlock`: image and text modulated and fed forward apart, attending jointly."""

    def __init__(self, cfg: SD3TransformerConfig, index: int, rngs: nnx.Rngs):
        dim, heads, head_dim = cfg.inner_dim, cfg.num_attention_heads, cfg.attention_head_dim
        self.context_pre_only = index == cfg.num_layers - 1
        dual = index in cfg.dual_attention_layers
        self.norm1 = AdaLayerNorm(dim, 9 if dual else 6, rngs)  # SD35AdaLayerNormZeroX or AdaLayerNormZero
        # The last block's text only feeds the attention: AdaLayerNormContinuous (scale, shift), no gates.
        self.norm1_context = AdaLayerNorm(dim, 2 if self.context_pre_only else 6, rngs)
        self.attn = JointAttention(dim, heads, head_dim, cfg.qk_norm, rngs, joint=True, pre_only=self.context_pre_only)
        self.attn2 = (
            JointAttention(dim, heads, head_dim, cfg.qk_norm, rngs, joint=False, pre_only=False) if dual else None
        )
        self.ff = FeedForward(dim, rngs)
        self.ff_context = None if self.context_pre_only else FeedForward(dim, rngs)

    def __call__(self, x: jax.Array, context: jax.Array, temb: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """x [batch, image tokens, dim], context [batch, text tokens, dim], temb [batch, dim]."""
        mods = self.norm1(temb)
        shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = mods[:6]
        if self.context_pre_only:
            c_scale, c_shift = self.norm1_context(temb)
        else:
            c_shift, c_scale, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(temb)
        attn, context_attn = self.attn(modulate(x, shift, scale), modulate(context, c_shift, c_scale))
        if self.attn2 is not None:  # both attentions read the block's input, normed
            shift2, scale2, gate2 = mods[6:]
            attn2, _ = self.attn2(modulate(x, shift2, scale2))
        x = x + gate[:, None] * attn
        if self.attn2 is not None:
            x = x + gate2[:, None] * attn2
        x = x + gate_mlp[:, None] * self.ff(modulate(x, shift_mlp, scale_mlp))
        if self.context_pre_only:
            return x, None
        context = context + c_gate[:, None] * context_attn
        context = context + c_gate_mlp[:, None] * self.ff_context(modulate(context, c_shift_mlp, c_scale_mlp))
        return x, context


class SD3Transformer2DModel(nnx.Module):
    # `--quantize int8`: the programs leave these lists' kernels int8 and each block's are widened only once its input
    # exists (`nn.int8_weights.widened`), so about one block is wide at a time, not the whole network; a float block
    # runs as it is
    WIDENED_BLOCKS = ("transformer_blocks",)

    def __init__(self, config: SD3TransformerConfig, rngs: nnx.Rngs):
        cfg = self.config = config
        dim = cfg.inner_dim
        self.pos_embed = PatchEmbed(cfg, rngs)
        self.time_text_embed = CombinedTimestepTextProjEmbeddings(dim, cfg.pooled_projection_dim, rngs)
        self.context_embedder = linear(cfg.joint_attention_dim, cfg.caption_projection_dim, rngs)
        self.transformer_blocks = nnx.List([JointTransformerBlock(cfg, i, rngs) for i in range(cfg.num_layers)])
        self.norm_out = AdaLayerNorm(dim, 2, rngs)  # AdaLayerNormContinuous: scale, then shift
        self.proj_out = linear(dim, cfg.patch_size**2 * cfg.output_channels, rngs)

    @property
    def dtype(self):
        return self.context_embedder.kernel.dtype

    def project_context(self, encoder_hidden_states: jax.Array) -> jax.Array:
        """The text encoders' [batch, tokens, joint_attention_dim] -> [batch, tokens, caption_projection_dim].

        `context_embedder` of diffusers' forward: a request's text is the same at every step, so a server runs it
        once, when the request is admitted, and passes its output to `__call__` as `context`.
        """
        return self.context_embedder(encoder_hidden_states.astype(self.dtype))

    def __call__(
        self, x: jax.Array, timestep: jax.Array, context: jax.Array, pooled_projections: jax.Array
    ) -> jax.Array:
        """The prediction [batch, h, w, out_channels] for latents x [batch, h, w, in_channels].

        timestep [batch] (or scalar): what diffusers' forward takes, the scheduler's sigma x 1000.
        context [batch, tokens, caption_projection_dim]: `project_context`'s output.
        pooled_projections [batch, pooled_projection_dim]. h and w: multiples of `patch_size`, at most
        `config.max_latent_side`.
        """
        cfg, dtype, p = self.config, self.dtype, self.config.patch_size
        b, h, w, _ = x.shape
        timestep = jnp.broadcast_to(timestep, (b,))
        temb = self.time_text_embed(timestep, pooled_projections.astype(dtype))  # [batch, dim]
        image = self.pos_embed(x.astype(dtype))  # [batch, h/p * w/p, dim]
        context = context.astype(dtype)
        for block in self.transformer_blocks:
            image, context = widened(block, image)(image, context, temb)
        scale, shift = self.norm_out(temb)
        out = self.proj_out(modulate(image, shift, scale))  # [batch, h/p * w/p, p * p * out], features (p, q, c)
        out = out.reshape(b, h // p, w // p, p, p, cfg.output_channels).transpose(0, 1, 3, 2, 4, 5)
        return out.reshape(b, h, w, cfg.output_channels)  # [batch, h/p, p, w/p, q, c] -> NHWC
