"""Text-to-image as one jitted function: encode the prompt, run the denoising loop, decode.

Mirrors diffusers' `StableDiffusionPipeline.__call__` (and, through `Conditioner`, the SDXL
pipeline): classifier-free guidance batches the unconditional and conditional halves into
one UNet call, `noise = uncond + g * (cond - uncond)` in f32 (Ho & Salimans 2022).
Everything a user changes per request (steps, guidance scale, seed, prompt) is a traced
array; only shapes, the scheduler kind, `max_steps` and whether guidance is on are static.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from . import schedulers
from .clip import CLIPTextModel
from .unet import UNet2DConditionModel
from .vae import AutoencoderKL


class Models(nnx.Module):
    """Every network of a pipeline in one module, so that one `nnx.split` gives one param tree."""

    def __init__(
        self, text_encoder: CLIPTextModel, unet: UNet2DConditionModel, vae: AutoencoderKL, text_encoder_2=None
    ):
        self.text_encoder = text_encoder
        self.text_encoder_2 = text_encoder_2
        self.unet = unet
        self.vae = vae


@dataclass(frozen=True)
class Plan:
    """The static part of a generation: changing any field compiles a new program."""

    batch: int  # images in the call, a multiple of the device count
    latent_height: int
    latent_width: int
    scheduler: str
    max_steps: int
    guidance: bool  # classifier-free guidance on (scale > 1): the UNet batch doubles
    family: str = "sd"


@dataclass(frozen=True)
class Conditioning:
    """What the UNet is conditioned on, for a batch of prompts."""

    context: jax.Array  # [batch, tokens, cross_attention_dim]
    text_embeds: jax.Array | None = None  # SDXL: pooled text embedding [batch, 1280]
    time_ids: jax.Array | None = None  # SDXL: [batch, 6] micro-conditioning


jax.tree_util.register_dataclass(Conditioning, data_fields=["context", "text_embeds", "time_ids"], meta_fields=[])


def encode_sd(models: Models, ids: jax.Array, extra: dict) -> Conditioning:
    """SD 1.x/2.x: the last hidden state of one CLIP encoder."""
    return Conditioning(models.text_encoder(ids).last_hidden_state)


ENCODERS: dict[str, Callable[[Models, jax.Array, dict], Conditioning]] = {"sd": encode_sd}


def _pair(uncond, cond):
    # Interleave so that image k's two halves sit next to each other: a batch sharded by image
    # stays sharded by image, with no cross-device shuffle.
    if uncond is None:
        return None
    stacked = jnp.stack([uncond, cond], axis=1)  # [batch, 2, ...]
    return stacked.reshape(-1, *stacked.shape[2:])  # [2 * batch, ...]


def image_keys(seeds: jax.Array) -> jax.Array:
    """One PRNG key per image from its own seed, so image k is the same on any device count."""
    return jax.vmap(jax.random.PRNGKey)(seeds)


def initial_latents(seeds: jax.Array, shape: tuple[int, int, int]) -> jax.Array:
    """Standard normal latents [batch, h, w, channels], drawn from each image's key."""
    return jax.vmap(lambda k: jax.random.normal(k, shape, jnp.float32))(image_keys(seeds))


def generate(
    plan: Plan,
    graphdef: nnx.GraphDef,
    params: nnx.State,
    ids: jax.Array,
    neg_ids: jax.Array,
    extra: dict[str, Any],
    latents: jax.Array,
    seeds: jax.Array,
    tables: schedulers.Tables,
    guidance_scale: jax.Array,
    progress: Callable[[jax.Array], None] | None = None,
) -> jax.Array:
    """ids, neg_ids [batch, 77] int32; latents [batch, h, w, c] f32 unscaled noise; seeds [batch] uint32.

    Returns images [batch, H, W, 3] in [0, 1], f32. Jit with `plan` (and `progress`) static.
    """
    models: Models = nnx.merge(graphdef, params)
    encode = ENCODERS[plan.family]
    cond = encode(models, ids, extra)
    uncond = encode(models, neg_ids, extra) if plan.guidance else None
    context = _pair(uncond.context, cond.context) if plan.guidance else cond.context
    text_embeds = _pair(uncond.text_embeds, cond.text_embeds) if plan.guidance else cond.text_embeds
    time_ids = _pair(uncond.time_ids, cond.time_ids) if plan.guidance else cond.time_ids
    keys = image_keys(seeds)
    kind = plan.scheduler

    def body(i, carry):
        x, state = carry
        model_in = schedulers.scale_model_input(kind, tables, i, x)
        if plan.guidance:
            model_in = _pair(model_in, model_in)
        t = schedulers.timestep(tables, i)
        out = models.unet(model_in, t, context, text_embeds, time_ids).astype(jnp.float32)
        if plan.guidance:
            out = out.reshape(x.shape[0], 2, *x.shape[1:])  # [batch, (uncond, cond), h, w, c]
            out = out[:, 0] + guidance_scale * (out[:, 1] - out[:, 0])
        noise = None
        if kind == "euler_a":
            step_keys = jax.vmap(lambda k: jax.random.fold_in(k, i + 1))(keys)
            noise = jax.vmap(lambda k: jax.random.normal(k, x.shape[1:], jnp.float32))(step_keys)
        x, state = schedulers.step(kind, tables, state, i, out, x, noise)
        if progress is not None:
            jax.debug.callback(progress, i)
        return x, state

    x = latents.astype(jnp.float32) * tables.init_noise_sigma
    x, _ = jax.lax.fori_loop(0, tables.num_loop_steps, body, (x, schedulers.init_state(kind, x)))
    vae_cfg = models.vae.config
    if vae_cfg.shift_factor is not None:
        x = x / vae_cfg.scaling_factor + vae_cfg.shift_factor
    else:
        x = x / vae_cfg.scaling_factor
    images = models.vae.decode(x)
    return jnp.clip(images / 2 + 0.5, 0.0, 1.0)
