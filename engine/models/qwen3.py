"""Qwen3 as a text encoder (Z-Image's and FLUX.2 [klein]'s), mirroring transformers' `Qwen3Model`.

A decoder-only language model read for its hidden states, not its logits: the pipelines take one or several
layers' outputs (`output_hidden_states=True`) as the denoiser's text tokens. Each layer is pre-norm: RMSNorm,
grouped-query self-attention (`num_attention_heads` queries share `num_key_value_heads` keys and values) with an
RMSNorm over each head's q and k before RoPE (Su et al. 2021, rotate-half layout), then RMSNorm and a SwiGLU
feed-forward (`down(silu(gate(x)) * up(x))`). Attention is causal and also masks padding keys, as transformers'
`create_causal_mask` combines them: a right-padded prompt's padding rows still see its real tokens.

Precision follows transformers: norm statistics, RoPE's angles and the attention's logits and softmax are f32
in any dtype; the rest runs in the weights' dtype.

A pipeline folder holds `Qwen3Model` (keys `embed_tokens`, `layers.N`, `norm`) or `Qwen3ForCausalLM` (the same
under `model.`, beside `lm_head`); `encoder_tensors` reads either. A pipeline that reads an early layer needs
no layer after it: `Qwen3Model(config, rngs, num_layers=n)` builds the first n only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..errors import WeightsError
from ..nn.dit import RMSNorm
from ..nn.int8_weights import widened
from ..nn.layers import embed, linear
from .config import _FromJson, _require


@dataclasses.dataclass(frozen=True)
class Qwen3Config(_FromJson):
    """transformers `Qwen3Config` (text_encoder/config.json of Z-Image and FLUX.2 [klein]); defaults: Qwen3-4B."""

    _strict = False  # transformers' bookkeeping (architectures, dtype, initializer_range, use_cache, token ids)

    vocab_size: int = 151936
    hidden_size: int = 2560
    intermediate_size: int = 9728  # the SwiGLU's inner width
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8  # grouped-query attention: each key/value head serves heads / kv_heads queries
    head_dim: int = 128  # not hidden_size / heads: Qwen3-4B's 32 heads of 128 are 4096 wide over a 2560 stream
    hidden_act: str = "silu"
    max_position_embeddings: int = 40960
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0  # older config.json files say it here; transformers 5 in `rope_parameters`
    rope_scaling: Any = None  # older files' name for a non-default RoPE (YaRN, ...); None is the only one read
    rope_parameters: Any = None  # transformers 5: {"rope_theta": ..., "rope_type": "default"}, as a sorted tuple
    attention_bias: bool = False
    attention_dropout: float = 0.0
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int | None = None
    layer_types: tuple[str, ...] | None = None  # "full_attention" each; "sliding_attention" is not supported
    tie_word_embeddings: bool = False  # lm_head's, which a text encoder never reads
    model_type: str = "qwen3"

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "config") -> Qwen3Config:
        raw = dict(raw)
        rope = raw.get("rope_parameters")
        if isinstance(rope, dict):  # a dict is not hashable: kept as sorted pairs, its theta read into rope_theta
            raw["rope_theta"] = rope.get("rope_theta", raw.get("rope_theta", cls.rope_theta))
            raw["rope_parameters"] = tuple(sorted((k, str(v)) for k, v in rope.items()))
        if isinstance(raw.get("rope_scaling"), dict):
            raw["rope_scaling"] = tuple(sorted((k, str(v)) for k, v in raw["rope_scaling"].items()))
        return super().from_dict(raw, where)

    @property
    def rope_type(self) -> str:
        return dict(self.rope_parameters or ()).get("rope_type", "default")

    def validate(self, where: str) -> None:
        _require(self.model_type == "qwen3", where, f"model_type {self.model_type!r} is not Qwen3 ('qwen3')")
        _require(self.hidden_act == "silu", where, f"hidden_act {self.hidden_act!r}: only SwiGLU ('silu') is read")
        _require(
            self.rope_scaling is None and self.rope_type == "default",
            where,
            f"RoPE {self.rope_type!r} (rope_scaling {self.rope_scaling!r}): only the default RoPE is supported",
        )
        _require(
            not self.use_sliding_window and set(self.layer_types or ("full_attention",)) == {"full_attention"},
            where,
            "sliding-window attention is not supported: every layer must be full_attention",
        )
        _require(
            self.num_attention_heads % self.num_key_value_heads == 0,
            where,
            f"num_attention_heads {self.num_attention_heads} is not a multiple of "
            f"num_key_value_heads {self.num_key_value_heads}",
        )


def rope_tables(positions: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [positions, head_dim] f32, as transformers' default `Qwen3RotaryEmbedding` computes them (host)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / np.power(np.float32(theta), exponents, dtype=np.float32)  # [head_dim / 2]
    angles = np.arange(positions, dtype=np.float32)[:, None] * inv_freq[None]  # [positions, head_dim / 2]
    angles = np.concatenate([angles, angles], axis=-1)  # rotate-half layout: both halves share a frequency
    return np.cos(angles), np.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [batch, tokens, heads, head_dim] rotated: x * cos + rotate_half(x) * sin, in x's dtype."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[None, :, None].astype(x.dtype), sin[None, :, None].astype(x.dtype)  # [1, tokens, 1, head_dim]
    return x * cos + rotated * sin


def causal_padding_mask(mask: jax.Array) -> jax.Array:
    """[batch, 1, 1, tokens_q, tokens_k] bool: key k is seen by query q when k <= q and k is not padding."""
    n = mask.shape[1]
    causal = jnp.arange(n)[None, :] <= jnp.arange(n)[:, None]  # [tokens_q, tokens_k]
    return (causal[None] & mask[:, None, :].astype(bool))[:, None, None]


def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(d)) v with f32 logits; q [batch, tokens, heads, d], k and v [batch, tokens, kv_heads, d].

    Query head h reads key/value head h // (heads / kv_heads) (transformers' `repeat_kv`), here without repeating
    k and v: the queries are grouped beside their key head. A row with no allowed key (a left-padded prompt's
    padding) weighs all keys alike, as transformers' eager attention does, instead of dividing by zero.
    """
    b, n, heads, d = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, n, kv_heads, heads // kv_heads, d) * jnp.asarray(d**-0.5, q.dtype)  # [b, q, kv, group, d]
    logits = jnp.einsum("bqkgd,bmkd->bkgqm", q, k, preferred_element_type=jnp.float32)
    logits = jnp.where(allowed, logits, jnp.finfo(jnp.float32).min)  # allowed [b, 1, 1, q, m]
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqm,bmkd->bqkgd", weights, v)
    return out.reshape(b, n, heads * d)


class Qwen3Attention(nnx.Module):
    def __init__(self, cfg: Qwen3Config, rngs: nnx.Rngs):
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        inner, kv_inner = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = linear(cfg.hidden_size, inner, rngs, bias=cfg.attention_bias)
        self.k_proj = linear(cfg.hidden_size, kv_inner, rngs, bias=cfg.attention_bias)
        self.v_proj = linear(cfg.hidden_size, kv_inner, rngs, bias=cfg.attention_bias)
        self.o_proj = linear(inner, cfg.hidden_size, rngs, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, rngs)  # over each head's features, not the stream
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, allowed: jax.Array) -> jax.Array:
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(b, n, self.heads, self.head_dim))  # [batch, tokens, heads, head_dim]
        k = self.k_norm(self.k_proj(x).reshape(b, n, self.kv_heads, self.head_dim))
        v = self.v_proj(x).reshape(b, n, self.kv_heads, self.head_dim)
        out = grouped_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, allowed)
        return self.o_proj(out)


class Qwen3MLP(nnx.Module):
    def __init__(self, cfg: Qwen3Config, rngs: nnx.Rngs):
        self.gate_proj = linear(cfg.hidden_size, cfg.intermediate_size, rngs, bias=False)
        self.up_proj = linear(cfg.hidden_size, cfg.intermediate_size, rngs, bias=False)
        self.down_proj = linear(cfg.intermediate_size, cfg.hidden_size, rngs, bias=False)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(self.gate_proj(x, activation="silu", times=self.up_proj(x)))  # one write on oneDNN


class Qwen3DecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen3Config, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs)
        self.self_attn = Qwen3Attention(cfg, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, rngs)
        self.mlp = Qwen3MLP(cfg, rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, allowed: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, allowed)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nnx.Module):
    """`Qwen3Model`: ids and mask [batch, tokens] -> its hidden states, as `output_hidden_states=True` gives them.

    `num_layers`: build the first n layers only (default: all). Complete, the result is transformers' tuple of
    `num_hidden_layers + 1`: the embeddings, each layer's output, the last one after the final norm. With fewer
    layers it is the embeddings and those layers' outputs, none normed (transformers' entries 0..n).
    """

    # `--quantize int8`: the programs leave this list's kernels int8 and each layer's are widened only once its input
    # exists (`nn.int8_weights.widened`), so about one layer is wide at a time, as a DiT's blocks
    WIDENED_BLOCKS = ("layers",)

    def __init__(self, config: Qwen3Config, rngs: nnx.Rngs, num_layers: int | None = None):
        self.config = config
        self.num_layers = config.num_hidden_layers if num_layers is None else num_layers
        if not 0 < self.num_layers <= config.num_hidden_layers:
            raise ValueError(f"num_layers {num_layers} is not within 1..{config.num_hidden_layers}")
        self.embed_tokens = embed(config.vocab_size, config.hidden_size, rngs)
        self.layers = nnx.List([Qwen3DecoderLayer(config, rngs) for _ in range(self.num_layers)])
        # The final norm feeds only the complete model's last entry.
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, rngs) if self.complete else None

    @property
    def complete(self) -> bool:
        return self.num_layers == self.config.num_hidden_layers

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> tuple[jax.Array, ...]:
        """input_ids int [batch, tokens]; attention_mask [batch, tokens], 1 on real tokens (None: all real)."""
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids.shape, bool)
        # A direct lookup, as T5's and CLIP's: `nnx.Embed` fixes its compute dtype (f32) when it is built.
        x = jnp.take(self.embed_tokens.embedding[...], input_ids, axis=0)  # [batch, tokens, hidden]
        cos, sin = (
            jnp.asarray(t) for t in rope_tables(input_ids.shape[1], self.config.head_dim, self.config.rope_theta)
        )
        allowed = causal_padding_mask(attention_mask)
        states = [x]
        for layer in self.layers:
            # int8 kernels (`--quantize int8`, left so by the programs) widened only once this layer's input exists,
            # so about one layer is wide at a time, not all of them (`nn.int8_weights.widened`); f32 as it is
            x = widened(layer, x)(x, cos, sin, allowed)
            states.append(x)
        if self.norm is not None:
            states[-1] = self.norm(x)
        return tuple(states)


def layers_needed(config: Qwen3Config, hidden_layers: Sequence[int]) -> int:
    """How many layers compute transformers' `hidden_states[i]` for each i (negative counts from the end)."""
    total = config.num_hidden_layers + 1
    wanted = []
    for i in hidden_layers:
        if not -total <= i < total:
            raise ValueError(f"hidden state {i} is not one of the {total} that {config.num_hidden_layers} layers give")
        wanted.append(i % total)
    return max(1, *wanted)


def encoder_tensors(
    tensors: Mapping[str, np.ndarray], config: Qwen3Config, num_layers: int, where: str = "text_encoder"
) -> dict[str, np.ndarray]:
    """A `Qwen3Model` or `Qwen3ForCausalLM` checkpoint's tensors as `Qwen3Model(config, num_layers=n)` loads them.

    The causal LM's `model.` prefix is dropped, and so are the tensors a text encoder never reads: `lm_head` (the
    logits) and, for a model of its first n layers, the later layers and the final norm. Anything else is left
    for the strict load to judge.
    """
    causal = any(name.startswith("model.") for name in tensors)
    out = {}
    for name, value in tensors.items():
        if causal:
            if name.startswith("lm_head."):
                continue
            if not name.startswith("model."):
                raise WeightsError(f"{where}: {name} is neither under model. nor lm_head. in a Qwen3ForCausalLM")
            name = name[len("model.") :]
        parts = name.split(".")
        if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit() and int(parts[1]) >= num_layers:
            continue
        if name.startswith("norm.") and num_layers < config.num_hidden_layers:
            continue
        out[name] = value
    return out


def prompt_embeds(config: Qwen3Config, hidden_states: Sequence[jax.Array], layers: Sequence[int]) -> jax.Array:
    """The chosen hidden states side by side: [batch, tokens, len(layers) * hidden], the first one's first.

    `layers` index transformers' `num_hidden_layers + 1` hidden states (negative from its end), also when the model
    built only the first layers (`layers_needed`). FLUX.2 [klein] reads (9, 18, 27) as `torch.stack(..., dim=1)
    .permute(0, 2, 1, 3).reshape(batch, tokens, -1)`, which is this; Z-Image's `hidden_states[-2]` is one layer.
    """
    total = config.num_hidden_layers + 1
    return jnp.concatenate([hidden_states[i % total] for i in layers], axis=-1)
