"""Stable Diffusion 1.x and 2.x: one CLIP text encoder, a UNet conditioned on its last hidden state, the KL VAE.

Mirrors diffusers' `StableDiffusionPipeline` (Rombach et al. 2022): the prompt's last hidden state (or, with
`clip_skip` k, layer -(k + 1) through the final layer norm) is the UNet's cross-attention context; guidance
is a second, unconditional batch row per image.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from ..errors import ConfigError
from ..loading.quantize import unet_w8a8
from ..loading.vae import VAE_CLASSES, read_vae_config
from ..models.clip import CLIPTextModel
from ..models.config import AutoencoderTinyConfig, CLIPTextConfig, UNetConfig, VAEConfig
from ..models.unet import UNet2DConditionModel
from .base import Conditioning, Denoiser, Family, LatentFormat, Models, Sampling, TextSide, variants


class AnyVAEConfig:
    """A pipeline's vae/config.json read as the class it names (`loading.vae.VAE_CLASSES`): an `AutoencoderKL`, or
    the `AutoencoderTiny` a distilled model may ship as its own (SDXS-512), which diffusers' pipelines take alike."""

    @staticmethod
    def from_json(path: str | Path) -> VAEConfig | AutoencoderTinyConfig:
        class_name, config = read_vae_config(Path(path), default_class="AutoencoderKL")
        if config is None:
            raise ConfigError(
                f"{path}: a VAE of class {class_name!r} is not supported (one of {', '.join(VAE_CLASSES)})"
            )
        return config


def encode(models: Models, ids: jax.Array, extra: dict, plan: Any, negative: bool) -> Conditioning:
    """The last hidden state of the CLIP encoder; ids [batch, 77].

    With `clip_skip` k, the output of layer -(k + 1), still through `final_layer_norm`, as diffusers does.
    """
    out = models.text_encoder(ids)
    if plan.clip_skip == 0:
        return Conditioning(out.last_hidden_state)
    return Conditioning(models.text_encoder.text_model.final_layer_norm(out.hidden_states[-(plan.clip_skip + 1)]))


def denoise(
    models: Models,
    x: jax.Array,
    timesteps: jax.Array,
    kv: Any,
    cond: Conditioning,
    residuals: tuple,
    keep_deep: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The UNet's noise prediction; `kv` is the text projected for its cross-attentions (`project_context`); a
    guidance-distilled UNet reads the guidance scale's embedding (`cond.timestep_cond`). `keep_deep`: and the deep
    features `denoise_shallow` reuses."""
    return models.unet(
        x, timesteps, kv, cond.text_embeds, cond.time_ids, *residuals, timestep_cond=cond.timestep_cond,
        keep_deep=keep_deep,
    )  # fmt: skip


def denoise_shallow(
    models: Models, x: jax.Array, timesteps: jax.Array, kv: Any, cond: Conditioning, deep: jax.Array
) -> jax.Array:
    """The UNet's first level only, the deep features of an earlier step below it (DeepCache)."""
    return models.unet.shallow(x, timesteps, kv, deep, cond.text_embeds, cond.time_ids, cond.timestep_cond)


def build(configs: Mapping[str, Any], rngs: nnx.Rngs) -> dict[str, nnx.Module]:
    """The networks, by component; the second text encoder, when a family has one, projects its pooled output."""
    encoders = {
        name: CLIPTextModel(configs[name], rngs, with_projection=i == 1)
        for i, name in enumerate(n for n in configs if n.startswith("text_encoder"))
    }
    vae = {config: model for config, model in VAE_CLASSES.values()}[type(configs["vae"])]
    return {**encoders, "unet": UNet2DConditionModel(configs["unet"], rngs), "vae": vae(configs["vae"], rngs)}


# SD's CLIP text side: one encoder's last hidden state (or an earlier layer's), chunks and emphasis. LCM shares it.
CLIP_TEXT = TextSide(encoders=("text_encoder",), tokenizers=("tokenizer",), encode=encode)
UNET = Denoiser(component="unet", denoise=denoise, denoise_shallow=denoise_shallow, w8a8=unet_w8a8)

FAMILY = Family(
    name="sd",
    pipelines=("StableDiffusionPipeline", "StableDiffusionImg2ImgPipeline", "StableDiffusionInpaintPipeline"),
    configs={"text_encoder": CLIPTextConfig, "unet": UNetConfig, "vae": AnyVAEConfig},
    build=build,
    text=CLIP_TEXT,
    denoiser=UNET,
    latent=LatentFormat(tiny_vae="madebyollin/taesd", inpainting=True),
    # The scheduler here is a fallback: a folder's own scheduler class, when we have it, comes first.
    sampling=Sampling(defaults={"num_inference_steps": 50, "guidance_scale": 7.5, "scheduler": "pndm"}, max_side=1024),
)

VARIANTS = variants(
    FAMILY,
    "Stable Diffusion",
    ("StableDiffusionPipeline", "StableDiffusionImg2ImgPipeline"),
    inpainting=("StableDiffusionInpaintPipeline",),
    strengths=(0.8, 1.0, 1.0),
)
