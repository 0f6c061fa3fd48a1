"""The super-resolution networks that people publish for upscaling: RRDBNet (ESRGAN, Real-ESRGAN) and SRVGGNetCompact
(Real-ESRGAN's compact `realesr-general-x4v3`), NHWC, pictures in [0, 1].

RRDBNet (Wang et al. 2018, "ESRGAN", Fig. 4): a 3x3 conv, a trunk of residual-in-residual dense blocks (three
five-conv dense blocks, each conv reading every earlier output, LeakyReLU 0.2; each dense block's output scaled by
0.2 and added to its input, and the three together scaled by 0.2 and added again), a conv, the trunk's input added;
then per 2x a nearest upsampling and a conv with LeakyReLU, a conv with LeakyReLU and a last conv. Real-ESRGAN's
x2plus and x1 pixel-unshuffle the picture by 2 or 4 first (more channels in, the same x4 trunk).

SRVGGNetCompact (Wang et al. 2021, "Real-ESRGAN", its compact model): 3x3 convs each followed by a per-channel
PReLU, a last conv to `out * scale^2` channels, a pixel shuffle, plus the input upsampled by repetition.

Attribute paths are Real-ESRGAN's (basicsr's) keys: `conv_first`, `body.N.rdb1.conv1`, `conv_body`, `conv_up1`,
`conv_hr`, `conv_last`; `body.N` for the compact net. The community ("old ESRGAN") layout is renamed onto these
in `engine/loading/upscaler.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from ..nn.layers import _inits, conv

LEAKY_SLOPE = 0.2  # ESRGAN's LeakyReLU
RESIDUAL_SCALE = 0.2  # ESRGAN's residual scaling, in each dense block and each RRDB


@dataclass(frozen=True)
class RRDBNetConfig:
    in_channels: int = 3  # the picture's channels, before any unshuffle
    out_channels: int = 3
    num_features: int = 64  # the trunk's width (`num_feat`, spandrel's `num_filters`)
    num_blocks: int = 23  # RRDBs in the trunk: 23 for x4plus and the community models, 6 for anime_6B
    growth_channels: int = 32  # each dense conv's output (`num_grow_ch`, `gc`)
    num_upsamples: int = 2  # 2x nearest + conv stages: 2 for every x4 trunk, 1 for old-layout 2x models
    shuffle_factor: int = 1  # pixel unshuffle of the input: 2 for x2plus, 4 for x1 Real-ESRGAN models

    @property
    def scale(self) -> int:
        """Output pixels per input pixel along a side."""
        return 2**self.num_upsamples // self.shuffle_factor

    @property
    def receptive_radius(self) -> int:
        """Input pixels on each side that can reach an output pixel: one per 3x3 conv at the trunk's resolution
        (conv_first, 15 per RRDB, conv_body), under 2 for the convs after the upsamplings, times the unshuffle."""
        return (2 + 15 * self.num_blocks + 2) * self.shuffle_factor


@dataclass(frozen=True)
class SRVGGNetCompactConfig:
    in_channels: int = 3
    out_channels: int = 3
    num_features: int = 64  # `num_feat`
    num_convs: int = 32  # body convs between the first and the last (`num_conv`): 32 for realesr-general-x4v3
    upscale: int = 4

    @property
    def scale(self) -> int:
        return self.upscale

    @property
    def receptive_radius(self) -> int:
        return self.num_convs + 2


def pixel_unshuffle(x: jax.Array, r: int) -> jax.Array:
    """torch's `pixel_unshuffle`: [b, h*r, w*r, c] -> [b, h, w, c*r*r], channel c*r*r + i*r + j from pixel (i, j)."""
    b, h, w, c = x.shape
    x = x.reshape(b, h // r, r, w // r, r, c)  # [b, h, i, w, j, c]
    return x.transpose(0, 1, 3, 5, 2, 4).reshape(b, h // r, w // r, c * r * r)


def pixel_shuffle(x: jax.Array, r: int) -> jax.Array:
    """torch's `pixel_shuffle`, the inverse: [b, h, w, c*r*r] -> [b, h*r, w*r, c]."""
    b, h, w, crr = x.shape
    c = crr // (r * r)
    x = x.reshape(b, h, w, c, r, r)  # [b, h, w, c, i, j]
    return x.transpose(0, 1, 4, 2, 5, 3).reshape(b, h * r, w * r, c)


def repeat_pixels(x: jax.Array, r: int) -> jax.Array:
    """Nearest upsampling by a whole factor: each pixel repeated r x r times."""
    return jnp.repeat(jnp.repeat(x, r, axis=1), r, axis=2)


def leaky_relu(x: jax.Array) -> jax.Array:
    return jax.nn.leaky_relu(x, LEAKY_SLOPE)


class ResidualDenseBlock(nnx.Module):
    """Five 3x3 convs, each reading the block's input and every earlier output; the last scaled and added back."""

    def __init__(self, features: int, growth: int, rngs: nnx.Rngs):
        self.conv1 = conv(features, growth, 3, rngs)
        self.conv2 = conv(features + growth, growth, 3, rngs)
        self.conv3 = conv(features + 2 * growth, growth, 3, rngs)
        self.conv4 = conv(features + 3 * growth, growth, 3, rngs)
        self.conv5 = conv(features + 4 * growth, features, 3, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        seen = x
        for layer in (self.conv1, self.conv2, self.conv3, self.conv4):
            seen = jnp.concatenate([seen, leaky_relu(layer(seen))], axis=-1)  # [b, h, w, features + k * growth]
        return self.conv5(seen) * RESIDUAL_SCALE + x


class RRDB(nnx.Module):
    """Residual in residual: three dense blocks, their output scaled and added to the input."""

    def __init__(self, features: int, growth: int, rngs: nnx.Rngs):
        self.rdb1 = ResidualDenseBlock(features, growth, rngs)
        self.rdb2 = ResidualDenseBlock(features, growth, rngs)
        self.rdb3 = ResidualDenseBlock(features, growth, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.rdb3(self.rdb2(self.rdb1(x))) * RESIDUAL_SCALE + x


class RRDBNet(nnx.Module):
    def __init__(self, cfg: RRDBNetConfig, rngs: nnx.Rngs):
        self.config = cfg
        nf = cfg.num_features
        self.conv_first = conv(cfg.in_channels * cfg.shuffle_factor**2, nf, 3, rngs)
        self.body = nnx.List([RRDB(nf, cfg.growth_channels, rngs) for _ in range(cfg.num_blocks)])
        self.conv_body = conv(nf, nf, 3, rngs)
        for i in range(1, cfg.num_upsamples + 1):
            setattr(self, f"conv_up{i}", conv(nf, nf, 3, rngs))
        self.conv_hr = conv(nf, nf, 3, rngs)
        self.conv_last = conv(nf, cfg.out_channels, 3, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """[b, h, w, in] in [0, 1] -> [b, h * scale, w * scale, out], unclipped. With an unshuffle, h and w must be
        multiples of its factor (the caller pads)."""
        cfg = self.config
        if cfg.shuffle_factor > 1:
            x = pixel_unshuffle(x, cfg.shuffle_factor)
        feat = self.conv_first(x)
        trunk = feat
        for block in self.body:
            trunk = block(trunk)
        feat = feat + self.conv_body(trunk)
        for i in range(1, cfg.num_upsamples + 1):
            feat = leaky_relu(getattr(self, f"conv_up{i}")(repeat_pixels(feat, 2)))
        return self.conv_last(leaky_relu(self.conv_hr(feat)))


class PReLU(nnx.Module):
    """torch's `nn.PReLU(num_parameters=channels)`: max(x, 0) + weight * min(x, 0), one weight per channel."""

    def __init__(self, channels: int):
        init = _inits("weight").get("weight", lambda key, shape: jnp.full(shape, 0.25, jnp.float32))
        self.weight = nnx.Param(init(None, (channels,)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.where(x >= 0, x, self.weight[...] * x)


class SRVGGNetCompact(nnx.Module):
    def __init__(self, cfg: SRVGGNetCompactConfig, rngs: nnx.Rngs):
        self.config = cfg
        nf = cfg.num_features
        layers: list[nnx.Module] = [conv(cfg.in_channels, nf, 3, rngs), PReLU(nf)]
        for _ in range(cfg.num_convs):
            layers += [conv(nf, nf, 3, rngs), PReLU(nf)]
        layers.append(conv(nf, cfg.out_channels * cfg.upscale**2, 3, rngs))
        self.body = nnx.List(layers)

    def __call__(self, x: jax.Array) -> jax.Array:
        """[b, h, w, in] in [0, 1] -> [b, h * upscale, w * upscale, out], unclipped."""
        out = x
        for layer in self.body:
            out = layer(out)
        return pixel_shuffle(out, self.config.upscale) + repeat_pixels(x, self.config.upscale)
