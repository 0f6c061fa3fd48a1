"""FLUX.1's denoiser (schnell and dev), mirroring diffusers' `FluxTransformer2DModel`.

A rectified-flow transformer (MMDiT): `num_layers` double-stream blocks, where text and image tokens keep weights
of their own and meet in one joint attention, then `num_single_layers` single-stream blocks over the joined
sequence (attention and MLP side by side, one output projection). Every block is modulated by adaLN-Zero from
one conditioning vector: the timestep's (and, for dev, the guidance scale's) sinusoid embedded, plus the pooled
CLIP text projected. Positions are 3-axis rotary embeddings (axes (0, row, column), text ids all zero) applied
to the queries and keys after their RMS norm; the joint sequence is text tokens first, then image tokens.

Our interface, NHWC inside the engine: `__call__` takes the VAE's latents unpacked, [batch, h, w, 16], packs
2x2 patches into tokens as FluxPipeline's `_pack_latents` does, and unpacks the prediction the same way. The
text goes through `context_embedder` once per request (`project_context`), not at every step.

FLUX.1 Kontext (`FluxKontextPipeline`) edits a picture: its latents, packed the same way, follow the latents'
tokens in the sequence, with ids whose first axis is 1 instead of 0, and the prediction is read on the latents'
tokens alone. `__call__(references=)` takes them unpacked, like `x`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..nn.attention import dot_product_attention
from ..nn.dit import (
    MLP_RATIO,
    NORM_EPS,
    AdaLayerNorm,
    CombinedTimestepTextProjEmbeddings,
    FeedForward,
    RMSNorm,
    modulate,
)
from ..nn.int8_weights import widened
from ..nn.layers import linear
from .config import _FromJson, _require

ROPE_THETA = 10000  # FluxPosEmbed(theta=10000)
TIME_FACTOR = 1000  # the transformer multiplies the timestep (FluxPipeline passes t / 1000) and guidance by it


@dataclasses.dataclass(frozen=True)
class FluxTransformerConfig(_FromJson):
    """`FluxTransformer2DModel` config (transformer/config.json)."""

    patch_size: int = 1  # FluxPipeline packs 2x2 latent patches itself; the transformer's own patch is 1
    in_channels: int = 64  # packed: 4 x the VAE's latent channels (2x2 patches); `latent_channels` is ours
    out_channels: int | None = None  # None: in_channels
    num_layers: int = 19  # double-stream blocks (`transformer_blocks`)
    num_single_layers: int = 38  # single-stream blocks (`single_transformer_blocks`)
    attention_head_dim: int = 128  # the width of one head (not a head count)
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096  # the text encoder's (T5-XXL's) width
    pooled_projection_dim: int = 768  # CLIP's pooled text embedding
    guidance_embeds: bool = False  # dev: the guidance scale is embedded beside the timestep (guidance-distilled)
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)  # rotary dims per position axis; they sum to attention_head_dim

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def packed_out_channels(self) -> int:
        return self.out_channels or self.in_channels

    @property
    def latent_channels(self) -> int:
        """Channels of the unpacked NHWC latents `__call__` takes (16 for FLUX.1): each token packs a 2x2 patch."""
        return self.in_channels // 4

    @property
    def latent_patch_size(self) -> int:
        """Latent pixels per side of one token: the 2x2 patches `__call__` packs (the engine's size multiple)."""
        return 2

    def validate(self, where: str) -> None:
        _require(self.patch_size == 1, where, f"patch_size {self.patch_size} is not supported (only 1)")
        _require(self.in_channels % 4 == 0, where, f"in_channels {self.in_channels} is not 4 x latent channels")
        _require(
            self.packed_out_channels % 4 == 0, where, f"out_channels {self.packed_out_channels} is not a multiple of 4"
        )
        _require(len(self.axes_dims_rope) == 3, where, f"axes_dims_rope {self.axes_dims_rope} must name 3 axes")
        _require(all(d % 2 == 0 for d in self.axes_dims_rope), where, "every axes_dims_rope entry must be even")
        _require(
            sum(self.axes_dims_rope) == self.attention_head_dim,
            where,
            f"axes_dims_rope {self.axes_dims_rope} must sum to attention_head_dim {self.attention_head_dim}",
        )


def pack(x: jax.Array) -> jax.Array:
    """[batch, h, w, c] -> [batch, h/2 * w/2, c * 4], features (c, ph, pw) as FluxPipeline's `_pack_latents`."""
    b, h, w, c = x.shape
    x = x.reshape(b, h // 2, 2, w // 2, 2, c).transpose(0, 1, 3, 5, 2, 4)  # [batch, h/2, w/2, c, ph, pw]
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: jax.Array, h: int, w: int) -> jax.Array:
    """`pack`'s inverse ( FluxPipeline's `_unpack_latents`, NHWC): [batch, h/2 * w/2, c * 4] -> [batch, h, w, c]."""
    b, _, features = tokens.shape
    x = tokens.reshape(b, h // 2, w // 2, features // 4, 2, 2).transpose(0, 1, 4, 2, 5, 3)  # [b, h/2, ph, w/2, pw, c]
    return x.reshape(b, h, w, features // 4)


def grid_ids(rows: int, cols: int, first: int = 0) -> np.ndarray:
    """[rows * cols, 3]: `_prepare_latent_image_ids` (first, row, col), row by row; `first` is 1 for Kontext's
    reference picture (`FluxKontextPipeline.prepare_latents`' `image_ids`)."""
    image = np.zeros((rows, cols, 3))
    image[..., 0] = first
    image[..., 1] = np.arange(rows)[:, None]
    image[..., 2] = np.arange(cols)[None, :]
    return image.reshape(rows * cols, 3)


def position_ids(text_tokens: int, rows: int, cols: int, reference: tuple[int, int] | None = None) -> np.ndarray:
    """[text + rows * cols (+ the reference's), 3]: the pipeline's `txt_ids` (zeros), then the latents' grid, then
    the reference picture's grid of (rows, cols) tokens, if any, with its first axis 1."""
    ids = [np.zeros((text_tokens, 3)), grid_ids(rows, cols)]
    if reference is not None:
        ids.append(grid_ids(*reference, first=1))
    return np.concatenate(ids)


def rope_tables(
    axes_dims: tuple[int, ...], ids: np.ndarray, theta: float = ROPE_THETA
) -> tuple[np.ndarray, np.ndarray]:
    """`FluxPosEmbed` (and FLUX.2's `Flux2PosEmbed`, 4 axes, theta 2000): cos and sin [tokens, head_dim / 2] f32,
    one angle per pair of features.

    In float64 on the host as diffusers computes them (its `freqs_dtype`), then f32. diffusers repeats each
    value twice (`repeat_interleave_real`) to cover both features of a pair; `apply_rope` reads them per pair.
    The ids depend on the shapes only, so under jit these are constants of the program.
    """
    angles = []
    for axis, dim in enumerate(axes_dims):
        freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)  # [dim / 2]
        angles.append(np.outer(ids[:, axis].astype(np.float32).astype(np.float64), freqs))
    angle = np.concatenate(angles, axis=-1)  # [tokens, head_dim / 2]
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """diffusers' `apply_rotary_emb` (use_real, unbind -1) in f32: each feature pair (re, im) rotated by its angle.

    x [batch, tokens, heads, head_dim]; cos, sin [tokens, head_dim / 2].
    """
    b, n, h, d = x.shape
    pairs = x.astype(jnp.float32).reshape(b, n, h, d // 2, 2)
    re, im = pairs[..., 0], pairs[..., 1]  # [batch, tokens, heads, head_dim / 2]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    out = jnp.stack([re * cos - im * sin, im * cos + re * sin], axis=-1)
    return out.reshape(b, n, h, d).astype(x.dtype)


Rope = tuple[jax.Array, jax.Array]  # cos, sin [tokens, head_dim / 2] of the joint sequence


def rope_attention(q: jax.Array, k: jax.Array, v: jax.Array, rope: Rope, dtype) -> jax.Array:
    """RoPE on the normed q and k, one attention over the sequence: [batch, tokens, heads, head_dim] ->
    [batch, tokens, heads * head_dim] in `dtype`."""
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    out = dot_product_attention(q, k, v)  # [batch, tokens, heads, head_dim]
    return out.reshape(*out.shape[:2], -1).astype(dtype)


class FluxAttention(nnx.Module):
    """`FluxAttention` with `FluxAttnProcessor`: per-head RMS-normed q and k, RoPE, one attention.

    With `joint`, the text has projections of its own (`add_*_proj`, `norm_added_*`, `to_add_out`) and joins the
    sequence in front of the image; without (the single-stream blocks) the input is the joined sequence already
    and there is no output projection (`pre_only`). FLUX.2's `Flux2Attention` (double-stream) is the joint kind
    with no biases (`bias=False`) and the config's `eps`.
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        head_dim: int,
        joint: bool,
        rngs: nnx.Rngs,
        bias: bool = True,
        eps: float = NORM_EPS,
    ):
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.norm_q = RMSNorm(head_dim, eps, rngs)
        self.norm_k = RMSNorm(head_dim, eps, rngs)
        self.to_q, self.to_k, self.to_v = (linear(dim, inner, rngs, bias=bias) for _ in range(3))
        self.to_out = nnx.List([linear(inner, dim, rngs, bias=bias)]) if joint else None  # to_out[1] is Dropout
        if joint:
            self.norm_added_q = RMSNorm(head_dim, eps, rngs)
            self.norm_added_k = RMSNorm(head_dim, eps, rngs)
            self.add_q_proj, self.add_k_proj, self.add_v_proj = (linear(dim, inner, rngs, bias=bias) for _ in range(3))
            self.to_add_out = linear(inner, dim, rngs, bias=bias)

    def _heads(self, x: jax.Array) -> jax.Array:
        return x.reshape(*x.shape[:2], self.heads, self.head_dim)  # [batch, tokens, heads, head_dim]

    def _qkv(self, x: jax.Array, q, k, v, norm_q, norm_k) -> tuple[jax.Array, jax.Array, jax.Array]:
        return norm_q(self._heads(q(x))), norm_k(self._heads(k(x))), self._heads(v(x))

    def __call__(self, x: jax.Array, rope: Rope, context: jax.Array | None = None):
        """x [batch, tokens, dim] -> [batch, tokens, inner]; with `context`, (image, text) each projected out."""
        q, k, v = self._qkv(x, self.to_q, self.to_k, self.to_v, self.norm_q, self.norm_k)
        if context is not None:
            added = (self.add_q_proj, self.add_k_proj, self.add_v_proj, self.norm_added_q, self.norm_added_k)
            cq, ck, cv = self._qkv(context, *added)
            q, k, v = (jnp.concatenate(pair, axis=1) for pair in ((cq, q), (ck, k), (cv, v)))  # text first
        out = rope_attention(q, k, v, rope, x.dtype)  # [batch, tokens, inner]
        if context is None:
            return out
        text = context.shape[1]
        return self.to_out[0](out[:, text:]), self.to_add_out(out[:, :text])


class FluxTransformerBlock(nnx.Module):
    """Double stream: text and image modulated, fed forward and gated apart, attending jointly."""

    def __init__(self, dim: int, heads: int, head_dim: int, rngs: nnx.Rngs):
        self.norm1 = AdaLayerNorm(dim, 6, rngs)
        self.norm1_context = AdaLayerNorm(dim, 6, rngs)
        self.attn = FluxAttention(dim, heads, head_dim, True, rngs)
        self.ff = FeedForward(dim, rngs)
        self.ff_context = FeedForward(dim, rngs)

    def __call__(self, x: jax.Array, context: jax.Array, temb: jax.Array, rope: Rope) -> tuple[jax.Array, jax.Array]:
        return double_stream(self, x, context, self.norm1(temb), self.norm1_context(temb), rope)


def double_stream(block, x, context, image_mod, text_mod, rope: Rope, eps: float = NORM_EPS):
    """One double-stream block's arithmetic, FLUX.1's and FLUX.2's alike: `block.attn` (joint), `block.ff` and
    `block.ff_context` applied under the image's and the text's 6 modulation vectors (shift, scale, gate of the
    attention, then of the MLP, each [batch, dim]). FLUX.1 computes them in the block, FLUX.2 once for all blocks."""
    shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = image_mod
    c_shift, c_scale, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = text_mod
    attn, context_attn = block.attn(modulate(x, shift, scale, eps), rope, modulate(context, c_shift, c_scale, eps))
    x = x + gate[:, None] * attn
    x = x + gate_mlp[:, None] * block.ff(modulate(x, shift_mlp, scale_mlp, eps))
    context = context + c_gate[:, None] * context_attn
    context = context + c_gate_mlp[:, None] * block.ff_context(modulate(context, c_shift_mlp, c_scale_mlp, eps))
    # diffusers clips fp16 to its range here; bf16 and f32 reach 3e38, so nothing is clipped.
    return x, context


class FluxSingleTransformerBlock(nnx.Module):
    """Single stream over the joined [text, image] sequence: attention and a GELU MLP in parallel, one projection."""

    def __init__(self, dim: int, heads: int, head_dim: int, rngs: nnx.Rngs):
        self.norm = AdaLayerNorm(dim, 3, rngs)
        self.proj_mlp = linear(dim, dim * MLP_RATIO, rngs)
        self.attn = FluxAttention(dim, heads, head_dim, False, rngs)
        self.proj_out = linear(dim + dim * MLP_RATIO, dim, rngs)

    def __call__(self, x: jax.Array, temb: jax.Array, rope: Rope) -> jax.Array:
        shift, scale, gate = self.norm(temb)
        h = modulate(x, shift, scale)
        mlp = self.proj_mlp(h, activation="gelu_tanh")  # as dit.GELUProj
        both = jnp.concatenate([self.attn(h, rope), mlp], axis=-1)  # [batch, tokens, inner + mlp]
        return x + gate[:, None] * self.proj_out(both)  # no fp16 clip needed: see FluxTransformerBlock


class FluxTransformer2DModel(nnx.Module):
    """`x_embedder` and `context_embedder` in, double- then single-stream blocks, `norm_out` and `proj_out` out."""

    # `--quantize int8`: the programs leave these lists' kernels int8 and each block's are widened only once its input
    # exists (`nn.int8_weights.widened`), so about one block is wide at a time, not the whole network; a float block
    # runs as it is
    WIDENED_BLOCKS = ("transformer_blocks", "single_transformer_blocks")

    def __init__(self, config: FluxTransformerConfig, rngs: nnx.Rngs):
        cfg = self.config = config
        dim, heads, head_dim = cfg.inner_dim, cfg.num_attention_heads, cfg.attention_head_dim
        self.x_embedder = linear(cfg.in_channels, dim, rngs)
        self.context_embedder = linear(cfg.joint_attention_dim, dim, rngs)
        # CombinedTimestepTextProjEmbeddings (schnell) or CombinedTimestepGuidanceTextProjEmbeddings (dev)
        self.time_text_embed = CombinedTimestepTextProjEmbeddings(
            dim, cfg.pooled_projection_dim, rngs, guidance=cfg.guidance_embeds
        )
        self.transformer_blocks = nnx.List(
            [FluxTransformerBlock(dim, heads, head_dim, rngs) for _ in range(cfg.num_layers)]
        )
        self.single_transformer_blocks = nnx.List(
            [FluxSingleTransformerBlock(dim, heads, head_dim, rngs) for _ in range(cfg.num_single_layers)]
        )
        self.norm_out = AdaLayerNorm(dim, 2, rngs)  # AdaLayerNormContinuous: scale, then shift
        self.proj_out = linear(dim, cfg.patch_size**2 * cfg.packed_out_channels, rngs)

    @property
    def dtype(self):
        return self.x_embedder.kernel.dtype

    def project_context(self, encoder_hidden_states: jax.Array) -> jax.Array:
        """The text encoder's [batch, tokens, joint_attention_dim] -> [batch, tokens, inner]: what `__call__` takes.

        `context_embedder` of diffusers' forward; a request's text is the same at every step, so a server runs
        it once, when the request is admitted.
        """
        return self.context_embedder(encoder_hidden_states.astype(self.dtype))

    def __call__(
        self,
        x: jax.Array,
        timestep: jax.Array,
        context: jax.Array,
        pooled_projections: jax.Array,
        guidance: jax.Array | None = None,
        references: jax.Array | None = None,
    ) -> jax.Array:
        """The velocity prediction [batch, h, w, out latent channels] for latents x [batch, h, w, latent_channels].

        timestep [batch] (or scalar): what diffusers' transformer receives, t / 1000 as FluxPipeline passes it.
        context [batch, tokens, inner]: `project_context`'s output. pooled_projections [batch, pooled_projection_dim].
        guidance [batch]: the guidance scale, only when `config.guidance_embeds` (dev); both are multiplied by
        1000 inside, as diffusers does. h and w must be even: each token is a 2x2 patch.
        references [batch or 1, h', w', latent_channels]: Kontext's reference picture's latents (any even size),
        read as tokens after the latents'; the prediction is the latents' alone.
        """
        cfg = self.config
        b, h, w, c = x.shape
        check_latents(x, cfg, "latents")
        reference = None
        if references is not None:
            check_latents(references, cfg, "reference latents")
            reference = (references.shape[1] // 2, references.shape[2] // 2)
        if cfg.guidance_embeds and guidance is None:
            raise ValueError("this transformer embeds the guidance scale (guidance_embeds): pass guidance")
        if not cfg.guidance_embeds and guidance is not None:
            raise ValueError("this transformer has no guidance embedding (guidance_embeds is false): pass None")
        dtype = self.dtype
        # diffusers casts t / 1000 to the activations' dtype before x1000; in f32 here, so bf16 does not round t.
        timestep = jnp.broadcast_to(timestep, (b,)).astype(jnp.float32) * TIME_FACTOR
        if guidance is not None:
            guidance = jnp.broadcast_to(guidance, (b,)).astype(jnp.float32) * TIME_FACTOR
        temb = self.time_text_embed(timestep, pooled_projections.astype(dtype), guidance)  # [batch, inner]
        text = context.shape[1]
        ids = position_ids(text, h // 2, w // 2, reference)
        rope = tuple(jnp.asarray(t) for t in rope_tables(cfg.axes_dims_rope, ids))
        tokens = pack(x.astype(dtype))  # [batch, h/2 * w/2, in_channels]
        latent_tokens = tokens.shape[1]
        if references is not None:  # FluxKontextPipeline: torch.cat([latents, image_latents], dim=1)
            references = jnp.broadcast_to(references, (b, *references.shape[1:]))
            tokens = jnp.concatenate([tokens, pack(references.astype(dtype))], axis=1)
        image = self.x_embedder(tokens)  # [batch, image tokens, inner]
        context = context.astype(dtype)
        for block in self.transformer_blocks:
            image, context = widened(block, image)(image, context, temb, rope)
        # diffusers joins and splits the sequence around every single block; once around them all is the same.
        joined = jnp.concatenate([context, image], axis=1)  # [batch, text + image tokens, inner]
        for block in self.single_transformer_blocks:
            joined = widened(block, joined)(joined, temb, rope)
        scale, shift = self.norm_out(temb)
        latents = joined[:, text : text + latent_tokens]  # Kontext's `noise_pred[:, : latents.size(1)]`
        out = self.proj_out(modulate(latents, shift, scale))  # [batch, h/2 * w/2, out_channels]
        return unpack(out, h, w)


def check_latents(x: jax.Array, cfg: FluxTransformerConfig, what: str) -> None:
    """Latents the transformer can pack: even sides (each token is a 2x2 patch) and the VAE's channels."""
    _, h, w, c = x.shape
    if h % 2 or w % 2:
        raise ValueError(f"FLUX packs 2x2 latent patches: the {what}' sides {h}x{w} must be even")
    if c != cfg.latent_channels:
        raise ValueError(f"the {what} have {c} channels; this transformer takes {cfg.latent_channels}")
