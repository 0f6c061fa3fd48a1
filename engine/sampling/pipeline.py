"""Text-to-image for a batch of image slots, as three jitted functions: admit, advance, decode.

Mirrors diffusers' `StableDiffusionPipeline.__call__` and `StableDiffusionXLPipeline.__call__`, with the
batch made of independent slots (continuous batching): `admit` encodes new requests' prompts and draws
their noise into free slots, `advance` runs a chunk of denoising steps on every slot at its own step of
its own schedule, `decode` turns latents into pictures. What differs by family (token ids -> conditioning,
the denoiser's call) comes from the family's record, `engine.families.FAMILIES[plan.family]`. Classifier-free guidance batches the unconditional and conditional halves into
one UNet call, `noise = uncond + g * (cond - uncond)` in f32 (Ho & Salimans 2022), with `g` per slot;
with guidance off the unconditional half is not computed at all. A family guided by embedding (LCM) never has
that half: each slot's `g` reaches the denoiser as `Conditioning.timestep_cond`, in the form the family's
`guidance_input` gives it (LCM: `guidance_scale_embedding(g - 1)`; FLUX.1-dev: `g` itself).
Everything a user changes per request (steps, guidance scale, seed, prompt and its emphasis, eta) is a traced array; only the `Plan` (shapes, the
scheduler kind, `max_steps`, whether guidance is on, `clip_skip`, the prompt's chunk count) is static.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .. import schedulers
from ..families import DEFAULT_FAMILY, FAMILIES, Conditioning, Family, Models
from ..loading.quantize import dequantize
from ..nn.int8_weights import widened_blocks
from ..nn.layers import ProjectedContext
from . import modes, pairs, prompts


@dataclass(frozen=True)
class Plan:
    """The static part of a generation: changing any field compiles a new program."""

    batch: int  # image slots drawn at once, a multiple of the device count
    latent_height: int
    latent_width: int
    scheduler: str
    max_steps: int
    # Classifier-free guidance as a second, unconditional batch row per image (scale > 1): the UNet batch doubles.
    # Off for a model guided by embedding (`Denoiser.guided_by_embedding`: LCM; `Jobs.plan` sees to it), which reads
    # each slot's scale as `Conditioning.timestep_cond` instead: that is the model's, not the plan's.
    guidance: bool
    family: str = DEFAULT_FAMILY  # `engine.families.FAMILIES` key: the family's record encodes the prompt and denoises
    clip_skip: int = 0  # text encoder layers skipped from the end: a different graph, so static
    chunks: int = 1  # prompts of 75-token chunks: the context is chunks * 77 tokens long (engine/prompts.py)
    devices: int = 1  # the batch is sharded over this many devices, `batch // devices` slots on each
    control: bool = False  # the ControlNet runs beside the UNet; each slot brings a control image
    mode: str = "txt2img"  # txt2img | img2img | inpaint | latents (modes.py): what admit encodes, what steps keep
    # DeepCache: a chunk's step runs the UNet whole only where some slot is at a multiple of this (its deep features
    # kept in `Slots.deep`), else its first level alone over them (`Denoiser.denoise_shallow`); 0 or 1: always whole
    deep_cache: int = 0
    token_merging: float = 0.0  # the UNet's first level merges this share of its tokens (`nn.token_merging`); 0: off
    # Reference pictures (a denoiser that edits, `families.base.References`): each one's (height, width) in pixels,
    # in the request's order; their latents sit in `Conditioning.references`
    references: tuple[tuple[int, int], ...] = ()
    # A text side that pads prompts to one of a few lengths (`TextSide.fit_prompts`): this plan's; 0: its one length
    text_tokens: int = 0

    @property
    def slots_per_device(self) -> int:
        return self.batch // self.devices


def take_lanes(tree: Any, plan: Plan, lanes: int) -> Any:
    """Each device's first `lanes` slots of a slot-major pytree: [batch, ...] -> [devices * lanes, ...].

    A program that runs on `lanes` slots per device costs that many, not the whole batch: the batcher
    packs requests into the lowest lanes. The slice is per device, so no data crosses devices.
    """
    if lanes == plan.slots_per_device:
        return tree

    def take(a):
        rows = a.shape[0] // plan.batch  # 2 for guidance pairs
        return a.reshape(plan.devices, -1, *a.shape[1:])[:, : lanes * rows].reshape(-1, *a.shape[1:])

    return jax.tree.map(take, tree)


def put_lanes(full: Any, part: Any, plan: Plan, lanes: int) -> Any:
    """The inverse of `take_lanes`: writes `part` back into each device's first lanes of `full`."""
    if lanes == plan.slots_per_device:
        return part

    def put(a, b):
        rows = a.shape[0] // plan.batch
        grid = a.reshape(plan.devices, -1, *a.shape[1:])
        return grid.at[:, : lanes * rows].set(b.reshape(plan.devices, -1, *b.shape[1:])).reshape(a.shape)

    return jax.tree.map(put, full, part)


def encode_prompts(
    models: Models, ids: jax.Array, weights: jax.Array, extra: dict, plan: Plan, negative: bool
) -> Conditioning:
    """Token chunks -> the UNet's conditioning: the family's encoder over every chunk, with emphasis.

    ids int32 and weights f32 [batch, plan.chunks, 77] (SDXL: [batch, plan.chunks, 2, 77]); a prompt of one
    chunk with weights 1 gives exactly what the family's `encode` gives for its ids.
    """
    text = FAMILIES[plan.family].text
    if not text.chunked_prompts:  # one plain chunk (prompts.tokenize_plain): the family's encoder as it is
        return text.encode(models, ids[:, 0], extra, plan, negative)
    return prompts.encode_chunks(text, models, ids, weights, extra, plan, negative)


def _inpainting(family: Family, models: Models) -> bool:
    """Whether the denoiser is an inpainting one, which reads the mask and the masked picture's latents beside the
    latents (`LatentFormat.task` of its input width over the VAE's latents)."""
    config = getattr(models, family.denoiser.component).config
    return family.latent.task(config.in_channels, models.vae.config) == "inpainting"


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


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Admission:
    """What new requests bring to a batch: one row per slot, used where `mask` is set (host arrays).

    ids, neg_ids int32 and weights, neg_weights f32 [batch, chunks, 77] (SDXL: [batch, chunks, encoders, 77]):
    a prompt and its negative prompt in 75-token chunks with their emphasis; extra: the family's other per-image
    inputs (SDXL: time ids); latents [batch, h, w, c] unscaled noise, used where `given`, else drawn from
    the slot's seed; tables: each slot's own schedule (its own step count).
    """

    mask: jax.Array  # [batch] bool: the slots being (re)filled
    ids: jax.Array
    weights: jax.Array
    neg_ids: jax.Array
    neg_weights: jax.Array
    extra: dict[str, Any]
    latents: jax.Array  # [batch, h, w, c] f32
    given: jax.Array  # [batch] bool: latents came with the request
    seeds: jax.Array  # [batch] uint32
    guidance_scale: jax.Array  # [batch] f32
    tables: schedulers.Tables  # every array with a leading [batch] axis
    # With `plan.control`: each slot's control image [batch, H, W, 3] in [0, 1] at pixel size, and its scale.
    control: jax.Array | None = None
    control_scale: jax.Array | None = None  # [batch] f32
    source: modes.Source | None = None  # image modes: each slot's picture and mask
    # With `plan.references`: each reference picture [batch, H_i, W_i, 3] in [-1, 1] at its size in the plan
    references: tuple[jax.Array, ...] = ()


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Slots:
    """A running batch: every image slot with its own latents, solver state, schedule, step, guidance and key.

    Leading axis [batch] everywhere, except `cond` and `kv`, which interleave each slot's (uncond, cond)
    pair into [2 * batch] rows when guidance is on. A slot whose `step` has reached its
    `tables.num_loop_steps` is finished (or empty) and no longer changes.
    """

    x: jax.Array  # [batch, h, w, c] f32 latents
    state: schedulers.State
    tables: schedulers.Tables
    step: jax.Array  # [batch] i32: the slot's next loop step
    seeds: jax.Array  # [batch] uint32
    guidance_scale: jax.Array  # [batch] f32
    cond: Conditioning  # what the steps read besides the text (SDXL's pooled text and time ids); context None
    kv: ProjectedContext  # the text projected once for every cross-attention of the UNet, rows as cond's
    control: jax.Array | None = None  # [batch, H, W, 3] with `plan.control`, else None
    control_scale: jax.Array | None = None  # [batch] f32
    kept: modes.Inpainting | None = None  # inpainting: mask and picture latents the steps read
    control_kv: ProjectedContext | None = None  # with `plan.control`: the text projected for the ControlNet
    # with `plan.deep_cache` > 1: each UNet row's deep features from its last whole step, rows as `kv`'s
    deep: jax.Array | None = None


def _select(mask: jax.Array, new: jax.Array, old: jax.Array) -> jax.Array:
    """Per slot, `new` where mask else `old`; a [2 * batch] leaf (guidance pairs) repeats each slot's choice."""
    m = jnp.repeat(mask, new.shape[0] // mask.shape[0])
    return jnp.where(m.reshape(-1, *(1,) * (new.ndim - 1)), new, old)


def _fresh(plan: Plan, models: Models, new: Admission) -> Slots:
    cond = encode_prompts(models, new.ids, new.weights, new.extra, plan, False)
    if plan.guidance:  # guidance off: the unconditional half is never computed
        uncond = encode_prompts(models, new.neg_ids, new.neg_weights, new.extra, plan, True)
        cond = jax.tree.map(_pair, uncond, cond)
    family = FAMILIES[plan.family]
    denoiser = getattr(models, family.denoiser.component)
    config = denoiser.config
    if family.denoiser.guided_by_embedding(config):  # the scale is an input: traced, per slot
        w = family.denoiser.guidance_input(config, new.guidance_scale)
        cond = dataclasses.replace(cond, timestep_cond=_pair(w, w) if plan.guidance else w)
    noise = initial_latents(new.seeds, new.latents.shape[1:])
    noise = jnp.where(new.given[:, None, None, None], new.latents, noise)
    x, kept = noise * new.tables.init_noise_sigma[:, None, None, None], None
    if plan.mode != "txt2img":
        encode = functools.partial(family.latent.encode, models.vae)
        x, kept = modes.start(encode, new.source, noise, new.tables, plan.mode, _inpainting(family, models))
    state = jax.vmap(lambda row: schedulers.init_state(plan.scheduler, row))(x)
    step = jnp.zeros(x.shape[:1], jnp.int32)
    if plan.references:  # encoded once per request; the pair's rows read the same pictures
        refs = tuple(family.latent.encode(models.vae, pictures) for pictures in new.references)
        cond = dataclasses.replace(cond, references=tuple(_pair(r, r) for r in refs) if plan.guidance else refs)
    kv = family.denoiser.project(denoiser, cond)  # once per request, not once per step
    control_kv = models.controlnet.project_context(cond.context) if plan.control else None
    cond = dataclasses.replace(cond, context=None)  # no step reads it again: the slots hold it projected
    deep = None
    if plan.deep_cache > 1:  # filled at each slot's step 0, which always runs whole
        rows = x.shape[0] * (2 if plan.guidance else 1)
        deep = jnp.zeros(denoiser.deep_shape(rows, *x.shape[1:3]), denoiser.conv_in.kernel.dtype)
    return Slots(
        x,
        state,
        new.tables,
        step,
        new.seeds,
        new.guidance_scale,
        cond,
        kv,
        new.control,
        new.control_scale,
        kept,
        control_kv,
        deep,
    )


def _encoders_int8(graphdef: nnx.GraphDef, params: nnx.State) -> Models:
    """The networks with their int8 kernels widened, but for the layer and block lists that they widen themselves
    once each one's input exists (`nn.int8_weights.widened_blocks`: Qwen3's layers, the DiT denoisers' blocks).
    Widened all at once, Qwen3-4B's would take 12.7 GB of the prompt encoding's temporaries."""
    return nnx.merge(graphdef, dequantize(params, keep=widened_blocks(nnx.merge(graphdef, params))))


def empty_slots(plan: Plan, graphdef: nnx.GraphDef, params: nnx.State, new: Admission) -> Slots:
    """The shapes of a batch's slots (use under `jax.eval_shape`): what `admit` fills."""
    return _fresh(plan, _encoders_int8(graphdef, params), new)


def admit(plan: Plan, lanes: int, graphdef: nnx.GraphDef, params: nnx.State, slots: Slots, new: Admission) -> Slots:
    """Encodes the new requests' prompts and draws their noise into the masked slots; the others stay as they are.

    The text encoders run over the first `lanes` slots of each device, where the masked ones are.
    """
    new, old = take_lanes(new, plan, lanes), take_lanes(slots, plan, lanes)
    fresh = _fresh(plan, _encoders_int8(graphdef, params), new)
    return put_lanes(slots, jax.tree.map(lambda a, b: _select(new.mask, a, b), fresh, old), plan, lanes)


def advance(
    plan: Plan, lanes: int, graphdef: nnx.GraphDef, params: nnx.State, slots: Slots, num_steps: jax.Array
) -> tuple[Slots, jax.Array]:
    """Runs `num_steps` loop steps on every slot that has steps left; returns the slots and [batch] finiteness.

    Each slot is at its own step of its own schedule, so requests with different step counts, seeds and
    guidance scales share the UNet batch; the scheduler maths is the single-image function vmapped over
    slots. Only the first `lanes` slots of each device run. `num_steps` is traced: any chunk length runs the
    same program. Static: `plan` (shapes, scheduler kind, guidance on/off, clip_skip) and `lanes`. No host
    callback inside, so the persistent compilation cache keeps it. Int8 kernels (engine/loading/quantize.py) are
    widened inside each step, not once before the loop, which would hold the whole denoiser at full width; a DiT's
    blocks' one block at a time inside the step (`widened_blocks`: Z-Image's 6B widened whole would hold 24 GB), the rest of it (embedders, final layer) at its start.
    """
    models: Models = nnx.merge(graphdef, dequantize(params))
    kept = widened_blocks(models)
    full, slots = slots, take_lanes(slots, plan, lanes)
    kind, t, cond = plan.scheduler, slots.tables, slots.cond
    family = FAMILIES[plan.family]
    inpainting = _inpainting(family, models)
    keys = image_keys(slots.seeds)
    denoise = family.denoiser.denoise

    def body(_, carry):
        x, state, i, deep = carry
        models = nnx.merge(graphdef, dequantize(params, after=x, keep=kept))  # the same arrays without int8
        if plan.token_merging:  # on this traced copy of the network only
            getattr(models, family.denoiser.component).merge_tokens(plan.token_merging)
        active = i < t.num_loop_steps  # [batch]
        model_in = jax.vmap(lambda tab, j, row: schedulers.scale_model_input(kind, tab, j, row))(t, i, x)
        timesteps = jax.vmap(schedulers.timestep)(t, i)  # [batch]
        if plan.guidance:
            model_in, timesteps = _pair(model_in, model_in), _pair(timesteps, timesteps)
        model_in = pairs.split_batch(model_in)  # over a core pair, when there is one; the networks follow
        residuals = _control_residuals(plan, models, slots, model_in, timesteps, cond)  # on the 4 latent channels
        model_in = modes.unet_input(model_in, slots.kept, inpainting, 2 if plan.guidance else 1)
        if plan.deep_cache > 1:  # DeepCache: the first level alone where every running slot may reuse its features
            shallow = jnp.any(active) & jnp.all(~active | (i % plan.deep_cache != 0))

            def whole(deep):
                out, new = denoise(models, model_in, timesteps, slots.kv, cond, residuals, keep_deep=True)
                return out, new.astype(deep.dtype)

            def first_level(deep):
                return family.denoiser.denoise_shallow(models, model_in, timesteps, slots.kv, cond, deep), deep

            out, deep = jax.lax.cond(shallow, first_level, whole, deep)
        else:
            out = denoise(models, model_in, timesteps, slots.kv, cond, residuals)
        out = out.astype(jnp.float32)
        if plan.guidance:
            out = out.reshape(x.shape[0], 2, *x.shape[1:])  # [batch, (uncond, cond), h, w, c]
            g = slots.guidance_scale[:, None, None, None]
            out = out[:, 0] + g * (out[:, 1] - out[:, 0])
        if schedulers.stochastic(kind):  # fresh noise per step from the slot's own key: the same on any batch or device
            noise = jax.vmap(lambda k, j: jax.random.normal(jax.random.fold_in(k, j + 1), x.shape[1:], jnp.float32))(
                keys, i
            )
            new_x, new_state = jax.vmap(lambda *a: schedulers.step(kind, *a))(t, state, i, out, x, noise)
        else:
            new_x, new_state = jax.vmap(lambda *a: schedulers.step(kind, *a))(t, state, i, out, x)
        new_x = modes.blend(new_x, slots.kept, t, i, inpainting)
        keep = lambda a, b: _select(active, a, b)  # noqa: E731 - finished and empty slots stay as they are
        return keep(new_x, x), jax.tree.map(keep, new_state, state), i + active.astype(jnp.int32), deep

    x, state, step, deep = jax.lax.fori_loop(0, num_steps, body, (slots.x, slots.state, slots.step, slots.deep))
    changed = put_lanes(
        {"x": full.x, "state": full.state, "step": full.step, "deep": full.deep},
        {"x": x, "state": state, "step": step, "deep": deep},
        plan,
        lanes,
    )
    slots = dataclasses.replace(full, **changed)  # the rest (text, projected text, schedules) passes through
    return slots, jnp.all(jnp.isfinite(slots.x), axis=(1, 2, 3))


def _control_residuals(
    plan: Plan, models: Models, slots: Slots, model_in: jax.Array, timesteps: jax.Array, cond: Conditioning
) -> tuple:
    """The ControlNet's (down, mid) residuals for the UNet batch, as `StableDiffusionControlNetPipeline` adds
    them (guess_mode off, control_guidance_start/end 0 and 1: every step, both guidance halves); () without one.
    """
    if not plan.control:
        return ()
    image, scale = slots.control, slots.control_scale
    if plan.guidance:  # the same picture and scale for both halves of each slot's pair
        image, scale = _pair(image, image), _pair(scale, scale)
    return models.controlnet(model_in, timesteps, slots.control_kv, image, scale, cond.text_embeds, cond.time_ids)


def decode(plan: Plan, graphdef: nnx.GraphDef, params: nnx.State, x: jax.Array) -> jax.Array:
    """Latents -> images [batch, H, W, 3] in [0, 1], f32: the last of the three programs."""
    models: Models = nnx.merge(graphdef, dequantize(params))
    images = FAMILIES[plan.family].latent.decode(models.vae, pairs.split_rows(x))  # the format's own scaling
    return jnp.clip(images / 2 + 0.5, 0.0, 1.0)


def decode_lanes(
    plan: Plan, lanes: int, graphdef: nnx.GraphDef, params: nnx.State, x: jax.Array, checker: Any = None
) -> tuple[jax.Array, jax.Array]:
    """`decode` of each device's first `lanes` slots: images [devices * lanes, H, W, 3], and [devices * lanes]
    flags from the safety checker, in the same program (all False without one).

    `checker`: None, or (checker graphdef, checker params) with the graphdef static (engine/safety.py).
    """
    images = decode(plan, graphdef, params, take_lanes(x, plan, lanes))
    if checker is None:
        return images, jnp.zeros(images.shape[:1], bool)
    from ..models.safety import check  # the checker is optional: its module loads only where a model ships one

    checker_graphdef, checker_params = checker
    return images, check(checker_graphdef, checker_params, images).has_nsfw_concepts
