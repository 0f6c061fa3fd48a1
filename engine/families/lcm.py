"""Latent consistency models: Stable Diffusion's networks distilled to sample in 1-8 steps with guidance built in.

Mirrors diffusers' `LatentConsistencyModelPipeline` and `LatentConsistencyModelImg2ImgPipeline` (Luo et al.
2023, LCM_Dreamshaper_v7 and the other LCM distillations of SD 1.x): the same text encoder, UNet and VAE as
`sd`, but the UNet was distilled from guided sampling, so guidance is an input, not a second batch row. Its
`time_embedding.cond_proj` reads `guidance_scale_embedding(guidance_scale - 1)` (`timestep_cond`, the
"Imagen" convention the pipelines use: 1 means no guidance) beside the timestep; no unconditional row is ever
computed and the negative prompt is not read, as the pipelines do. The LCM scheduler is the default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from ..models.config import UNetConfig
from . import sd
from .base import Family, Sampling, text_to_image


def check_layout(configs: Mapping[str, Any], where: str) -> None:
    """The pipelines feed the guidance scale's embedding, which only a UNet with `time_cond_proj_dim` reads."""
    unet: UNetConfig = configs["unet"]
    if unet.time_cond_proj_dim is None:
        raise ConfigError(
            f"{where}: a latent consistency model's UNet reads the guidance scale as an embedding, but its "
            "config has no time_cond_proj_dim"
        )


FAMILY = Family(
    name="sd-lcm",
    pipelines=("LatentConsistencyModelPipeline", "LatentConsistencyModelImg2ImgPipeline"),
    configs=sd.FAMILY.configs,
    build=sd.build,
    text=sd.CLIP_TEXT,
    # The UNet call reads `cond.timestep_cond`, the guidance scale's embedding
    denoiser=dataclasses.replace(sd.UNET, guidance="embedding"),
    # No LCM inpainting pipeline: a picture with a mask is repainted by blending, as SD's 4-channel inpainting does
    latent=dataclasses.replace(sd.FAMILY.latent, inpainting=False),
    # As `LatentConsistencyModelPipeline.__call__`'s defaults (4 steps, guidance 8.5); the folder's own
    # scheduler (LCMScheduler) comes first anyway.
    sampling=Sampling(
        defaults={"num_inference_steps": 4, "guidance_scale": 8.5, "scheduler": "lcm"},
        max_side=sd.FAMILY.sampling.max_side,
    ),
    check_layout=check_layout,
)

# One task; LatentConsistencyModelImg2ImgPipeline's strength
VARIANTS = (text_to_image(FAMILY, "Latent Consistency Model", FAMILY.pipelines, strength=0.8, inpaint=1.0),)
