"""The T5 v1.1 text encoder of SD3 and FLUX.1, mirroring transformers' `T5EncoderModel`.

A pre-norm transformer without absolute positions: each attention adds a learnt bias per head and per
bucket of relative distance (Raffel et al. 2020, section 2.1; the buckets are Mesh TensorFlow's), computed
by the first block's attention and shared by all blocks. Unlike CLIP: RMS norm without bias or mean
(`T5LayerNorm`), no 1/sqrt(d) on q.k (the initialisation absorbs it), a gated-GELU feed-forward
(`wi_0`, `wi_1`, `wo`) in v1.1, and no attention mask: diffusers' SD3 and FLUX pipelines call the encoder
without one, so padding tokens attend and are attended to.

Precision follows transformers: the norm's variance and the attention's logits and softmax are f32 in any
dtype. In float16 the feed-forward's `wo` runs in f32 (transformers' `_keep_in_fp32_modules`), so the
residual stream is f32 from the first feed-forward on, and inf is clamped where the stream is still float16.
bfloat16 has f32's range and runs as it is, as transformers runs it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..nn.layers import embed, linear
from .config import _FromJson, _require

# transformers' `ACT2FN` names that T5 configs use. `gelu_new` is the tanh approximation; "gated-gelu" means it.
ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
}


@dataclasses.dataclass(frozen=True)
class T5Config(_FromJson):
    """transformers `T5Config` (text_encoder_3/ of SD3, text_encoder_2/ of FLUX.1), the encoder's fields."""

    _strict = False  # transformers' bookkeeping and decoder keys, as for CLIPTextConfig

    vocab_size: int = 32128
    d_model: int = 4096  # the hidden size
    d_kv: int = 64  # the size of one head: d_model need not be num_heads * d_kv
    d_ff: int = 10240
    num_layers: int = 24  # the encoder's blocks (`num_decoder_layers` is the decoder's, not read)
    num_heads: int = 64
    relative_attention_num_buckets: int = 32  # half for keys before the query, half after
    relative_attention_max_distance: int = 128  # distances from here on share the last bucket
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "gated-gelu"  # "[gated-]act"; T5 v1.1: "gated-gelu" (tanh GELU); T5 1.0: "relu"
    dense_act_fn: str | None = None  # derived from feed_forward_proj; transformers writes it down too
    is_gated_act: bool | None = None  # likewise
    is_decoder: bool = False
    model_type: str = "t5"

    @property
    def activation(self) -> str:
        """The `ACTIVATIONS` name, as transformers derives it (the old name "gated-gelu" is `gelu_new`)."""
        return "gelu_new" if self.feed_forward_proj == "gated-gelu" else self.feed_forward_proj.split("-")[-1]

    @property
    def gated(self) -> bool:
        return self.feed_forward_proj.startswith("gated-")

    def validate(self, where: str) -> None:
        _require(self.model_type == "t5", where, f"model_type {self.model_type!r} is not a T5 encoder ('t5')")
        _require(not self.is_decoder, where, "is_decoder: only T5's encoder is supported")
        parts = self.feed_forward_proj.split("-")
        _require(
            len(parts) == 1 or (len(parts) == 2 and parts[0] == "gated"),
            where,
            f"feed_forward_proj {self.feed_forward_proj!r} is not 'act' or 'gated-act'",
        )
        _require(self.activation in ACTIVATIONS, where, f"activation {self.activation!r} is not supported")
        _require(
            self.dense_act_fn in (None, self.activation) and self.is_gated_act in (None, self.gated),
            where,
            f"dense_act_fn {self.dense_act_fn!r} and is_gated_act {self.is_gated_act!r} contradict "
            f"feed_forward_proj {self.feed_forward_proj!r}",
        )
        _require(self.relative_attention_num_buckets >= 4, where, "relative_attention_num_buckets must be >= 4")


def relative_position_buckets(distances: np.ndarray, num_buckets: int, max_distance: int) -> np.ndarray:
    """transformers' `T5Attention._relative_position_bucket`, bidirectional, in numpy (host, at trace time).

    `distances` = key position - query position. Half the buckets for each sign; of those, half exact
    distances, half logarithmic bins up to `max_distance`. The logarithm in f32 as torch computes it, so a
    distance on a bin's edge falls where it does there.
    """
    half = num_buckets // 2
    buckets = np.where(distances > 0, half, 0)
    distance = np.abs(distances)
    exact = half // 2
    # Distances under `exact` take the exact branch; 1 in their place keeps the unused logarithm finite.
    scaled = np.log(np.maximum(distance, 1).astype(np.float32) / np.float32(exact), dtype=np.float32)
    scaled = scaled / np.float32(math.log(max_distance / exact)) * np.float32(half - exact)
    large = np.minimum(exact + scaled.astype(np.int64), half - 1)
    return buckets + np.where(distance < exact, distance, large)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """`T5LayerNorm`: x / rms(x) * weight; the mean of squares in f32, the result in the weight's dtype."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return normed.astype(weight.dtype) * weight


class T5LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        # A bare parameter named as the checkpoint's; d_model values, so the shape-only tree need not avoid it.
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


def clamp_float16(x: jax.Array) -> jax.Array:
    """transformers' T5Block: a float16 stream is clamped to the finite range (1000 below it if any inf)."""
    if x.dtype != jnp.float16:
        return x
    top = jnp.finfo(jnp.float16).max
    bound = jnp.where(jnp.isinf(x).any(), top - 1000, top).astype(x.dtype)
    return jnp.clip(x, -bound, bound)


def biased_attention(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array) -> jax.Array:
    """softmax(q k^T + bias) v over [batch, tokens, heads, d_kv]; bias [heads, tokens_q, tokens_k] f32.

    No 1/sqrt(d_kv): T5's. The logits are whole: at FLUX's 512 tokens and 64 heads, 64 MB of f32 per prompt.
    """
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) + bias[None]
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)  # [batch, heads, tokens_q, tokens_k]
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


class T5Attention(nnx.Module):
    def __init__(self, cfg: T5Config, rngs: nnx.Rngs, has_relative_attention_bias: bool):
        inner = cfg.num_heads * cfg.d_kv
        self.heads, self.d_kv = cfg.num_heads, cfg.d_kv
        self.num_buckets = cfg.relative_attention_num_buckets
        self.max_distance = cfg.relative_attention_max_distance
        self.q = linear(cfg.d_model, inner, rngs, bias=False)
        self.k = linear(cfg.d_model, inner, rngs, bias=False)
        self.v = linear(cfg.d_model, inner, rngs, bias=False)
        self.o = linear(inner, cfg.d_model, rngs, bias=False)
        # [buckets, heads]; only the first block's has one, and every block adds what it gives.
        self.relative_attention_bias = (
            embed(self.num_buckets, cfg.num_heads, rngs) if has_relative_attention_bias else None
        )

    def position_bias(self, tokens: int) -> jax.Array:
        """[heads, tokens_q, tokens_k] f32: the learnt bias of each key's distance from each query."""
        table = relative_position_buckets(np.arange(-(tokens - 1), tokens), self.num_buckets, self.max_distance)
        per_distance = jnp.take(self.relative_attention_bias.embedding[...], jnp.asarray(table, jnp.int32), axis=0)
        distance = jnp.arange(tokens)[None, :] - jnp.arange(tokens)[:, None] + tokens - 1  # key - query, from 0
        return per_distance[distance].astype(jnp.float32).transpose(2, 0, 1)  # [tokens, tokens, heads] -> heads first

    def __call__(self, x: jax.Array, bias: jax.Array) -> jax.Array:
        b, n, _ = x.shape
        split = lambda t: t.reshape(b, n, self.heads, self.d_kv)  # noqa: E731 [batch, tokens, heads, d_kv]
        out = biased_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)), bias)
        return self.o(out.reshape(b, n, self.heads * self.d_kv))


class T5LayerSelfAttention(nnx.Module):
    def __init__(self, cfg: T5Config, rngs: nnx.Rngs, has_relative_attention_bias: bool):
        self.SelfAttention = T5Attention(cfg, rngs, has_relative_attention_bias)
        self.layer_norm = T5LayerNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def __call__(self, x: jax.Array, bias: jax.Array) -> jax.Array:
        return x + self.SelfAttention(self.layer_norm(x), bias)


class T5DenseActDense(nnx.Module):
    """`T5DenseGatedActDense` (wi_0, wi_1, wo) when gated, else `T5DenseActDense` (wi, wo); no biases."""

    def __init__(self, cfg: T5Config, rngs: nnx.Rngs):
        self.act, self.gated = cfg.activation, cfg.gated
        if cfg.gated:
            self.wi_0 = linear(cfg.d_model, cfg.d_ff, rngs, bias=False)
            self.wi_1 = linear(cfg.d_model, cfg.d_ff, rngs, bias=False)
        else:
            self.wi = linear(cfg.d_model, cfg.d_ff, rngs, bias=False)
        self.wo = linear(cfg.d_ff, cfg.d_model, rngs, bias=False)

    def __call__(self, x: jax.Array) -> jax.Array:
        act = ACTIVATIONS[self.act]
        h = act(self.wi_0(x)) * self.wi_1(x) if self.gated else act(self.wi(x))
        if h.dtype == jnp.float16:  # transformers keeps `wo` in f32 for float16: its output overflows there
            h = h.astype(jnp.float32)  # nnx.Linear promotes the kernel to it
        return self.wo(h)


class T5LayerFF(nnx.Module):
    def __init__(self, cfg: T5Config, rngs: nnx.Rngs):
        self.DenseReluDense = T5DenseActDense(cfg, rngs)
        self.layer_norm = T5LayerNorm(cfg.d_model, cfg.layer_norm_epsilon)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.DenseReluDense(self.layer_norm(x))


class T5Block(nnx.Module):
    def __init__(self, cfg: T5Config, rngs: nnx.Rngs, has_relative_attention_bias: bool):
        # layer[0]: self-attention; layer[1]: feed-forward (a decoder's cross-attention would sit between).
        self.layer = nnx.List([T5LayerSelfAttention(cfg, rngs, has_relative_attention_bias), T5LayerFF(cfg, rngs)])

    def __call__(self, x: jax.Array, bias: jax.Array) -> jax.Array:
        x = clamp_float16(self.layer[0](x, bias))
        return clamp_float16(self.layer[1](x))


class T5Stack(nnx.Module):
    def __init__(self, cfg: T5Config, rngs: nnx.Rngs):
        # `embed_tokens` is `shared` (tied, not a parameter of its own; `weights.TIED` maps its checkpoint name).
        self.block = nnx.List([T5Block(cfg, rngs, has_relative_attention_bias=i == 0) for i in range(cfg.num_layers)])
        self.final_layer_norm = T5LayerNorm(cfg.d_model, cfg.layer_norm_epsilon)


class T5EncoderModel(nnx.Module):
    """`T5EncoderModel`: token ids [batch, tokens] -> last_hidden_state [batch, tokens, d_model]."""

    def __init__(self, config: T5Config, rngs: nnx.Rngs):
        self.config = config
        self.shared = embed(config.vocab_size, config.d_model, rngs)
        self.encoder = T5Stack(config, rngs)

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        # A direct lookup, as CLIP's: `nnx.Embed` fixes its compute dtype (f32) when it is built.
        x = jnp.take(self.shared.embedding[...], input_ids, axis=0)  # [batch, tokens, d_model]
        bias = self.encoder.block[0].layer[0].SelfAttention.position_bias(input_ids.shape[1])
        for block in self.encoder.block:
            x = block(x, bias)
        return self.encoder.final_layer_norm(x)
