"""Latent consistency models: Stable Diffusion's networks distilled to sample in 1-8 steps with guidance built in.

Mirrors diffusers' `LatentConsistencyModelPipeline` and `LatentConsistencyModelImg2ImgPipeline` (Luo et al.
2023, LCM_Dreamshaper_v7 and the other LCM distillations of SD 1.x): the same text encoder, UNet and VAE as
`sd`, but the UNet was distilled from guided sampling, so guidance is an input, not a second batch row. Its
`time_embedding.cond_proj` reads `guidance_scale_embedding(guidance_scale - 1)` (`timestep_cond`, the
"Imagen" convention the pipelines use: 1 means no guidance) beside the timestep; no unconditional row is ever
computed and the negative prompt is not read, as the pipelines do. The LCM scheduler is the default.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ..errors import ConfigError
from ..models.config import UNetConfig
from . import sd
from .base import Family, Variant


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
    text_encoders=sd.FAMILY.text_encoders,
    tokenizers=sd.FAMILY.tokenizers,
    encode=sd.encode,
    build=sd.build,
    denoise_shallow=sd.denoise_shallow,
    denoise=sd.denoise,  # the UNet call reads `cond.timestep_cond`, the guidance scale's embedding
    latent=sd.FAMILY.latent,
    # As `LatentConsistencyModelPipeline.__call__`'s defaults (4 steps, guidance 8.5); the folder's own
    # scheduler (LCMScheduler) comes first anyway.
    defaults={"num_inference_steps": 4, "guidance_scale": 8.5, "scheduler": "lcm"},
    max_side=sd.FAMILY.max_side,
    guidance="embedding",
    check_layout=check_layout,
)

# One task: there is no LCM inpainting pipeline (a picture with a mask is repainted by blending, as SD's
# 4-channel inpainting does).
VARIANTS = (
    Variant(
        FAMILY.name,
        "text-to-image",
        "Latent Consistency Model",
        FAMILY.pipelines,
        text_encoders=FAMILY.text_encoders,
        tokenizers=FAMILY.tokenizers,
        unet_in_channels=4,
        max_side=FAMILY.max_side,
        defaults=MappingProxyType(dict(FAMILY.defaults)),
        strength=0.8,  # LatentConsistencyModelImg2ImgPipeline's default
        inpaint_strength=1.0,
    ),
)
