"""FLUX.1 schnell and dev: CLIP-L's pooled vector and T5, the double/single-stream transformer, flow matching.

Mirrors diffusers' `FluxPipeline` (Black Forest Labs 2024). CLIP reads the prompt's first 77 tokens for its pooled
output alone (no projection; `pooler_output`); T5 reads up to 512 tokens (no attention mask), which, through the
transformer's `context_embedder`, are the text tokens of every block. The latents are the 16-channel VAE's, which
the transformer packs into 2x2 patches itself. The schedule is flow matching on the sigmas linspace(1, 1/n, n)
that FluxPipeline hands its scheduler, shifted by the picture's token count where the folder's scheduler says so
(dev). Guidance: schnell takes none; dev reads the scale as an embedding (`guidance_embeds`), never a second,
unconditional row, so a negative prompt has nothing to steer (as FluxPipeline at its default `true_cfg_scale`).
schnell and dev are told apart by `guidance_embeds`: 4 steps without guidance, or 28 steps at 3.5.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx

from ..errors import ConfigError
from ..models.clip import CLIPTextModel
from ..models.config import CLIPTextConfig, VAEConfig
from ..models.t5 import T5Config, T5EncoderModel
from ..models.transformer_flux import TIME_FACTOR, FluxTransformer2DModel, FluxTransformerConfig
from ..models.vae import AutoencoderKL
from .base import Conditioning, Denoiser, Family, LatentFormat, Models, text_to_image
from .sd3 import flow_sampling, t5_states, t5_text

T5_TOKENS = 512  # FluxPipeline's `max_sequence_length` default
SCHNELL = {"num_inference_steps": 4, "guidance_scale": 0.0}
DEV = {"num_inference_steps": 28, "guidance_scale": 3.5}


def check_layout(configs: Mapping[str, Any], where: str) -> None:
    """The widths that must agree between the encoders, the transformer and the VAE."""
    transformer: FluxTransformerConfig = configs["transformer"]
    problems = []
    if configs["text_encoder"].hidden_size != transformer.pooled_projection_dim:
        problems.append(f"CLIP's width {configs['text_encoder'].hidden_size} is not pooled_projection_dim")
    if configs["text_encoder_2"].d_model != transformer.joint_attention_dim:
        problems.append(f"T5's d_model {configs['text_encoder_2'].d_model} is not joint_attention_dim")
    if configs["vae"].latent_channels != transformer.latent_channels:
        problems.append(f"the VAE's {configs['vae'].latent_channels} latent channels are not the transformer's")
    if problems:
        raise ConfigError(f"{where}: not a consistent FLUX.1 model: " + "; ".join(problems))


def encode(models: Models, ids: jax.Array, extra: dict, plan: Any, negative: bool) -> Conditioning:
    """ids [batch, 77] for CLIP; extra "t5_ids" [batch, 512]. Context: T5's last hidden state; pooled: CLIP's."""
    pooled = models.text_encoder(ids).pooled
    t5 = t5_states(models, "text_encoder_2", extra, negative)
    return Conditioning(t5.astype(pooled.dtype), pooled)


def denoise(models: Models, x: jax.Array, timesteps: jax.Array, kv: Any, cond: Conditioning, residuals: tuple):
    """The transformer's velocity, fed as FluxPipeline feeds it: t / 1000, and dev's guidance scale."""
    transformer = models.transformer
    guidance = cond.timestep_cond if transformer.config.guidance_embeds else None
    return transformer(x, timesteps / TIME_FACTOR, kv, cond.text_embeds, guidance)


def build(configs: Mapping[str, Any], rngs: nnx.Rngs) -> dict[str, nnx.Module]:
    networks = {
        "text_encoder": CLIPTextModel(configs["text_encoder"], rngs),
        "transformer": FluxTransformer2DModel(configs["transformer"], rngs),
        "vae": AutoencoderKL(configs["vae"], rngs),
    }
    if "text_encoder_2" in configs:  # T5 on the device; on the host, `loading.host_encoder` holds it
        networks["text_encoder_2"] = T5EncoderModel(configs["text_encoder_2"], rngs)
    return networks


PIPELINES = ("FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline")
FAMILY = Family(
    name="flux",
    pipelines=PIPELINES,
    configs={
        "text_encoder": CLIPTextConfig,
        "text_encoder_2": T5Config,
        "transformer": FluxTransformerConfig,
        "vae": VAEConfig,
    },
    build=build,
    text=dataclasses.replace(
        t5_text(("text_encoder",), ("tokenizer",), encode, "text_encoder_2", "tokenizer_2", T5_TOKENS),
        clip_skip=False,  # FluxPipeline reads CLIP's pooled output only
    ),
    denoiser=Denoiser(
        component="transformer",
        denoise=denoise,
        guidance="embedding",
        guidance_input=lambda config, scale: scale,  # dev's `guidance_embedder` reads the scale itself
        adapters=frozenset(),
    ),
    # The transformer packs the latents' 2x2 patches itself: its in_channels are 4x the VAE's latent channels
    latent=LatentFormat(tiny_vae="madebyollin/taef1", denoiser_patch=2),
    sampling=flow_sampling(
        {"height": 1024, "width": 1024, **DEV},
        config_defaults=lambda configs: DEV if configs["transformer"].guidance_embeds else SCHNELL,
        turbo_defaults=SCHNELL,
        uniform_sigmas=True,
    ),
    check_layout=check_layout,
)

VARIANTS = (text_to_image(FAMILY, "FLUX.1", PIPELINES, strength=0.6, inpaint=0.6),)  # FluxImg2ImgPipeline's
