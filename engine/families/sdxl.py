"""Stable Diffusion XL's host-side pieces: its layout check and its per-image micro-conditioning.

Mirrors diffusers' `StableDiffusionXLPipeline` (Podell et al. 2023, sec. 2.2). The UNet's
`text_time` embedding reads the pooled, projected output of the second text encoder and six
"time ids": original size (h, w), crop top-left (top, left) and target size (h, w). Like
diffusers by default, we condition on an uncropped image of the size we generate. The text
encoding itself runs inside the jitted function: `pipeline.encode_sdxl`.
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from ..models.config import CLIPTextConfig, UNetConfig
from ..sampling.pipeline import Plan

TIME_IDS = 6  # original (h, w), crop (top, left), target (h, w)


def add_time_ids(height: int, width: int) -> np.ndarray:
    """diffusers' `_get_add_time_ids` with original_size = target_size = (height, width), no crop."""
    return np.array([height, width, 0, 0, height, width], np.float32)


def check_layout(unet: UNetConfig, first: CLIPTextConfig, second: CLIPTextConfig, where: str) -> None:
    """The sizes that must agree between the two encoders and the UNet, which diffusers checks at run time."""
    problems = []
    if unet.addition_embed_type != "text_time":
        problems.append(f"the UNet's addition_embed_type is {unet.addition_embed_type!r}, SDXL needs 'text_time'")
    else:
        added = (unet.addition_time_embed_dim or 0) * TIME_IDS + second.projection_dim
        if added != unet.projection_class_embeddings_input_dim:
            problems.append(
                f"addition_time_embed_dim * {TIME_IDS} + text_encoder_2 projection_dim = {added}, but the UNet's "
                f"projection_class_embeddings_input_dim is {unet.projection_class_embeddings_input_dim}"
            )
    context = first.hidden_size + second.hidden_size
    if set(unet.per_block("cross_attention_dim")) != {context}:
        problems.append(
            f"the encoders' hidden sizes add up to {context}, the UNet's cross_attention_dim is {unet.cross_attention_dim}"
        )
    if problems:
        raise ConfigError(f"{where}: not a consistent SDXL model: " + "; ".join(problems))


def extra_inputs(
    plan: Plan, negative_prompt: str | None, vae_scale_factor: int, force_zeros: bool
) -> dict[str, np.ndarray]:
    """The per-image inputs of `encode_sdxl` besides token ids, batch first so that they shard like the images."""
    height, width = plan.latent_height * vae_scale_factor, plan.latent_width * vae_scale_factor
    return {
        "time_ids": np.broadcast_to(add_time_ids(height, width), (plan.batch, TIME_IDS)).copy(),
        # As diffusers: no negative prompt at all (None) means zero embeddings; "" is encoded as text.
        "zero_negative": np.full((plan.batch,), force_zeros and negative_prompt is None),
    }
