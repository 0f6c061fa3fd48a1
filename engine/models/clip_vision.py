"""The CLIP vision tower, mirroring transformers' `CLIPVisionModel` (ViT; Radford et al. 2021).

Square patches embedded by a strided convolution, a learnt class token in front, learnt position
embeddings, `pre_layrnorm` (transformers' spelling), pre-LayerNorm encoder layers that attend
without a mask, and `post_layernorm` on the class token: the pooled output. The attribute paths are
transformers 4's (`vision_model.embeddings...` inside the model), which the published SD safety
checkers were saved with; weights.py renames the keys that transformers 5 writes without it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ..nn.layers import attention, embed, layer_norm
from .clip import CLIPMLP, CLIPAttention
from .config import CLIPVisionConfig


def bare_param(*shape: int) -> nnx.Param:
    """A tensor used as it is, named in the checkpoint by its attribute (`class_embedding`).

    Zeros until the weights replace them: these few are small, so the shape-only tree need not avoid them.
    """
    return nnx.Param(jnp.zeros(shape, jnp.float32))


class CLIPVisionAttention(CLIPAttention):
    """CLIP's attention with no causal mask: every patch sees every patch (and the class token)."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out_proj(attention(self.q_proj(x), self.k_proj(x), self.v_proj(x), self.heads))


class CLIPVisionEncoderLayer(nnx.Module):
    def __init__(self, cfg: CLIPVisionConfig, rngs: nnx.Rngs):
        eps = cfg.layer_norm_eps
        self.layer_norm1 = layer_norm(cfg.hidden_size, eps, rngs)
        self.self_attn = CLIPVisionAttention(cfg, rngs)
        self.layer_norm2 = layer_norm(cfg.hidden_size, eps, rngs)
        self.mlp = CLIPMLP(cfg, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPVisionEmbeddings(nnx.Module):
    def __init__(self, cfg: CLIPVisionConfig, rngs: nnx.Rngs):
        p = cfg.patch_size
        self.class_embedding = bare_param(cfg.hidden_size)
        # Bias-free, unlike every conv of the UNet and VAE; zero-initialised for the reason above.
        self.patch_embedding = nnx.Conv(
            cfg.num_channels,
            cfg.hidden_size,
            (p, p),
            strides=(p, p),
            padding="VALID",
            use_bias=False,
            kernel_init=nnx.initializers.zeros,
            rngs=rngs,
        )
        self.position_embedding = embed(cfg.num_positions, cfg.hidden_size, rngs)

    def __call__(self, pixels: jax.Array) -> jax.Array:
        patches = self.patch_embedding(pixels)  # [batch, H / patch, W / patch, hidden]
        b, h, w, d = patches.shape
        tokens = patches.reshape(b, h * w, d)  # row by row, as torch's flatten of NCHW
        cls = jnp.broadcast_to(self.class_embedding[...].astype(tokens.dtype), (b, 1, d))
        positions = self.position_embedding.embedding[...].astype(tokens.dtype)  # [1 + patches, hidden]
        return jnp.concatenate([cls, tokens], axis=1) + positions[None]


class CLIPVisionEncoder(nnx.Module):
    def __init__(self, cfg: CLIPVisionConfig, rngs: nnx.Rngs):
        self.layers = nnx.List([CLIPVisionEncoderLayer(cfg, rngs) for _ in range(cfg.num_hidden_layers)])


class CLIPVisionTransformer(nnx.Module):
    def __init__(self, cfg: CLIPVisionConfig, rngs: nnx.Rngs):
        self.embeddings = CLIPVisionEmbeddings(cfg, rngs)
        self.pre_layrnorm = layer_norm(cfg.hidden_size, cfg.layer_norm_eps, rngs)
        self.encoder = CLIPVisionEncoder(cfg, rngs)
        self.post_layernorm = layer_norm(cfg.hidden_size, cfg.layer_norm_eps, rngs)


class VisionOutput(NamedTuple):
    last_hidden_state: jax.Array  # [batch, 1 + patches, hidden], without post_layernorm
    pooled: jax.Array  # [batch, hidden]: the class token after post_layernorm


class CLIPVisionModel(nnx.Module):
    """`CLIPVisionModel`: pixel values [batch, image_size, image_size, 3] (normalised, NHWC) -> `VisionOutput`."""

    def __init__(self, cfg: CLIPVisionConfig, rngs: nnx.Rngs):
        self.config = cfg
        self.vision_model = CLIPVisionTransformer(cfg, rngs)

    def __call__(self, pixel_values: jax.Array) -> VisionOutput:
        vm = self.vision_model
        size = self.config.image_size
        if pixel_values.shape[1:] != (size, size, self.config.num_channels):
            raise ValueError(f"pixel_values {pixel_values.shape}: expected [batch, {size}, {size}, 3]")
        # In the params' dtype: the conv would otherwise promote bf16 weights to the f32 pixels' dtype.
        x = vm.embeddings(pixel_values.astype(vm.embeddings.patch_embedding.kernel.dtype))
        x = vm.pre_layrnorm(x)
        for layer in vm.encoder.layers:
            x = layer(x)
        return VisionOutput(x, vm.post_layernorm(x[:, 0]))
