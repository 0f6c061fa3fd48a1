"""Stable Diffusion XL: two CLIP text encoders, a UNet with `text_time` micro-conditioning, the KL VAE.

Mirrors diffusers' `StableDiffusionXLPipeline` (Podell et al. 2023, sec. 2.2). The UNet's
`text_time` embedding reads the pooled, projected output of the second text encoder and six
"time ids": original size (h, w), crop top-left (top, left) and target size (h, w). Like
diffusers by default, we condition on an uncropped image of the size we generate.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ConfigError
from ..models.config import CLIPTextConfig, UNetConfig, VAEConfig
from . import sd
from .base import Conditioning, Family, LatentFormat, Models, Sampling, TextSide, variants

TIME_IDS = 6  # original (h, w), crop (top, left), target (h, w)


def add_time_ids(height: int, width: int) -> np.ndarray:
    """diffusers' `_get_add_time_ids` with original_size = target_size = (height, width), no crop."""
    return np.array([height, width, 0, 0, height, width], np.float32)


def check_layout(configs: Mapping[str, Any], where: str) -> None:
    """The sizes that must agree between the two encoders and the UNet, which diffusers checks at run time."""
    unet: UNetConfig = configs["unet"]
    first: CLIPTextConfig = configs["text_encoder"]
    second: CLIPTextConfig = configs["text_encoder_2"]
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
    plan: Any, prompt: str, negative_prompt: str | None, vae_scale_factor: int, force_zeros: bool
) -> dict[str, np.ndarray]:
    """The per-image inputs of `encode` besides token ids, batch first so that they shard like the images."""
    height, width = plan.latent_height * vae_scale_factor, plan.latent_width * vae_scale_factor
    return {
        "time_ids": np.broadcast_to(add_time_ids(height, width), (plan.batch, TIME_IDS)).copy(),
        # As diffusers: no negative prompt at all (None) means zero embeddings; "" is encoded as text.
        "zero_negative": np.full((plan.batch,), force_zeros and negative_prompt is None),
    }


def encode(models: Models, ids: jax.Array, extra: dict, plan: Any, negative: bool) -> Conditioning:
    """Both encoders' penultimate hidden states side by side, and the second's projected pooled output.

    ids [batch, 2, 77]: one row per tokenizer. extra: "time_ids" [batch, 6] f32 and "zero_negative"
    [batch] bool, SDXL's `force_zeros_for_empty_prompt`: an empty negative prompt means no text at all,
    zero embeddings rather than the embeddings of "". Unlike diffusers, which reads layer -2 for the
    negative prompt whatever `clip_skip` says, both halves of the guidance batch skip the same layers.
    """
    layer = -(plan.clip_skip + 2)  # SDXL always reads the penultimate layer; clip_skip goes further back
    first, second = models.text_encoder(ids[:, 0]), models.text_encoder_2(ids[:, 1])
    context = jnp.concatenate(
        [first.hidden_states[layer], second.hidden_states[layer]], axis=-1
    )  # [batch, 77, d1 + d2]
    pooled = second.pooled  # [batch, projection_dim]
    if negative:
        zero = extra["zero_negative"]
        context = jnp.where(zero[:, None, None], 0.0, context).astype(context.dtype)
        pooled = jnp.where(zero[:, None], 0.0, pooled).astype(pooled.dtype)
    return Conditioning(context, pooled, extra["time_ids"])


FAMILY = Family(
    name="sdxl",
    pipelines=("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline", "StableDiffusionXLInpaintPipeline"),
    configs={"text_encoder": CLIPTextConfig, "text_encoder_2": CLIPTextConfig, "unet": UNetConfig, "vae": VAEConfig},
    build=sd.build,  # the same networks; the second encoder is `CLIPTextModelWithProjection`
    text=TextSide(
        encoders=("text_encoder", "text_encoder_2"),
        tokenizers=("tokenizer", "tokenizer_2"),
        encode=encode,
        extra_inputs=lambda index, vae_scale_factor, folder, host: functools.partial(
            extra_inputs,
            vae_scale_factor=vae_scale_factor,
            force_zeros=bool(index.get("force_zeros_for_empty_prompt", True)),  # diffusers' default: True
        ),
    ),
    denoiser=sd.UNET,  # the same UNet call: its `text_time` embedding reads the pooled text and time ids
    latent=LatentFormat(tiny_vae="madebyollin/taesdxl", inpainting=True),
    # as the SDXL-on-TPU post
    sampling=Sampling(defaults={"num_inference_steps": 25, "guidance_scale": 5.0, "scheduler": "euler"}, max_side=2048),
    check_layout=check_layout,
)

VARIANTS = variants(
    FAMILY,
    "Stable Diffusion XL",
    ("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline"),
    inpainting=("StableDiffusionXLInpaintPipeline",),
    strengths=(0.3, 0.9999, 0.9999),
)
