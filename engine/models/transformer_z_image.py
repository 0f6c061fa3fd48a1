"""Z-Image's denoiser (Z-Image-Turbo and the base model), mirroring diffusers' `ZImageTransformer2DModel`.

A single-stream DiT (S3-DiT): the picture's 2x2 latent patches and the caption's Qwen3 hidden states are each
embedded and refined apart (`noise_refiner`: blocks modulated by the timestep; `context_refiner`: plain blocks),
then joined into one sequence, image first, for `n_layers` blocks, and the image's tokens are read out by an
adaLN-scaled final layer. A block is pre- and post-RMS-normed attention and SwiGLU feed-forward, each scaled in
(1 + scale) and gated out by tanh(gate) from one 4-chunk modulation of the timestep's 256-wide embedding.
Positions are 3-axis RoPE over (frame, row, column) at theta 256: caption token j at (1 + j, 0, 0), the
picture's patches at (P + 1, row, col), where P is the caption's length padded to a multiple of 32.

Both sequences are padded to multiples of 32 (SEQ_MULTI_OF) by learned tokens (`cap_pad_token`, `x_pad_token`)
that every query attends to; the picture's sit at position (0, 0, 0). diffusers takes lists of unequal captions
and pads the batch to its longest with keys masked out. Here a batch's captions share one static length L (a
multiple of 32, any padding at the end) and each its own `lengths[i]`: token j of caption i is real below
`lengths[i]`, a pad token below P_i = `lengths[i]` rounded up to 32, and masked out as a key above it. The lengths
are data, so captions of any length up to L run one program.

How ZImagePipeline feeds it: the timestep it reads is `(1000 - t) / 1000` for the scheduler's t = sigma * 1000
(0 at pure noise, 1 at the clean picture), multiplied by `t_scale` inside; its output is the negative of the
velocity the scheduler steps with (`noise_pred = -model_out`). `velocity` does both, as the pipeline does.

Our interface, NHWC inside the engine: latents [batch, h, w, in_channels], patched as `_patchify_image` does
(features ordered row-in-patch, column-in-patch, channel) and unpatched the same way. The caption goes through
`cap_embedder` and the context refiner once per request (`encode_context`): nothing there reads the timestep.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..nn.attention import dot_product_attention
from ..nn.dit import RMSNorm, computed_param, plain_layer_norm
from ..nn.int8_weights import widened
from ..nn.layers import Identity, linear
from .config import _FromJson, _require
from .transformer_flux import apply_rope

SEQ_MULTI_OF = 32  # both sequences are padded to a multiple of this
ADALN_EMBED_DIM = 256  # the timestep embedding's width (min(dim, 256)): what every modulation reads
TIME_CHANNELS = 256  # TimestepEmbedder's frequency_embedding_size
TIME_HIDDEN = 1024  # TimestepEmbedder(mid_size=1024)
QK_NORM_EPS = 1e-5  # the attention's per-head RMS norms (diffusers' `Attention(eps=1e-5)`), whatever norm_eps says
FINAL_NORM_EPS = 1e-6  # FinalLayer's LayerNorm
TIMESTEP_SCALE = 1000  # ZImagePipeline's `(1000 - t) / 1000`


@dataclasses.dataclass(frozen=True)
class ZImageTransformerConfig(_FromJson):
    """`ZImageTransformer2DModel` config (transformer/config.json)."""

    all_patch_size: tuple[int, ...] = (2,)  # one entry per patch embedder; the published models have one, 2
    all_f_patch_size: tuple[int, ...] = (1,)  # patch length along frames: 1 for pictures
    in_channels: int = 16  # the VAE's latent channels (FLUX.1's VAE); the output has as many
    dim: int = 3840
    n_layers: int = 30  # main blocks over the joined sequence (`layers`)
    n_refiner_layers: int = 2  # blocks of each refiner (`noise_refiner`, `context_refiner`)
    n_heads: int = 30
    n_kv_heads: int = 30  # unread: diffusers builds every attention with n_heads keys and values
    norm_eps: float = 1e-5  # the blocks' RMSNorms and the caption's
    qk_norm: bool = True  # per-head RMS norm of q and k
    cap_feat_dim: int = 2560  # the text encoder's width (Qwen3-4B's hidden states)
    siglip_feat_dim: int | None = None  # Z-Image-Omni's image features; not supported here
    rope_theta: float = 256.0
    t_scale: float = 1000.0  # the timestep the pipeline passes is multiplied by this before its sinusoid
    axes_dims: tuple[int, ...] = (32, 48, 48)  # rotary dims of (frame, row, column); they sum to the head's width
    axes_lens: tuple[int, ...] = (1024, 512, 512)  # positions each axis has angles for (Turbo's file: 1536, ...)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def adaln_dim(self) -> int:
        return min(self.dim, ADALN_EMBED_DIM)

    @property
    def ffn_dim(self) -> int:
        return int(self.dim / 3 * 8)  # diffusers' FeedForward(hidden_dim=int(dim / 3 * 8)): 10240 at 3840

    @property
    def patch_size(self) -> int:
        return self.all_patch_size[0]

    @property
    def latent_channels(self) -> int:
        return self.in_channels

    @property
    def latent_patch_size(self) -> int:
        """Latent pixels per side of one token: the engine's size multiple."""
        return self.patch_size

    @property
    def embedder_key(self) -> str:
        return f"{self.all_patch_size[0]}-{self.all_f_patch_size[0]}"  # `all_x_embedder["2-1"]`

    def validate(self, where: str) -> None:
        _require(
            len(self.all_patch_size) == 1 and self.all_f_patch_size == (1,),
            where,
            f"all_patch_size {self.all_patch_size} / all_f_patch_size {self.all_f_patch_size}: only one patch size,"
            " with frame patch 1, is supported",
        )
        _require(self.siglip_feat_dim is None, where, "siglip_feat_dim is Z-Image-Omni's: not supported")
        _require(self.dim % self.n_heads == 0, where, f"dim {self.dim} is not a multiple of n_heads {self.n_heads}")
        _require(len(self.axes_dims) == 3 == len(self.axes_lens), where, "axes_dims and axes_lens must name 3 axes")
        _require(all(d % 2 == 0 for d in self.axes_dims), where, "every axes_dims entry must be even")
        _require(
            sum(self.axes_dims) == self.head_dim,
            where,
            f"axes_dims {self.axes_dims} must sum to the head width dim / n_heads = {self.head_dim}",
        )


def padded(n):
    """n rounded up to a multiple of SEQ_MULTI_OF (an int or an integer array)."""
    return n + (-n) % SEQ_MULTI_OF


def patchify(x: jax.Array, p: int) -> jax.Array:
    """[batch, h, w, c] -> [batch, h/p * w/p, p * p * c], features (row in patch, column in patch, channel) as
    `_patchify_image` orders them."""
    b, h, w, c = x.shape
    x = x.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)  # [batch, h/p, w/p, ph, pw, c]
    return x.reshape(b, (h // p) * (w // p), p * p * c)


def unpatchify(tokens: jax.Array, h: int, w: int, p: int) -> jax.Array:
    """`patchify`'s inverse: [batch, h/p * w/p, p * p * c] -> [batch, h, w, c]."""
    b, _, features = tokens.shape
    x = tokens.reshape(b, h // p, w // p, p, p, features // (p * p)).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, h, w, features // (p * p))


def rope_tables(cfg: ZImageTransformerConfig) -> list[tuple[np.ndarray, np.ndarray]]:
    """`RopeEmbedder.precompute_freqs_cis`: per axis, cos and sin [axes_lens[i], axes_dims[i] / 2] f32.

    As diffusers: the angles position * theta^(-2k/d) in float64, rounded to float32, and their cos and sin in
    float32 (`torch.polar`). Positions index these tables.
    """
    tables = []
    for dim, length in zip(cfg.axes_dims, cfg.axes_lens, strict=True):
        freqs = 1.0 / cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)  # [dim / 2]
        angle = np.outer(np.arange(length, dtype=np.float64), freqs).astype(np.float32)  # [length, dim / 2]
        tables.append((np.cos(angle), np.sin(angle)))
    return tables


def rope(cfg: ZImageTransformerConfig, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """ids [batch, tokens, 3] (int) -> cos, sin [batch, tokens, head_dim / 2]: the three axes' angles side by side."""
    tables = rope_tables(cfg)
    cos = [jnp.take(jnp.asarray(c), ids[..., axis], axis=0, mode="clip") for axis, (c, _) in enumerate(tables)]
    sin = [jnp.take(jnp.asarray(s), ids[..., axis], axis=0, mode="clip") for axis, (_, s) in enumerate(tables)]
    return jnp.concatenate(cos, axis=-1), jnp.concatenate(sin, axis=-1)


def caption_ids(text_tokens: int, batch: int) -> jax.Array:
    """[batch, L, 3]: caption token j at (1 + j, 0, 0), pad tokens included (`_pad_with_ids`' grid from (1, 0, 0))."""
    ids = jnp.zeros((text_tokens, 3), jnp.int32).at[:, 0].set(jnp.arange(1, text_tokens + 1))
    return jnp.broadcast_to(ids, (batch, text_tokens, 3))


def image_ids(lengths: jax.Array, rows: int, cols: int) -> jax.Array:
    """[batch, padded(rows * cols), 3]: patch (r, c) at (P + 1, r, c) after a caption padded to P tokens; the
    picture's pad tokens at (0, 0, 0)."""
    grid = np.stack(np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij"), -1).reshape(-1, 2)  # [n, 2]
    n, total = rows * cols, padded(rows * cols)
    frame = (padded(lengths) + 1).astype(jnp.int32)  # [batch]
    real = jnp.concatenate(
        [jnp.broadcast_to(frame[:, None, None], (len(lengths), n, 1)), jnp.broadcast_to(grid, (len(lengths), n, 2))],
        axis=-1,
    )
    return jnp.pad(real, ((0, 0), (0, total - n), (0, 0)))


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """FLUX's `apply_rope` (pairs of features rotated in f32), with angles of each image's own: cos, sin
    [batch, tokens, head_dim / 2]."""
    return jax.vmap(lambda xi, c, s: apply_rope(xi[None], c, s)[0])(x, cos, sin)


class ZImageAttention(nnx.Module):
    """diffusers' `Attention` with `ZSingleStreamAttnProcessor`: q, k, v without bias, per-head RMS norm of q and k,
    RoPE, one attention, `to_out[0]` without bias."""

    def __init__(self, dim: int, heads: int, qk_norm: bool, rngs: nnx.Rngs):
        self.heads, self.head_dim = heads, dim // heads
        self.to_q, self.to_k, self.to_v = (linear(dim, dim, rngs, bias=False) for _ in range(3))
        self.norm_q = RMSNorm(self.head_dim, QK_NORM_EPS, rngs) if qk_norm else None
        self.norm_k = RMSNorm(self.head_dim, QK_NORM_EPS, rngs) if qk_norm else None
        self.to_out = nnx.List([linear(dim, dim, rngs, bias=False)])  # to_out[1] is Dropout

    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array], key_mask: jax.Array | None) -> jax.Array:
        b, n, _ = x.shape
        q, k, v = (proj(x).reshape(b, n, self.heads, self.head_dim) for proj in (self.to_q, self.to_k, self.to_v))
        if self.norm_q is not None:
            q, k = self.norm_q(q), self.norm_k(k)
        q, k = rotate(q, *rope), rotate(k, *rope)
        out = dot_product_attention(q, k, v, key_mask)  # [batch, tokens, heads, head_dim]
        return self.to_out[0](out.reshape(b, n, -1).astype(x.dtype))


class FeedForward(nnx.Module):
    """SwiGLU: `w2(silu(w1 x) * w3 x)`, no biases."""

    def __init__(self, dim: int, hidden: int, rngs: nnx.Rngs):
        self.w1 = linear(dim, hidden, rngs, bias=False)
        self.w2 = linear(hidden, dim, rngs, bias=False)
        self.w3 = linear(dim, hidden, rngs, bias=False)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.w2(self.w1(x, activation="silu", times=self.w3(x)))  # one write of silu(w1 x) * w3 x on oneDNN


class ZImageTransformerBlock(nnx.Module):
    """Attention and feed-forward, each between two RMS norms; with `modulation`, each scaled in by (1 + scale) and
    gated out by tanh(gate) from `adaLN_modulation(temb)` (no SiLU before it), chunks (scale, gate) x 2."""

    def __init__(self, cfg: ZImageTransformerConfig, modulation: bool, rngs: nnx.Rngs):
        dim, eps = cfg.dim, cfg.norm_eps
        self.attention = ZImageAttention(dim, cfg.n_heads, cfg.qk_norm, rngs)
        self.feed_forward = FeedForward(dim, cfg.ffn_dim, rngs)
        self.attention_norm1, self.ffn_norm1 = RMSNorm(dim, eps, rngs), RMSNorm(dim, eps, rngs)
        self.attention_norm2, self.ffn_norm2 = RMSNorm(dim, eps, rngs), RMSNorm(dim, eps, rngs)
        self.adaLN_modulation = nnx.List([linear(cfg.adaln_dim, 4 * dim, rngs)]) if modulation else None

    def __call__(self, x: jax.Array, rope, key_mask: jax.Array | None, temb: jax.Array | None = None) -> jax.Array:
        """x [batch, tokens, dim]; temb [batch, adaln_dim] for a modulated block."""
        if self.adaLN_modulation is None:
            x = x + self.attention_norm2(self.attention(self.attention_norm1(x), rope, key_mask))
            return x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x)))
        mod = self.adaLN_modulation[0](temb)[:, None]  # [batch, 1, 4 * dim]
        scale_msa, gate_msa, scale_mlp, gate_mlp = jnp.split(mod, 4, axis=-1)
        attn = self.attention(self.attention_norm1(x) * (1 + scale_msa), rope, key_mask)
        x = x + jnp.tanh(gate_msa) * self.attention_norm2(attn)
        ff = self.feed_forward(self.ffn_norm1(x) * (1 + scale_mlp))
        return x + jnp.tanh(gate_mlp) * self.ffn_norm2(ff)


class FinalLayer(nnx.Module):
    """LayerNorm without affine, scaled by 1 + `adaLN_modulation(temb)` (SiLU, then linear), then `linear`."""

    def __init__(self, cfg: ZImageTransformerConfig, rngs: nnx.Rngs):
        self.linear = linear(cfg.dim, cfg.patch_size**2 * cfg.in_channels, rngs)
        self.adaLN_modulation = nnx.List([Identity(), linear(cfg.adaln_dim, cfg.dim, rngs)])  # [0] is the SiLU

    def __call__(self, x: jax.Array, temb: jax.Array) -> jax.Array:
        scale = 1 + self.adaLN_modulation[1](jax.nn.silu(temb))[:, None]  # [batch, 1, dim]
        return self.linear(plain_layer_norm(x, FINAL_NORM_EPS) * scale)


def time_frequencies() -> np.ndarray:
    """The sinusoid's 128 frequencies 10000^(-k / 128), float32 as diffusers' `timestep_embedding` has them: the
    exponent in float32, its exp in float64 rounded once. XLA's float32 exp is an ulp off in 17 of the 128 (torch's
    in 2), and at timesteps near 1000 one ulp of a frequency moves its angle by 3e-5."""
    half = TIME_CHANNELS // 2
    exponent = np.float32(-math.log(10000)) * np.arange(half, dtype=np.float32) / np.float32(half)
    return np.exp(exponent.astype(np.float64)).astype(np.float32)


def time_sinusoid(t: jax.Array) -> jax.Array:
    """`TimestepEmbedder.timestep_embedding`: t [batch] -> [batch, 256] f32, the cosines then the sines of t * f."""
    args = t.astype(jnp.float32)[:, None] * jnp.asarray(time_frequencies())[None, :]  # [batch, 128]
    return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


class TimestepEmbedder(nnx.Module):
    """The timestep's sinusoid (cos, then sin; 256 wide) through `mlp`: linear, SiLU, linear to `adaln_dim`."""

    def __init__(self, out_dim: int, rngs: nnx.Rngs):
        self.mlp = nnx.List([linear(TIME_CHANNELS, TIME_HIDDEN, rngs), Identity(), linear(TIME_HIDDEN, out_dim, rngs)])

    def __call__(self, t: jax.Array, dtype) -> jax.Array:
        """t [batch] f32 (already times t_scale) -> [batch, out_dim] in `dtype` (the sinusoid is f32 until then)."""
        return self.mlp[2](jax.nn.silu(self.mlp[0](time_sinusoid(t).astype(dtype))))


class ZImageTransformer2DModel(nnx.Module):
    """Patch and caption embedders, the two refiners, the joint blocks and the final layer, at diffusers' keys."""

    # `--quantize int8`: the programs leave these lists' kernels int8 and each block's are widened only once its input
    # exists (`nn.int8_weights.widened`), so about one block is wide at a time, not the whole network; a float block
    # runs as it is
    WIDENED_BLOCKS = ("noise_refiner", "context_refiner", "layers")

    def __init__(self, config: ZImageTransformerConfig, rngs: nnx.Rngs):
        cfg = self.config = config
        key, dim = cfg.embedder_key, cfg.dim
        self.all_x_embedder = nnx.Dict({key: linear(cfg.patch_size**2 * cfg.in_channels, dim, rngs)})
        self.all_final_layer = nnx.Dict({key: FinalLayer(cfg, rngs)})
        self.noise_refiner = nnx.List([ZImageTransformerBlock(cfg, True, rngs) for _ in range(cfg.n_refiner_layers)])
        self.context_refiner = nnx.List([ZImageTransformerBlock(cfg, False, rngs) for _ in range(cfg.n_refiner_layers)])
        self.t_embedder = TimestepEmbedder(cfg.adaln_dim, rngs)
        self.cap_embedder = nnx.List(
            [RMSNorm(cfg.cap_feat_dim, cfg.norm_eps, rngs), linear(cfg.cap_feat_dim, dim, rngs)]
        )
        self.x_pad_token = computed_param((1, dim), lambda: np.zeros((1, dim), np.float32))
        self.cap_pad_token = computed_param((1, dim), lambda: np.zeros((1, dim), np.float32))
        self.layers = nnx.List([ZImageTransformerBlock(cfg, True, rngs) for _ in range(cfg.n_layers)])

    @property
    def dtype(self):
        return self.all_x_embedder[self.config.embedder_key].kernel.dtype

    def _check_caption(self, text_tokens: int) -> None:
        cfg = self.config
        if text_tokens % SEQ_MULTI_OF:
            raise ValueError(f"the caption's static length {text_tokens} must be a multiple of {SEQ_MULTI_OF}")
        if text_tokens + 1 >= cfg.axes_lens[0]:
            raise ValueError(f"captions of {text_tokens} tokens pass this model's {cfg.axes_lens[0]} frame positions")

    def encode_context(self, cap_feats: jax.Array, lengths: jax.Array) -> jax.Array:
        """The text encoder's hidden states [batch, L, cap_feat_dim] -> the refined caption [batch, L, dim].

        `lengths` [batch] (int, 1 to L): the real tokens of each caption, at its start (diffusers' list entries).
        L must be a multiple of 32. `cap_embedder`, the pad tokens and `context_refiner`: what diffusers' forward
        runs at every step, though none of it reads the timestep; a server runs it once per request.
        """
        b, text_tokens, _ = cap_feats.shape
        self._check_caption(text_tokens)
        feats = self.cap_embedder[1](self.cap_embedder[0](cap_feats.astype(self.dtype)))  # [batch, L, dim]
        j = jnp.arange(text_tokens)
        real = j[None, :] < lengths[:, None]  # [batch, L]
        feats = jnp.where(real[..., None], feats, self.cap_pad_token[...].astype(feats.dtype))
        key_mask = j[None, :] < padded(lengths)[:, None]
        angles = rope(self.config, caption_ids(text_tokens, b))
        for block in self.context_refiner:
            feats = widened(block, feats)(feats, angles, key_mask)
        return feats

    def __call__(self, x: jax.Array, timestep: jax.Array, context: jax.Array, lengths: jax.Array) -> jax.Array:
        """diffusers' output [batch, h, w, in_channels] for latents x [batch, h, w, in_channels].

        timestep [batch] (or scalar): what the transformer receives, `(1000 - t) / 1000` as ZImagePipeline passes
        it (`transformer_timestep`). context [batch, L, dim]: `encode_context`'s output for captions of `lengths`.
        h and w must be multiples of the patch size.
        """
        cfg = self.config
        b, h, w, c = x.shape
        p = cfg.patch_size
        if h % p or w % p:
            raise ValueError(
                f"Z-Image patches {p}x{p} latent pixels: the latent sides {h}x{w} must be multiples of {p}"
            )
        if c != cfg.in_channels:
            raise ValueError(f"the latents have {c} channels; this transformer takes {cfg.in_channels}")
        rows, cols = h // p, w // p
        if rows > cfg.axes_lens[1] or cols > cfg.axes_lens[2]:
            raise ValueError(f"{rows}x{cols} patches pass this model's {cfg.axes_lens[1:]} row and column positions")
        text_tokens = context.shape[1]
        self._check_caption(text_tokens)
        dtype = self.dtype
        t = jnp.broadcast_to(timestep, (b,)).astype(jnp.float32) * jnp.float32(cfg.t_scale)
        temb = self.t_embedder(t, dtype)  # [batch, adaln_dim]
        n = rows * cols
        image = self.all_x_embedder[cfg.embedder_key](patchify(x.astype(dtype), p))  # [batch, n, dim]
        pad = jnp.broadcast_to(self.x_pad_token[...].astype(dtype), (b, padded(n) - n, cfg.dim))
        image = jnp.concatenate([image, pad], axis=1)  # [batch, padded(n), dim]: every token attended
        image_angles = rope(cfg, image_ids(lengths, rows, cols))
        for block in self.noise_refiner:
            image = widened(block, image)(image, image_angles, None, temb)
        joined = jnp.concatenate([image, context.astype(dtype)], axis=1)  # [batch, padded(n) + L, dim], image first
        text_angles = rope(cfg, caption_ids(text_tokens, b))
        angles = tuple(jnp.concatenate(pair, axis=1) for pair in zip(image_angles, text_angles, strict=True))
        key_mask = jnp.arange(joined.shape[1])[None, :] < (padded(n) + padded(lengths))[:, None]
        for block in self.layers:
            joined = widened(block, joined)(joined, angles, key_mask, temb)
        out = self.all_final_layer[cfg.embedder_key](joined[:, :n], temb)  # [batch, n, p * p * in_channels]
        return unpatchify(out, h, w, p)

    def velocity(self, x: jax.Array, t: jax.Array, context: jax.Array, lengths: jax.Array) -> jax.Array:
        """What ZImagePipeline hands its scheduler for the scheduler's timestep t (sigma * 1000): the transformer
        read at `(1000 - t) / 1000`, negated."""
        return -self(x, transformer_timestep(t), context, lengths)


def transformer_timestep(t: jax.Array) -> jax.Array:
    """ZImagePipeline's `(1000 - t) / 1000` in f32: the scheduler's t (sigma * 1000) as the transformer reads it."""
    return (TIMESTEP_SCALE - jnp.asarray(t, jnp.float32)) / TIMESTEP_SCALE
