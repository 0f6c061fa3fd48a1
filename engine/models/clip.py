"""The CLIP text encoder, mirroring transformers' `CLIPTextModel` and `CLIPTextModelWithProjection`.

A pre-LayerNorm causal transformer over 77 token ids. SD 1.x reads the last hidden state
(after `final_layer_norm`); SD 2.x the same from an OpenCLIP-H encoder; SDXL reads the
penultimate hidden state of two encoders and the projected pooled output of the second.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ..nn.layers import causal_attention, embed, layer_norm, linear
from .config import CLIPTextConfig


class CLIPAttention(nnx.Module):
    def __init__(self, cfg: CLIPTextConfig, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.q_proj = linear(d, d, rngs)
        self.k_proj = linear(d, d, rngs)
        self.v_proj = linear(d, d, rngs)
        self.out_proj = linear(d, d, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, n, d = x.shape
        split = lambda t: t.reshape(b, n, self.heads, d // self.heads)  # noqa: E731 [batch, tokens, heads, head_dim]
        out = causal_attention(split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x)))  # i sees 0..i
        return self.out_proj(out.reshape(b, n, d))


class CLIPMLP(nnx.Module):
    def __init__(self, cfg: CLIPTextConfig, rngs: nnx.Rngs):
        self.hidden_act = "quick_gelu" if cfg.hidden_act == "quick_gelu" else "gelu"  # transformers' exact GELU
        self.fc1 = linear(cfg.hidden_size, cfg.intermediate_size, rngs)
        self.fc2 = linear(cfg.intermediate_size, cfg.hidden_size, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(self.fc1(x, activation=self.hidden_act))


class CLIPEncoderLayer(nnx.Module):
    def __init__(self, cfg: CLIPTextConfig, rngs: nnx.Rngs):
        eps = cfg.layer_norm_eps
        self.layer_norm1 = layer_norm(cfg.hidden_size, eps, rngs)
        self.self_attn = CLIPAttention(cfg, rngs)
        self.layer_norm2 = layer_norm(cfg.hidden_size, eps, rngs)
        self.mlp = CLIPMLP(cfg, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEmbeddings(nnx.Module):
    def __init__(self, cfg: CLIPTextConfig, rngs: nnx.Rngs):
        self.token_embedding = embed(cfg.vocab_size, cfg.hidden_size, rngs)
        self.position_embedding = embed(cfg.max_position_embeddings, cfg.hidden_size, rngs)

    def __call__(self, ids: jax.Array) -> jax.Array:
        # A direct lookup: `nnx.Embed` fixes its compute dtype when it is built (f32, before the
        # weights are loaded in bf16), which would run the whole encoder in f32.
        tokens = jnp.take(self.token_embedding.embedding[...], ids, axis=0)  # [batch, tokens, hidden]
        positions = self.position_embedding.embedding[: ids.shape[1]]  # [tokens, hidden]
        return tokens + positions[None]


class CLIPEncoder(nnx.Module):
    def __init__(self, cfg: CLIPTextConfig, rngs: nnx.Rngs):
        self.layers = nnx.List([CLIPEncoderLayer(cfg, rngs) for _ in range(cfg.num_hidden_layers)])


class CLIPTextTransformer(nnx.Module):
    def __init__(self, cfg: CLIPTextConfig, rngs: nnx.Rngs):
        self.embeddings = CLIPEmbeddings(cfg, rngs)
        self.encoder = CLIPEncoder(cfg, rngs)
        self.final_layer_norm = layer_norm(cfg.hidden_size, cfg.layer_norm_eps, rngs)


class TextOutput(NamedTuple):
    last_hidden_state: jax.Array  # [batch, tokens, hidden], after final_layer_norm
    pooled: jax.Array  # [batch, hidden] at the end-of-text token (projected when the model has a projection)
    hidden_states: tuple[jax.Array, ...]  # embeddings, then the output of each layer (no final norm)


class CLIPTextModel(nnx.Module):
    """`CLIPTextModel`, or `CLIPTextModelWithProjection` when `with_projection` (SDXL's second encoder)."""

    def __init__(self, cfg: CLIPTextConfig, rngs: nnx.Rngs, with_projection: bool = False):
        self.config = cfg
        self.text_model = CLIPTextTransformer(cfg, rngs)
        self.text_projection = (
            linear(cfg.hidden_size, cfg.projection_dim, rngs, bias=False) if with_projection else None
        )

    def __call__(self, input_ids: jax.Array) -> TextOutput:
        tm = self.text_model
        x = tm.embeddings(input_ids)
        hidden_states = [x]
        for layer in tm.encoder.layers:
            x = layer(x)
            hidden_states.append(x)
        last = tm.final_layer_norm(x)
        # transformers: the pooled token is the first end-of-text id, or (legacy configs whose
        # eos_token_id is 2) the largest id, which is end-of-text in CLIP's vocabulary. Ids past the vocabulary
        # are an embedding's rows appended to the table (textual inversion), not end-of-text: A1111 pools there too.
        if self.config.eos_token_id == 2:
            eos = jnp.argmax(jnp.where(input_ids < self.config.vocab_size, input_ids, -1), axis=-1)
        else:
            eos = jnp.argmax(input_ids == self.config.eos_token_id, axis=-1)
        pooled = last[jnp.arange(last.shape[0]), eos]
        if self.text_projection is not None:
            pooled = self.text_projection(pooled)
        return TextOutput(last, pooled, tuple(hidden_states))
