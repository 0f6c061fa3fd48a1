"""Stable Diffusion 3 and 3.5: two CLIP encoders and T5, the MMDiT transformer, the 16-channel VAE, flow matching.

Mirrors diffusers' `StableDiffusion3Pipeline` (Esser et al. 2024). The prompt is read three times: both CLIP
encoders (with projection) read its first 77 tokens, and their penultimate hidden states side by side (768 +
1280 = 2048 wide) are padded with zeros to T5's width; T5 reads up to 256 tokens (without an attention mask, as
diffusers calls it), or, for a folder saved without T5, 256 tokens of zeros stand in. The transformer's context
is the CLIP part followed by the T5 part, [batch, 77 + 256, 4096]; its pooled vector is both CLIP encoders'
projected pooled outputs side by side [batch, 2048]. Guidance is a second, unconditional batch row per image,
as in SD; the negative prompt "" is encoded as text. The model predicts the flow's velocity, which the
flow-matching Euler kind steps (`schedulers.flow_match_euler`); the VAE's `shift_factor` moves its latents.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..errors import ConfigError
from ..loading.t5_tokenizer import T5Tokenizer
from ..models.clip import CLIPTextModel
from ..models.config import CLIPTextConfig, VAEConfig
from ..models.t5 import T5Config, T5EncoderModel
from ..models.transformer_sd3 import SD3Transformer2DModel, SD3TransformerConfig
from ..models.vae import AutoencoderKL
from .base import (
    Conditioning,
    Denoiser,
    Family,
    LatentFormat,
    Models,
    PromptFit,
    Sampling,
    TextSide,
    text_to_image,
)

T5_TOKENS = 256  # diffusers' `max_sequence_length` default for SD3
T5 = "text_encoder_3"


def check_layout(configs: Mapping[str, Any], where: str) -> None:
    """The widths that must agree between the encoders, the transformer and the VAE."""
    transformer: SD3TransformerConfig = configs["transformer"]
    first, second = configs["text_encoder"], configs["text_encoder_2"]
    problems = []
    pooled = first.projection_dim + second.projection_dim
    if pooled != transformer.pooled_projection_dim:
        problems.append(
            f"the CLIP projections add up to {pooled}, the transformer pools {transformer.pooled_projection_dim}"
        )
    clip = first.hidden_size + second.hidden_size
    if clip > transformer.joint_attention_dim:
        problems.append(f"the CLIP hidden sizes add up to {clip}, wider than joint_attention_dim")
    if T5 in configs and configs[T5].d_model != transformer.joint_attention_dim:
        problems.append(
            f"T5's d_model {configs[T5].d_model} is not joint_attention_dim {transformer.joint_attention_dim}"
        )
    if configs["vae"].latent_channels != transformer.in_channels:
        problems.append(f"the VAE's {configs['vae'].latent_channels} latent channels are not the transformer's input")
    if problems:
        raise ConfigError(f"{where}: not a consistent SD3 model: " + "; ".join(problems))


def t5_inputs(plan: Any, prompt: str, negative_prompt: str | None, tokenizer: T5Tokenizer | None, host: Any) -> dict:
    """The prompt's T5 token ids [batch, tokens], batch first, and the negative prompt's when the plan is guided;
    with T5 on the host (`loading.host_encoder`), their T5 hidden states instead. None for a folder without T5."""
    if tokenizer is None:
        return {}
    texts = {"t5": prompt, **({"neg_t5": negative_prompt or ""} if plan.guidance else {})}
    out = {}
    for name, text in texts.items():
        ids = tokenizer(text)[0]  # [1, tokens]
        row = ids if host is None else host(ids)
        out[f"{name}_ids" if host is None else f"{name}_embeds"] = np.broadcast_to(row, (plan.batch, *row.shape[1:]))
    return {name: value.copy() for name, value in out.items()}


def t5_extra_inputs(encoder: str, tokenizer: str, tokens: int) -> Any:
    """A family's `extra_inputs`: both prompts read by the folder's T5 tokenizer (sub-folder `tokenizer`), padded
    or cut to `tokens`, when the folder has its T5 encoder (sub-folder `encoder`) and it was not left out."""

    def extra_inputs(index: Mapping[str, Any], vae_scale_factor: int, folder: Any, host: Any) -> Any:
        has_t5 = folder is not None and folder.has(encoder)
        reader = t5_tokenizer(folder, tokenizer, tokens) if has_t5 else None
        return functools.partial(t5_inputs, tokenizer=reader, host=host)

    return extra_inputs


def t5_tokenizer(folder: Any, tokenizer: str, tokens: int) -> T5Tokenizer:
    """The folder's T5 tokenizer (sub-folder `tokenizer`) at `tokens`, read once for the prompt's ids and its fit."""
    return folder.read_once(
        f"t5 tokenizer {tokenizer} {tokens}", lambda: T5Tokenizer(folder.component(tokenizer), tokens)
    )


def t5_fit(encoder: str, tokenizer: str, tokens: int) -> Any:
    """A family's `fit_prompts`: what cutting both prompts at `tokens` of the folder's T5 tokenizer dropped (None
    where the folder's T5 encoder is absent or left out, as `t5_extra_inputs` reads none)."""

    def fit_prompts(folder: Any) -> Any:
        if folder is None or not folder.has(encoder):
            return None
        reader = t5_tokenizer(folder, tokenizer, tokens)

        def fit(prompt: str, negative_prompt: str | None) -> PromptFit:
            texts = {"prompt": prompt, **({} if negative_prompt is None else {"negative prompt": negative_prompt})}
            return PromptFit(notes=tuple(note for what, text in texts.items() for note in reader(text, what)[1]))

        return fit

    return fit_prompts


def t5_states(models: Models, name: str, extra: dict, negative: bool) -> jax.Array | None:
    """T5's hidden states for the batch: brought by the request (T5 on the host), computed here, or None."""
    key = "neg_t5" if negative else "t5"
    if f"{key}_embeds" in extra:
        return extra[f"{key}_embeds"]
    if hasattr(models, name):
        return getattr(models, name)(extra[f"{key}_ids"])
    return None


def encode(models: Models, ids: jax.Array, extra: dict, plan: Any, negative: bool) -> Conditioning:
    """ids [batch, 2, 77]: one row per CLIP tokenizer. As diffusers' `encode_prompt`, `clip_skip` k reads layer
    -(k + 2) of both CLIP encoders."""
    layer = -(plan.clip_skip + 2)
    first, second = models.text_encoder(ids[:, 0]), models.text_encoder_2(ids[:, 1])
    clip = jnp.concatenate([first.hidden_states[layer], second.hidden_states[layer]], axis=-1)
    pooled = jnp.concatenate([first.pooled, second.pooled], axis=-1)
    width = models.transformer.config.joint_attention_dim
    t5 = t5_states(models, T5, extra, negative)
    if t5 is None:  # a folder without T5, or T5 left out: zeros, as diffusers
        t5 = jnp.zeros((ids.shape[0], T5_TOKENS, width), clip.dtype)
    clip = jnp.pad(clip, ((0, 0), (0, 0), (0, width - clip.shape[-1])))
    return Conditioning(jnp.concatenate([clip, t5.astype(clip.dtype)], axis=-2), pooled)


def denoise(models: Models, x: jax.Array, timesteps: jax.Array, kv: Any, cond: Conditioning, residuals: tuple):
    """The transformer's velocity; `kv` is the context through its `context_embedder` (`project_context`)."""
    return models.transformer(x, timesteps, kv, cond.text_embeds)


def build(configs: Mapping[str, Any], rngs: nnx.Rngs) -> dict[str, nnx.Module]:
    networks = {
        "text_encoder": CLIPTextModel(configs["text_encoder"], rngs, with_projection=True),
        "text_encoder_2": CLIPTextModel(configs["text_encoder_2"], rngs, with_projection=True),
        "transformer": SD3Transformer2DModel(configs["transformer"], rngs),
        "vae": AutoencoderKL(configs["vae"], rngs),
    }
    if T5 in configs:
        networks[T5] = T5EncoderModel(configs[T5], rngs)
    return networks


def t5_text(
    encoders: tuple[str, ...], tokenizers: tuple[str, ...], encode: Any, t5: str, t5_tokenizer: str, tokens: int
) -> TextSide:
    """The text side of a pipeline with a T5 encoder (SD3, FLUX.1): the CLIP encoders read the prompt's first 77
    tokens as plain text, T5 (sub-folder `t5`, which may run on the host) reads up to `tokens` of it, its ids
    brought by the extra inputs."""
    return TextSide(
        encoders=encoders,
        tokenizers=tokenizers,
        encode=encode,
        extra_inputs=t5_extra_inputs(t5, t5_tokenizer, tokens),
        fit_prompts=t5_fit(t5, t5_tokenizer, tokens),
        host_encoder=t5,
        chunked_prompts=False,
    )


def flow_sampling(defaults: Mapping[str, Any], **more: Any) -> Sampling:
    """The generation defaults of a flow-matching family (SD3, FLUX.1): the flow-matching Euler kind, 2048 pixels
    at most; `more`: `Sampling`'s other fields."""
    return Sampling(defaults={**defaults, "scheduler": "flow_euler"}, max_side=2048, **more)


PIPELINES = ("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline", "StableDiffusion3InpaintPipeline")
FAMILY = Family(
    name="sd3",
    pipelines=PIPELINES,
    configs={
        "text_encoder": CLIPTextConfig,
        "text_encoder_2": CLIPTextConfig,
        T5: T5Config,
        "transformer": SD3TransformerConfig,
        "vae": VAEConfig,
    },
    build=build,
    # the CLIP encoders; T5 reads `extra`'s ids
    text=t5_text(
        ("text_encoder", "text_encoder_2"), ("tokenizer", "tokenizer_2"), encode, T5, "tokenizer_3", T5_TOKENS
    ),
    denoiser=Denoiser(component="transformer", denoise=denoise, adapters=frozenset()),
    latent=LatentFormat(tiny_vae="madebyollin/taesd3"),
    sampling=flow_sampling(
        {"num_inference_steps": 28, "guidance_scale": 7.0},
        turbo_defaults={"num_inference_steps": 4, "guidance_scale": 0.0},  # SD 3.5 Large Turbo
    ),
    check_layout=check_layout,
    optional=frozenset({T5}),
)

# One task: the transformer reads the latent channels; image-to-image and inpainting (which blends the kept part at
# each step, as `StableDiffusion3InpaintPipeline`) use the same model. Strengths: the img2img and inpaint pipelines'.
VARIANTS = (text_to_image(FAMILY, "Stable Diffusion 3", PIPELINES, strength=0.6, inpaint=0.6),)
