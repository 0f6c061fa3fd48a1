"""FLUX.1 Kontext [dev]: FLUX.1 dev that edits a picture from an instruction (`FluxKontextPipeline`).

Everything but the reference picture is FLUX.1 dev's (`flux.py`): CLIP's pooled vector and T5's states, the 16-channel
VAE, the flow schedule shifted by the output's token count, the guidance scale embedded (28 steps at 3.5, the
pipeline's defaults). A request brings exactly one reference picture (`GenerationRequest.references`). On the host it
is resized by Lanczos to the preferred resolution nearest its aspect (`PREFERRED_RESOLUTIONS`, the pipeline's
`PREFERRED_KONTEXT_RESOLUTIONS` with `_auto_resize`: about a megapixel whatever the picture's size), its sides multiples
of one token's pixels (`engine.request_references.reference_size`); in `admit` the VAE encodes it as the pipeline's
`_encode_vae_image` (the posterior's mean, shifted and scaled), and at each step the transformer reads its 2x2 patches
as tokens after the latents', with ids (1, row, col), and predicts the latents' velocity alone
(`FluxTransformer2DModel(references=)`). A request that gives no size draws at the resized reference's size.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from PIL import Image

from ..models.transformer_flux import TIME_FACTOR
from . import flux
from .base import Conditioning, Models, References, text_to_image

# FluxKontextPipeline's PREFERRED_KONTEXT_RESOLUTIONS, (width, height): the sizes Kontext was trained on
PREFERRED_RESOLUTIONS = (
    (672, 1568),
    (688, 1504),
    (720, 1456),
    (752, 1392),
    (800, 1328),
    (832, 1248),
    (880, 1184),
    (944, 1104),
    (1024, 1024),
    (1104, 944),
    (1184, 880),
    (1248, 832),
    (1328, 800),
    (1392, 752),
    (1456, 720),
    (1504, 688),
    (1568, 672),
)


def denoise(models: Models, x: jax.Array, timesteps: jax.Array, kv, cond: Conditioning, residuals: tuple):
    """FLUX.1's velocity with the reference picture's latents (`Conditioning.references`, one grid) beside the
    latents', fed as FluxKontextPipeline feeds the transformer."""
    transformer = models.transformer
    guidance = cond.timestep_cond if transformer.config.guidance_embeds else None
    references = cond.references[0] if cond.references else None
    return transformer(x, timesteps / TIME_FACTOR, kv, cond.text_embeds, guidance, references=references)


def prepare_reference(picture: Image.Image, width: int, height: int) -> np.ndarray:
    """The reference picture as FluxKontextPipeline encodes it, [height, width, 3] float32 in [-1, 1]: resized by
    Lanczos to width x height (`VaeImageProcessor.resize`; the size `engine.request_references.reference_size` gives), in RGB."""
    picture = picture.convert("RGB").resize((width, height), Image.Resampling.LANCZOS)
    return np.asarray(picture, np.float32) / 255.0 * 2.0 - 1.0


PIPELINES = ("FluxKontextPipeline",)
FAMILY = dataclasses.replace(
    flux.FAMILY,
    name="flux_kontext",
    pipelines=PIPELINES,
    denoiser=dataclasses.replace(
        flux.FAMILY.denoiser,
        denoise=denoise,
        # exactly one picture, drawn at the preferred resolution nearest its aspect
        references=References(1, prepare_reference, min_count=1, resolutions=PREFERRED_RESOLUTIONS),
    ),
)

VARIANTS = (text_to_image(FAMILY, "FLUX.1 Kontext", PIPELINES, strength=0.6, inpaint=0.6),)
