"""FLUX.2's image autoencoder, mirroring diffusers' `AutoencoderKLFlux2`, and the latent space its pipelines use.

The networks are `AutoencoderKL`'s (`vae.py`) with 32 latent channels and, optionally, decoder widths of their own
(`decoder_block_out_channels`). What differs is the space the transformer works in: Flux2KleinPipeline patchifies
the VAE's latents 2x2 ([h/8, w/8, 32] -> [h/16, w/16, 128], `_patchify_latents`) and normalises each of the 128
channels by the statistics of a batch norm the VAE carries (`bn.running_mean`, `bn.running_var`, `batch_norm_eps`):
(x - mean) / sqrt(var + eps) after encoding, x * sqrt(var + eps) + mean before decoding. No scaling or shift
factor. The functions below are those steps; `encode_latents` and `decode_latents` chain them with the VAE.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from ..nn.layers import _inits
from .config import VAEConfig, _require
from .transformer_flux import pack, unpack
from .vae import AutoencoderKL

PATCH = 2  # the pipeline's `_patchify_latents` takes 2x2 patches, whatever the config says


@dataclasses.dataclass(frozen=True)
class Flux2VAEConfig(VAEConfig):
    """`AutoencoderKLFlux2` config (vae/config.json): `AutoencoderKL`'s keys plus the batch norm's and the patch's."""

    latent_channels: int = 32
    decoder_block_out_channels: tuple[int, ...] | None = None  # None: block_out_channels
    batch_norm_eps: float = 1e-4
    batch_norm_momentum: float = 0.1  # training only
    patch_size: tuple[int, ...] = (2, 2)

    @property
    def decoder_channels(self) -> tuple[int, ...]:
        return self.decoder_block_out_channels or self.block_out_channels

    @property
    def patched_channels(self) -> int:
        """Channels of the transformer's latent grid: a 2x2 patch of latents (128 for FLUX.2)."""
        return PATCH * PATCH * self.latent_channels

    def validate(self, where: str) -> None:
        super().validate(where)
        _require(
            tuple(self.patch_size) == (PATCH, PATCH),
            where,
            f"patch_size {self.patch_size} is not supported: the pipeline patchifies 2x2",
        )
        _require(
            len(self.decoder_channels) == len(self.block_out_channels),
            where,
            "decoder_block_out_channels must name as many blocks as block_out_channels",
        )


def patchify(latents: jax.Array) -> jax.Array:
    """`_patchify_latents`, NHWC: [batch, h, w, c] -> [batch, h/2, w/2, 4c], features (c, ph, pw)."""
    b, h, w, c = latents.shape
    return pack(latents).reshape(b, h // PATCH, w // PATCH, c * PATCH * PATCH)


def unpatchify(grid: jax.Array) -> jax.Array:
    """`_unpatchify_latents`, NHWC: [batch, h/2, w/2, 4c] -> [batch, h, w, c]."""
    b, rows, cols, features = grid.shape
    return unpack(grid.reshape(b, rows * cols, features), rows * PATCH, cols * PATCH)


def _std(var: jax.Array, eps: float) -> jax.Array:
    return jnp.sqrt(var.astype(jnp.float32) + eps)


def normalize(grid: jax.Array, mean: jax.Array, var: jax.Array, eps: float) -> jax.Array:
    """The pipeline's `_encode_vae_image` after patchifying: (x - running_mean) / sqrt(running_var + eps), in f32."""
    return (grid.astype(jnp.float32) - mean.astype(jnp.float32)) / _std(var, eps)


def denormalize(grid: jax.Array, mean: jax.Array, var: jax.Array, eps: float) -> jax.Array:
    """`normalize`'s inverse, as the pipeline applies it to the final latents before unpatchifying: x * std + mean."""
    return grid.astype(jnp.float32) * _std(var, eps) + mean.astype(jnp.float32)


class LatentBatchNorm(nnx.Module):
    """`bn`: `BatchNorm2d(affine=False)` over the patchified channels; only its running statistics are used.

    The checkpoint's `bn.num_batches_tracked` counts training batches and is not read (loading.weights' IGNORED).
    """

    def __init__(self, features: int):
        zeros = _inits("init").get("init", lambda key, shape: jnp.zeros(shape, jnp.float32))
        ones = _inits("init").get("init", lambda key, shape: jnp.ones(shape, jnp.float32))
        self.running_mean = nnx.Param(zeros(None, (features,)))
        self.running_var = nnx.Param(ones(None, (features,)))


class AutoencoderKLFlux2(AutoencoderKL):
    """`AutoencoderKL`'s encoder, decoder and quant convs (its `encode` and `decode` too) plus the latent batch
    norm's statistics."""

    def __init__(self, cfg: Flux2VAEConfig, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        self.bn = LatentBatchNorm(cfg.patched_channels)

    def normalize(self, grid: jax.Array) -> jax.Array:
        return normalize(grid, self.bn.running_mean[...], self.bn.running_var[...], self.config.batch_norm_eps)

    def denormalize(self, grid: jax.Array) -> jax.Array:
        return denormalize(grid, self.bn.running_mean[...], self.bn.running_var[...], self.config.batch_norm_eps)

    def encode_latents(self, images: jax.Array) -> jax.Array:
        """images [batch, h, w, 3] in [-1, 1] -> the transformer's grid [batch, h/16, w/16, 128], f32.

        The pipeline's `_encode_vae_image`: the posterior's mode (its mean, `sample_mode="argmax"`), patchified,
        normalised. What a reference picture becomes before its tokens join the latent's.
        """
        mean, _ = self.encode(images)
        return self.normalize(patchify(mean))

    def decode_latents(self, grid: jax.Array) -> jax.Array:
        """The transformer's grid [batch, h/16, w/16, 128] -> images [batch, h, w, 3] in about [-1, 1], f32.

        The end of Flux2KleinPipeline's `__call__`: denormalised, unpatchified, decoded.
        """
        return self.decode(unpatchify(self.denormalize(grid)))
