"""Image-to-image and inpainting: the picture and mask a request brings, on the host and in the programs.

Mirrors diffusers' `StableDiffusionImg2ImgPipeline`, `StableDiffusionXLImg2ImgPipeline` and
`StableDiffusionInpaintPipeline`. The picture is resized to the request's size and scaled to [-1, 1]
(`VaeImageProcessor`), the mask is read as grey, resized the same way and binarised at 0.5 (white =
repaint). Inside `admit` the VAE encodes the picture to the mean of its latent Gaussian (diffusers draws a
sample; the mean keeps a picture a function of its seed alone) and the schedule, already cut at the step
that `strength` selects (`schedulers.tables`), says how much noise is mixed in. Inpainting keeps, per slot,
what the steps need: the mask at latent size and the masked picture's latents for a 9-channel UNet, or the
picture's latents and the noise for the 4-channel blend (`blend`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

# "latents": image to image from latents a request brings (hires fix's second pass after a latent upscaler), not
# from a picture the VAE encodes.
MODES = ("txt2img", "img2img", "inpaint", "latents")


def mode_of(image: Any, mask_image: Any, image_latents: Any = None) -> str:
    if image_latents is not None:
        return "latents"
    if image is None:
        return "txt2img"
    return "img2img" if mask_image is None else "inpaint"


def image_array(image: Image.Image, width: int, height: int) -> np.ndarray:
    """A picture at the request's size, [height, width, 3] f32 in [-1, 1] (diffusers' `preprocess`)."""
    image = image.convert("RGB")
    if image.size != (width, height):
        image = image.resize((width, height), resample=Image.LANCZOS)
    return np.asarray(image, np.float32) / 255.0 * 2.0 - 1.0


def mask_array(mask: Image.Image, width: int, height: int) -> np.ndarray:
    """A mask at the request's size, [height, width, 1] f32 of 0 (keep) and 1 (repaint)."""
    mask = mask.convert("L")
    if mask.size != (width, height):
        mask = mask.resize((width, height), resample=Image.LANCZOS)
    return (np.asarray(mask, np.float32)[..., None] / 255.0 >= 0.5).astype(np.float32)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Source:
    """A request's picture inputs in an `Admission`, one row per slot: image [batch, H, W, 3] in [-1, 1] and
    mask [batch, H, W, 1] (all ones for image-to-image); in the "latents" mode, image holds the scaled latents
    [batch, h, w, c] themselves and mask [batch, h, w, 1] ones."""

    image: jax.Array
    mask: jax.Array
    # [batch, 2]: what the repainted part of the start latents is made of, (the picture's share, the noise's): (1, 0)
    # the picture (A1111's "original"), (0, 1) latent noise, (0, 0) latent nothing
    start: jax.Array


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Inpainting:
    """What an inpainting slot keeps between steps, latents at latent size."""

    mask: jax.Array  # [batch, h, w, 1]: 1 where the picture is repainted
    masked: jax.Array  # [batch, h, w, c]: latents of the picture with the repainted part grey (9-channel UNet)
    image: jax.Array  # [batch, h, w, c]: latents of the picture (4-channel blend)
    noise: jax.Array  # [batch, h, w, c]: the slot's noise, mixed into `image` at each step's level


# A1111's inpainting_fill -> the start latents' (picture, noise) shares where the mask repaints; 0 (fill) is done to
# the picture before (sampling/inpaint.py) and then starts from it, as 1 does.
LATENT_STARTS = {0: (1.0, 0.0), 1: (1.0, 0.0), 2: (0.0, 1.0), 3: (0.0, 0.0)}


def source_row(
    image: Image.Image | None, mask: Image.Image | None, width: int, height: int, fill: int = 1
) -> dict[str, np.ndarray]:
    """One slot's `Source` row on the host (zeros for an empty slot); `fill`: A1111's inpainting_fill."""
    pixels = np.zeros((height, width, 3), np.float32) if image is None else image_array(image, width, height)
    holes = np.ones((height, width, 1), np.float32) if mask is None else mask_array(mask, width, height)
    return dict(image=pixels, mask=holes, start=np.asarray(LATENT_STARTS[int(fill)], np.float32))


def latent_row(latents: np.ndarray | None, shape: tuple[int, int, int]) -> dict[str, np.ndarray]:
    """One slot's `Source` row in the "latents" mode: [h, w, c] scaled latents (zeros for an empty slot)."""
    image = np.zeros(shape, np.float32) if latents is None else np.asarray(latents, np.float32)
    return dict(image=image, mask=np.ones((*shape[:2], 1), np.float32), start=np.asarray((1.0, 0.0), np.float32))


def start(
    encode: Callable[[jax.Array], jax.Array], source: Source, noise: jax.Array, tables, mode: str, inpainting: bool
) -> tuple[jax.Array, Any]:
    """The initial latents of image-mode slots and, for inpainting, what the steps keep.

    `add_noise(encode(image), noise, first timestep)`; inpainting at strength 1 starts from pure noise
    (tables.init_signal is then 0). `encode`: pictures in [-1, 1] -> the steps' latents (the family's
    `LatentFormat.encode` with the model's VAE); `inpainting`: the denoiser is an inpainting one.
    """
    image = source.image if mode == "latents" else encode(source.image)  # [batch, h, w, c]
    signal, sigma = tables.init_signal[:, None, None, None], tables.init_noise_sigma[:, None, None, None]
    if mode != "inpaint":
        return signal * image + sigma * noise, None
    factor = source.image.shape[1] // image.shape[1]
    mask = source.mask[:, ::factor, ::factor]  # nearest, as torch's `interpolate` to the latent size
    keep, noisy = (source.start[:, k, None, None, None] for k in (0, 1))  # A1111's latent noise / nothing
    x = signal * ((1 - mask) * image + mask * (keep * image + noisy * noise)) + sigma * noise
    masked = encode(source.image * (source.mask < 0.5)) if inpainting else jnp.zeros_like(image)
    return x, Inpainting(mask=mask, masked=masked, image=image, noise=noise)


def unet_input(model_in: jax.Array, kept: Inpainting | None, inpainting: bool, pairs: int) -> jax.Array:
    """An inpainting UNet (9 channels) reads [latents, mask, masked-image latents] (the guidance pair repeats the
    two)."""
    if kept is None or not inpainting:
        return model_in
    extra = jnp.concatenate([kept.mask, kept.masked], axis=-1)
    return jnp.concatenate([model_in, jnp.repeat(extra, pairs, axis=0)], axis=-1)


def blend(x: jax.Array, kept: Inpainting | None, tables, i: jax.Array, inpainting: bool) -> jax.Array:
    """Inpainting with a text-to-image denoiser: after step i, the kept part is the picture noised to the next
    step's level."""
    if kept is None or inpainting:
        return x
    at = lambda table: jax.vmap(lambda row, j: row[j])(table, i)[:, None, None, None]  # noqa: E731
    known = at(tables.blend_signal) * kept.image + at(tables.blend_noise) * kept.noise
    return (1 - kept.mask) * known + kept.mask * x
