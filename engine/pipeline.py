"""Text-to-image as three jitted functions: encode the prompts, run the denoising loop, decode.

Mirrors diffusers' `StableDiffusionPipeline.__call__` and `StableDiffusionXLPipeline.__call__`;
`ENCODERS` holds what differs by family, token ids -> UNet conditioning. Classifier-free guidance
batches the unconditional and conditional halves into one UNet call,
`noise = uncond + g * (cond - uncond)` in f32 (Ho & Salimans 2022); with guidance off the
unconditional half is not computed at all. Everything a user changes per request (steps,
guidance scale, seed, prompt) is a traced array; only shapes, the scheduler kind, `max_steps`,
whether guidance is on and `clip_skip` are static.
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
    clip_skip: int = 0  # text encoder layers skipped from the end: a different graph, so static


@dataclass(frozen=True)
class Conditioning:
    """What the UNet is conditioned on, for a batch of prompts."""

    context: jax.Array  # [batch, tokens, cross_attention_dim]
    text_embeds: jax.Array | None = None  # SDXL: pooled text embedding [batch, 1280]
    time_ids: jax.Array | None = None  # SDXL: [batch, 6] micro-conditioning


jax.tree_util.register_dataclass(Conditioning, data_fields=["context", "text_embeds", "time_ids"], meta_fields=[])


def encode_sd(models: Models, ids: jax.Array, extra: dict, plan: Plan, negative: bool) -> Conditioning:
    """SD 1.x/2.x: the last hidden state of one CLIP encoder; ids [batch, 77].

    With `clip_skip` k, the output of layer -(k + 1), still through `final_layer_norm`, as diffusers does.
    """
    out = models.text_encoder(ids)
    if plan.clip_skip == 0:
        return Conditioning(out.last_hidden_state)
    return Conditioning(models.text_encoder.text_model.final_layer_norm(out.hidden_states[-(plan.clip_skip + 1)]))


def encode_sdxl(models: Models, ids: jax.Array, extra: dict, plan: Plan, negative: bool) -> Conditioning:
    """SDXL: both encoders' penultimate hidden states side by side, and the second's projected pooled output.

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


ENCODERS: dict[str, Callable[[Models, jax.Array, dict, Plan, bool], Conditioning]] = {
    "sd": encode_sd,
    "sdxl": encode_sdxl,
}


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


def prepare(
    plan: Plan,
    graphdef: nnx.GraphDef,
    params: nnx.State,
    ids: jax.Array,
    neg_ids: jax.Array,
    extra: dict[str, Any],
    latents: jax.Array,
    tables: schedulers.Tables,
) -> tuple[Conditioning, jax.Array, schedulers.State]:
    """Encodes the prompts and scales the initial noise: the first of the three programs.

    ids, neg_ids int32 [batch, 77], or [batch, encoders, 77] for SDXL; extra: the family's other
    per-image inputs (SDXL: time ids); latents [batch, h, w, c] f32 unscaled noise.
    """
    models: Models = nnx.merge(graphdef, params)
    encode = ENCODERS[plan.family]
    cond = encode(models, ids, extra, plan, False)
    if plan.guidance:  # guidance off: the unconditional half is never computed
        uncond = encode(models, neg_ids, extra, plan, True)
        cond = jax.tree.map(_pair, uncond, cond)
    x = latents.astype(jnp.float32) * tables.init_noise_sigma
    return cond, x, schedulers.init_state(plan.scheduler, x)


def denoise(
    plan: Plan,
    graphdef: nnx.GraphDef,
    params: nnx.State,
    cond: Conditioning,
    x: jax.Array,
    state: schedulers.State,
    seeds: jax.Array,
    tables: schedulers.Tables,
    guidance_scale: jax.Array,
    start: jax.Array,
    stop: jax.Array,
) -> tuple[jax.Array, schedulers.State]:
    """Loop steps [start, stop) of the denoising loop; seeds [batch] uint32 (euler_a's per-step noise).

    One call may run the whole loop; the engine splits it only to report progress, since a host
    callback inside the loop would keep the program out of JAX's persistent compilation cache.
    """
    models: Models = nnx.merge(graphdef, params)
    keys = image_keys(seeds)
    kind = plan.scheduler

    def body(i, carry):
        x, state = carry
        model_in = schedulers.scale_model_input(kind, tables, i, x)
        if plan.guidance:
            model_in = _pair(model_in, model_in)
        t = schedulers.timestep(tables, i)
        out = models.unet(model_in, t, cond.context, cond.text_embeds, cond.time_ids).astype(jnp.float32)
        if plan.guidance:
            out = out.reshape(x.shape[0], 2, *x.shape[1:])  # [batch, (uncond, cond), h, w, c]
            out = out[:, 0] + guidance_scale * (out[:, 1] - out[:, 0])
        noise = None
        if kind == "euler_a":
            step_keys = jax.vmap(lambda k: jax.random.fold_in(k, i + 1))(keys)
            noise = jax.vmap(lambda k: jax.random.normal(k, x.shape[1:], jnp.float32))(step_keys)
        return schedulers.step(kind, tables, state, i, out, x, noise)

    return jax.lax.fori_loop(start, stop, body, (x, state))


def decode(plan: Plan, graphdef: nnx.GraphDef, params: nnx.State, x: jax.Array) -> jax.Array:
    """Latents -> images [batch, H, W, 3] in [0, 1], f32: the last of the three programs."""
    models: Models = nnx.merge(graphdef, params)
    vae_cfg = models.vae.config
    if vae_cfg.latents_mean is not None and vae_cfg.latents_std is not None:  # as diffusers' SDXL pipeline
        x = x * jnp.asarray(vae_cfg.latents_std) / vae_cfg.scaling_factor + jnp.asarray(vae_cfg.latents_mean)
    elif vae_cfg.shift_factor is not None:
        x = x / vae_cfg.scaling_factor + vae_cfg.shift_factor
    else:
        x = x / vae_cfg.scaling_factor
    images = models.vae.decode(x)
    return jnp.clip(images / 2 + 0.5, 0.0, 1.0)
