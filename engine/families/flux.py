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
from .base import Conditioning, Family, LatentFormat, Models, Variant
from .sd3 import t5_extra_inputs, t5_states

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
    text_encoders=("text_encoder",),  # CLIP; T5 reads `extra`'s ids
    tokenizers=("tokenizer",),
    encode=encode,
    build=build,
    denoise=denoise,
    latent=LatentFormat(channels=16, tiny_vae="madebyollin/taef1"),
    defaults={"height": 1024, "width": 1024, **DEV, "scheduler": "flow_euler"},
    max_side=2048,
    guidance="embedding",
    guidance_input=lambda config, scale: scale,  # dev's `guidance_embedder` reads the scale itself
    denoiser="transformer",
    check_layout=check_layout,
    extra_inputs=t5_extra_inputs("text_encoder_2", "tokenizer_2", T5_TOKENS),
    chunked_prompts=False,
    t5_encoder="text_encoder_2",
    config_defaults=lambda configs: DEV if configs["transformer"].guidance_embeds else SCHNELL,
    turbo_defaults=SCHNELL,
    uniform_sigmas=True,
    clip_skip=False,  # FluxPipeline reads CLIP's pooled output only
    adapters=frozenset(),
)

VARIANTS = (
    Variant(
        FAMILY.name,
        "text-to-image",
        "FLUX.1",
        PIPELINES,
        text_encoders=FAMILY.text_encoders,
        tokenizers=FAMILY.tokenizers,
        unet_in_channels=64,  # the transformer's packed input: 16 latent channels times a 2x2 patch
        max_side=FAMILY.max_side,
        defaults=FAMILY.defaults,
        strength=0.6,  # FluxImg2ImgPipeline's default
        inpaint_strength=0.6,
    ),
)
