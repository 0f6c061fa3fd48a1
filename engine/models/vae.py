"""The image autoencoder, mirroring diffusers' `AutoencoderKL` (encoder, decoder, quant convs).

Images are NHWC in [-1, 1]; latents are NHWC with `latent_channels`. The pipeline scales
latents by `scaling_factor` (0.18215 for SD 1.x/2.x, 0.13025 for SDXL) on the way in and out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..nn.layers import Attention, Downsample2D, ResnetBlock2D, Upsample2D, conv, group_norm
from .config import VAEConfig

VAE_EPS = 1e-6  # diffusers builds every VAE norm with this epsilon


class VAEAttention(Attention):
    """The mid-block's single-head self-attention over all pixels, with its own GroupNorm."""

    def __init__(self, ch: int, groups: int, rngs: nnx.Rngs):
        super().__init__(ch, 1, ch, rngs, bias=True)
        self.group_norm = group_norm(ch, groups, VAE_EPS, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, h, w, c = x.shape
        y = self.group_norm(x).reshape(b, h * w, c)  # [batch, pixels, channels]
        return x + super().__call__(y).reshape(b, h, w, c)


class MidBlock(nnx.Module):
    """`UNetMidBlock2D`: resnet, attention, resnet; no time embedding."""

    def __init__(self, ch: int, groups: int, add_attention: bool, rngs: nnx.Rngs):
        self.resnets = nnx.List([ResnetBlock2D(ch, ch, None, groups, VAE_EPS, rngs) for _ in range(2)])
        self.attentions = nnx.List([VAEAttention(ch, groups, rngs)]) if add_attention else None

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.resnets[0](x)
        if self.attentions is not None:
            x = self.attentions[0](x)
        return self.resnets[1](x)


class EncoderBlock(nnx.Module):
    """`DownEncoderBlock2D`."""

    def __init__(self, in_ch: int, out_ch: int, layers: int, groups: int, downsample: bool, rngs: nnx.Rngs):
        self.resnets = nnx.List(
            [ResnetBlock2D(in_ch if j == 0 else out_ch, out_ch, None, groups, VAE_EPS, rngs) for j in range(layers)]
        )
        self.downsamplers = nnx.List([Downsample2D(out_ch, 0, rngs)]) if downsample else None

    def __call__(self, x: jax.Array) -> jax.Array:
        for resnet in self.resnets:
            x = resnet(x)
        return self.downsamplers[0](x) if self.downsamplers is not None else x


class DecoderBlock(nnx.Module):
    """`UpDecoderBlock2D`."""

    def __init__(self, in_ch: int, out_ch: int, layers: int, groups: int, upsample: bool, rngs: nnx.Rngs):
        self.resnets = nnx.List(
            [ResnetBlock2D(in_ch if j == 0 else out_ch, out_ch, None, groups, VAE_EPS, rngs) for j in range(layers)]
        )
        self.upsamplers = nnx.List([Upsample2D(out_ch, rngs)]) if upsample else None

    def __call__(self, x: jax.Array) -> jax.Array:
        for resnet in self.resnets:
            x = resnet(x)
        return self.upsamplers[0](x) if self.upsamplers is not None else x


class Encoder(nnx.Module):
    def __init__(self, cfg: VAEConfig, rngs: nnx.Rngs):
        ch, groups, n = cfg.block_out_channels, cfg.norm_num_groups, len(cfg.block_out_channels)
        self.conv_in = conv(cfg.in_channels, ch[0], 3, rngs)
        self.down_blocks = nnx.List(
            [EncoderBlock(ch[max(i - 1, 0)], ch[i], cfg.layers_per_block, groups, i < n - 1, rngs) for i in range(n)]
        )
        self.mid_block = MidBlock(ch[-1], groups, cfg.mid_block_add_attention, rngs)
        self.conv_norm_out = group_norm(ch[-1], groups, VAE_EPS, rngs)
        self.conv_out = conv(ch[-1], 2 * cfg.latent_channels, 3, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        return self.conv_out(self.conv_norm_out(x, silu=True))


class Decoder(nnx.Module):
    def __init__(self, cfg: VAEConfig, rngs: nnx.Rngs):
        ch, groups, n = tuple(reversed(cfg.decoder_channels)), cfg.norm_num_groups, len(cfg.decoder_channels)
        self.conv_in = conv(cfg.latent_channels, ch[0], 3, rngs)
        self.mid_block = MidBlock(ch[0], groups, cfg.mid_block_add_attention, rngs)
        self.up_blocks = nnx.List(
            [
                DecoderBlock(ch[max(i - 1, 0)], ch[i], cfg.layers_per_block + 1, groups, i < n - 1, rngs)
                for i in range(n)
            ]
        )
        self.conv_norm_out = group_norm(ch[-1], groups, VAE_EPS, rngs)
        self.conv_out = conv(ch[-1], cfg.out_channels, 3, rngs)

    def __call__(self, z: jax.Array) -> jax.Array:
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(self.conv_norm_out(x, silu=True))


class AutoencoderKL(nnx.Module):
    def __init__(self, cfg: VAEConfig, rngs: nnx.Rngs):
        self.config = cfg
        lat = cfg.latent_channels
        self.encoder = Encoder(cfg, rngs)
        self.decoder = Decoder(cfg, rngs)
        self.quant_conv = conv(2 * lat, 2 * lat, 1, rngs) if cfg.use_quant_conv else None
        self.post_quant_conv = conv(lat, lat, 1, rngs) if cfg.use_post_quant_conv else None

    def encode(self, images: jax.Array) -> tuple[jax.Array, jax.Array]:
        """images [batch, h, w, 3] in [-1, 1] -> (mean, logvar) of the latent Gaussian, unscaled."""
        moments = self.encoder(images.astype(self.encoder.conv_in.kernel.dtype))
        if self.quant_conv is not None:
            moments = self.quant_conv(moments)
        mean, logvar = jnp.split(moments.astype(jnp.float32), 2, axis=-1)
        return mean, jnp.clip(logvar, -30.0, 20.0)

    def decode(self, latents: jax.Array) -> jax.Array:
        """latents [batch, h/8, w/8, latent_channels], unscaled -> images [batch, h, w, 3] in about [-1, 1]."""
        z = latents.astype(self.decoder.conv_in.kernel.dtype)
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z).astype(jnp.float32)
