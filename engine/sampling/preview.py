"""Live previews: a linear map from latents to RGB, fitted to the model's VAE when it loads; or, with a tiny
autoencoder (TAESD), the VAE's own pictures.

Decoding with a KL VAE every few steps would cost about as much as the steps themselves; a 4x3 matrix
and a bias (the "latent RGB factors" community UIs ship per model family) costs nothing. We fit the
factors instead of shipping them, so that any model, including one trained here, gets previews: decode
a few smooth random latents once, average the pictures down to latent resolution, and solve least
squares for `rgb ~= latents @ weight + bias`.

A tiny autoencoder decodes a picture in a small fraction of a step (about 0.3 s at 512x512 on two CPU
cores, against 14 s for SD's KL VAE), so with one (`load_pipeline(vae="madebyollin/taesd")`) a preview is a
real picture, as ComfyUI and AUTOMATIC1111 draw them with TAESD: the batch's own compiled decode program
over the slots' current latents (`DecodedPreview`; the batcher runs it), nothing fitted, nothing new compiled.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from flax import nnx

from .pipeline import Plan, decode

FIT_LATENT_SIDE = 16  # latents decoded for the fit: small enough to cost well under a second
FIT_IMAGES = 4


@dataclass(frozen=True)
class PreviewMap:
    weight: np.ndarray  # [latent_channels, 3]
    bias: np.ndarray  # [3]
    fit_error: float  # RMS error of the fit on its own samples, in 0..1 units

    def __call__(self, latents: np.ndarray) -> np.ndarray:
        """latents [..., h, w, c] as the denoising loop holds them -> uint8 RGB [..., h, w, 3]."""
        rgb = np.asarray(latents, np.float32) @ self.weight + self.bias
        return np.round(np.clip(rgb, 0.0, 1.0) * 255).astype(np.uint8)


@dataclass(frozen=True)
class DecodedPreview:
    """Previews drawn by the VAE itself: the batcher runs the batch's decode program (the one that draws the
    finished pictures, safety checker included) over the slots' current latents, and this turns its output
    into what a `Preview` carries."""

    def __call__(self, images: np.ndarray) -> np.ndarray:
        """decoded pictures [..., H, W, 3] in [0, 1] -> uint8 RGB [..., H, W, 3], rounded as the results are."""
        return np.round(np.clip(np.asarray(images, np.float32), 0.0, 1.0) * 255).astype(np.uint8)


Previewer = PreviewMap | DecodedPreview  # what draws a request's live previews


def _smooth_latents(rng: np.random.Generator, n: int, side: int, channels: int) -> np.ndarray:
    # Coarse noise upsampled 4x: decoded pictures with regions of colour rather than per-pixel noise,
    # which is what a denoising latent looks like after the first few steps.
    coarse = rng.standard_normal((n, side // 4, side // 4, channels)).astype(np.float32)
    return coarse.repeat(4, axis=1).repeat(4, axis=2)


def fit_preview(graphdef: nnx.GraphDef, params: nnx.State, latent_channels: int, family: str) -> PreviewMap:
    """Decodes FIT_IMAGES smooth random latents with the VAE and fits the linear map to the results."""
    side = FIT_LATENT_SIDE
    x = _smooth_latents(np.random.default_rng(0), FIT_IMAGES, side, latent_channels)
    plan = Plan(
        batch=FIT_IMAGES,
        latent_height=side,
        latent_width=side,
        scheduler="ddim",
        max_steps=1,
        guidance=False,
        family=family,
    )
    images = np.asarray(jax.jit(decode, static_argnums=(0, 1))(plan, graphdef, params, x))  # [n, H, W, 3]
    factor = images.shape[1] // side
    pooled = images.reshape(FIT_IMAGES, side, factor, side, factor, 3).mean(axis=(2, 4))  # [n, side, side, 3]
    features = np.concatenate([x.reshape(-1, latent_channels), np.ones((x.size // latent_channels, 1))], axis=1)
    target = pooled.reshape(-1, 3)
    solution, *_ = np.linalg.lstsq(features, target, rcond=None)
    fit_error = float(np.sqrt(np.mean((features @ solution - target) ** 2)))
    return PreviewMap(solution[:-1].astype(np.float32), solution[-1].astype(np.float32), fit_error)
