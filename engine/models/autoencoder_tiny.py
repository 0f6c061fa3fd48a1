"""The tiny autoencoder TAESD, mirroring diffusers' `AutoencoderTiny` (`EncoderTiny`, `DecoderTiny`).

Plain 3x3 convolutions and `AutoencoderTinyBlock` residuals, no attention (no norms but TAEF2's); each side's layers
are one list (`encoder.layers.N`, `decoder.layers.N`, as diffusers' `nn.Sequential`), parameterless
entries (activations, upsamplings) holding their places so the indices match the checkpoint's.
Same contract as `AutoencoderKL`: images NHWC in [-1, 1], latents NHWC, unscaled by `scaling_factor`.

TAEF2 (FLUX.2's, madebyollin/taesd's taesd.py `use_midblock_gn`, which diffusers' `AutoencoderTiny` cannot
express) adds one branch to each block at the latents' resolution (the encoder's last stage, the decoder's
first): `x + pool(x)` before the block, `pool` a 1x1 conv to 4x the width, GroupNorm of 4 groups, ReLU, a 1x1
conv back, both convs without bias (keys `pool.0`, `pool.1`, `pool.3`). The group norm's statistics span the
whole picture, which TAEF2 needed to match FLUX.2's VAE; our config's `use_midblock_gn` switches it on.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from ..errors import InvalidRequest
from ..nn.layers import Conv, _inits, conv, group_norm
from .config import AutoencoderTinyConfig

ACTIVATIONS = {  # diffusers' `get_activation`, by the names `TINY_VAE_ACTIVATIONS` allows
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": partial(jax.nn.gelu, approximate=False),
    "mish": lambda x: x * jnp.tanh(jax.nn.softplus(x)),
}
# The clipped log-variance (AutoencoderKL's floor) standing for a deterministic encoder's zero variance.
ZERO_VARIANCE_LOGVAR = -30.0


def conv_no_bias(in_ch: int, out_ch: int, rngs: nnx.Rngs, stride: int = 1) -> Conv:
    """A 3x3 convolution, padding 1, without bias: the encoder's downsamplings, the decoder's inner convs."""
    s = (stride, stride)
    return Conv(
        in_ch, out_ch, (3, 3), strides=s, padding=((1, 1), (1, 1)), use_bias=False, rngs=rngs, **_inits("kernel_init")
    )


class Activation(nnx.Module):
    """A parameterless activation: holds its index in a diffusers `nn.Sequential`."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, x: jax.Array) -> jax.Array:
        return ACTIVATIONS[self.name](x)


class Upsample(nnx.Module):
    """`nn.Upsample(scale_factor, mode="nearest")` with a whole factor: each pixel repeated."""

    def __init__(self, factor: int):
        self.factor = factor

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.repeat(jnp.repeat(x, self.factor, axis=1), self.factor, axis=2)


MIDBLOCK_GROUPS = 4  # the TAEF2 branch's GroupNorm: 4 groups over 4x the block's width, torch's eps
MIDBLOCK_EPS = 1e-5


def conv1x1(in_ch: int, out_ch: int, rngs: nnx.Rngs) -> Conv:
    return Conv(in_ch, out_ch, (1, 1), padding="VALID", use_bias=False, rngs=rngs, **_inits("kernel_init"))


class AutoencoderTinyBlock(nnx.Module):
    """conv-act-conv-act-conv plus the input, then ReLU (whatever `act_fn`); widths in and out are equal. With
    `midblock_gn` (TAEF2), the input is first `x + pool(x)` (the module docstring)."""

    def __init__(self, ch: int, act_fn: str, rngs: nnx.Rngs, midblock_gn: bool = False):
        if midblock_gn:
            wide = MIDBLOCK_GROUPS * ch
            norm = group_norm(wide, MIDBLOCK_GROUPS, MIDBLOCK_EPS, rngs)
            self.pool = nnx.List([conv1x1(ch, wide, rngs), norm, Activation("relu"), conv1x1(wide, ch, rngs)])
        else:
            self.pool = None
        self.conv = nnx.List(
            [
                conv(ch, ch, 3, rngs),
                Activation(act_fn),
                conv(ch, ch, 3, rngs),
                Activation(act_fn),
                conv(ch, ch, 3, rngs),
            ]
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.pool is not None:
            x = x + _run(self.pool, x)
        h = _run(self.conv[:-1], x)
        return self.conv[-1](h, add=x, relu=True)  # relu(conv(h) + x), in the convolution on the bf16 CPU path


def _run(layers, x: jax.Array) -> jax.Array:
    """The layers in turn; a convolution followed by a ReLU takes it as its own (`Conv(relu=True)`), a 2x upsampling
    followed by a convolution runs as one (`Conv.upsampled`)."""
    i = 0
    while i < len(layers):
        layer, after = layers[i], layers[i + 1] if i + 1 < len(layers) else None
        if isinstance(layer, Upsample) and layer.factor == 2 and isinstance(after, Conv):
            x = after.upsampled(x)
            i += 2
            continue
        fused = isinstance(layer, Conv) and isinstance(after, Activation) and after.name == "relu"
        x = layer(x, relu=True) if fused else layer(x)
        i += 2 if fused else 1
    return x


class EncoderTiny(nnx.Module):
    """[0, 1] images -> latents: per stage a conv (stride 2 after the first) and its blocks, then a conv out."""

    def __init__(self, cfg: AutoencoderTinyConfig, rngs: nnx.Rngs):
        ch, act = cfg.encoder_block_out_channels[0], cfg.act_fn
        layers = []
        last = len(cfg.num_encoder_blocks) - 1
        for i, count in enumerate(cfg.num_encoder_blocks):
            layers.append(conv(cfg.in_channels, ch, 3, rngs) if i == 0 else conv_no_bias(ch, ch, rngs, stride=2))
            gn = cfg.use_midblock_gn and i == last  # the stage at the latents' resolution
            layers.extend(AutoencoderTinyBlock(ch, act, rngs, gn) for _ in range(count))
        layers.append(conv(ch, cfg.latent_channels, 3, rngs))
        self.layers = nnx.List(layers)

    def __call__(self, x: jax.Array) -> jax.Array:
        return _run(self.layers, x)


class DecoderTiny(nnx.Module):
    """Latents -> [0, 1] images: a conv in, per stage its blocks, an upsampling and a conv; the last conv out."""

    def __init__(self, cfg: AutoencoderTinyConfig, rngs: nnx.Rngs):
        ch, act, last = cfg.decoder_block_out_channels[0], cfg.act_fn, len(cfg.num_decoder_blocks) - 1
        layers = [conv(cfg.latent_channels, ch, 3, rngs), Activation(act)]
        for i, count in enumerate(cfg.num_decoder_blocks):
            gn = cfg.use_midblock_gn and i == 0  # the stage at the latents' resolution
            layers.extend(AutoencoderTinyBlock(ch, act, rngs, gn) for _ in range(count))
            if i < last:
                layers += [Upsample(cfg.upsampling_scaling_factor), conv_no_bias(ch, ch, rngs)]
            else:
                layers.append(conv(ch, cfg.out_channels, 3, rngs))
        self.layers = nnx.List(layers)

    def __call__(self, x: jax.Array) -> jax.Array:
        return _run(self.layers, x)


class AutoencoderTiny(nnx.Module):
    """`encoder=False`: a decoder alone (taesd.py's `taesd_decoder` file without its encoder), which draws pictures
    but reads none; `encode` refuses by name."""

    def __init__(self, cfg: AutoencoderTinyConfig, rngs: nnx.Rngs, encoder: bool = True):
        self.config = cfg
        self.encoder = EncoderTiny(cfg, rngs) if encoder else None
        self.decoder = DecoderTiny(cfg, rngs)

    def _dtype(self):
        return self.decoder.layers[0].kernel.dtype

    def encode(self, images: jax.Array) -> tuple[jax.Array, jax.Array]:
        """images [batch, h, w, 3] in [-1, 1] -> (latents, logvar) in f32, latents [batch, h/8, w/8, latent_channels].

        As `AutoencoderKL.encode`'s (mean, logvar), unscaled: the encoder is deterministic, so the latents are
        the mean and the logvar is the clipped floor everywhere (callers take the mean).
        """
        if self.encoder is None:
            raise InvalidRequest("this tiny VAE is a decoder alone: it draws pictures but cannot read one")
        x = ((images.astype(jnp.float32) + 1) / 2).astype(self._dtype())  # TAESD reads [0, 1]
        latents = self.encoder(x).astype(jnp.float32)
        return latents, jnp.full_like(latents, ZERO_VARIANCE_LOGVAR)

    def decode(self, latents: jax.Array) -> jax.Array:
        """latents [batch, h/8, w/8, latent_channels], unscaled -> images [batch, h, w, 3] in about [-1, 1], f32."""
        z = jnp.tanh(latents.astype(jnp.float32) / 3) * 3  # TAESD's soft clamp to (-3, 3)
        x = self.decoder(z.astype(self._dtype())).astype(jnp.float32)
        return x * 2 - 1  # [0, 1] -> [-1, 1]
