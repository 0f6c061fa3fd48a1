"""What a model family is, as data: the `Family` record, its parts, its tasks (`Variant`), and the values they pass.

A family is one module in this folder that fills a `Family`: which components a folder holds, which classes build
them and what must agree between them, and four parts, each a small frozen record with one purpose:

- `TextSide`: the text encoders and tokenizers, how a prompt's ids (and the extra inputs a request brings: T5 ids,
  a decoder LM's ids and mask) become the denoiser's `Conditioning`, which encoder may run on the host;
- `Denoiser`: the component the steps call, its call, its first level alone (DeepCache), guidance as a second
  batch row or an embedding, how the text is projected once per request, what can be attached;
- `LatentFormat`: the latents the steps draw, their widths read from the VAE's config, how the denoiser's input
  channels relate to them (plain, or patches it packs; inpainting's extra channels), and their own scaling or
  normalisation on the way in and out of the VAE;
- `Sampling`: generation defaults (a Turbo folder's, a config's own), the largest side, the flow schedule.

Families that share a part share the object (SD's CLIP text side, SD3's and FLUX.1's T5 helpers). A task
(text-to-image, inpainting) is a `Variant` of a family, told from the folder's widths (`LatentFormat.task`). The
sampling programs and the loader ask these records; no code outside `engine/families/` names a family.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ..errors import InvalidRequest
from ..loading.host_encoder import host_t5
from ..nn.layers import guidance_scale_embedding


class Models(nnx.Module):
    """Every network of a pipeline in one module, so that one `nnx.split` gives one param tree.

    The attributes are the folder's component names (`text_encoder`, `unet`, `vae`, ...), so the param
    tree's paths are the diffusers key paths with the component in front. A ControlNet, when a server
    loads one, joins later as `controlnet` (`loading.controlnet.attach_controlnet`).
    """

    def __init__(self, **components: nnx.Module):
        for name, module in components.items():
            setattr(self, name, module)


@dataclass(frozen=True)
class Conditioning:
    """What the denoiser is conditioned on, for a batch of prompts."""

    context: jax.Array | None  # [batch, tokens, cross_attention_dim]; None in Slots, which hold it projected
    text_embeds: jax.Array | None = None  # pooled text embedding [batch, d] (SDXL)
    time_ids: jax.Array | None = None  # [batch, 6] micro-conditioning (SDXL)
    # [batch, time_cond_proj_dim]: the guidance scale's embedding, for a family guided by embedding (LCM)
    timestep_cond: jax.Array | None = None
    # [batch, tokens] bool: which of the context's tokens are the prompt's, for a text side whose prompts have
    # lengths of their own (a decoder LM's padded chat); None: every token is read
    context_mask: jax.Array | None = None
    # The reference pictures' latents as the family's latent format encodes them (`LatentFormat.encode`), batch
    # first, which a denoiser that edits reads as tokens beside the latents'; None: no reference pictures
    references: jax.Array | None = None


jax.tree_util.register_dataclass(
    Conditioning,
    data_fields=["context", "text_embeds", "time_ids", "timestep_cond", "context_mask", "references"],
    meta_fields=[],
)


def scale_embedding(config: Any, scale: jax.Array) -> jax.Array:
    """What a UNet guided by embedding reads (LCM, `time_cond_proj_dim`): `guidance_scale_embedding(scale - 1)`."""
    return guidance_scale_embedding(scale - 1.0, config.time_cond_proj_dim)


def no_extra_inputs(plan: Any, prompt: str, negative_prompt: str | None) -> dict:
    return {}


def none_extra(index: Mapping[str, Any], vae_scale_factor: int, folder: Any, host: Any) -> Callable:
    return no_extra_inputs


def project_context(denoiser: Any, cond: Conditioning) -> Any:
    """The text as the denoiser's attentions read it, once per request (its `project_context`)."""
    return denoiser.project_context(cond.context)


# The signature every text side's `encode` has: (models, token ids, extra inputs, plan, negative) -> Conditioning.
# `plan` is the sampling program's static `Plan`; an encoder reads its `clip_skip`.
Encode = Callable[[Models, jax.Array, dict, Any, bool], Conditioning]
# (model_index.json, vae_scale_factor, the folder or None, the host encoder or None) -> the folder's
# (plan, prompt, negative_prompt) -> per-image inputs besides the tokenizers' ids, batch first
ExtraInputs = Callable[[Mapping[str, Any], int, Any, Any], Callable[[Any, str, str | None], dict]]


@dataclass(frozen=True)
class PromptFit:
    """How a request's prompts fit a text side's own tokenizer (`TextSide.fit_prompts`): the length both are padded
    to where the side pads to one of a few (Z-Image: `Plan.text_tokens`; 0: its one length), and a line for each
    prompt cut short, saying what the cut dropped (the ticket's notes)."""

    length: int = 0
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class TextSide:
    """How a prompt becomes the denoiser's conditioning: the encoders, their tokenizers, the encoding.

    `tokenizers` are the `loading.Tokenizer` (CLIP) ones whose ids `encode` gets in its `ids` (one row per
    tokenizer); a prompt read by another kind of tokenizer (T5, a decoder LM's chat template) travels in the
    extra inputs, ids and mask, which `extra_inputs` makes on the host per request.
    """

    encoders: tuple[str, ...]  # the sub-folders of the encoders that read `tokenizers`' ids, in the order they run
    tokenizers: tuple[str, ...]
    encode: Encode = field(repr=False)
    # SDXL: time ids, and whether no negative prompt means zero embeddings; SD3, FLUX.1: both prompts' T5 token ids,
    # or their T5 embeddings when T5 runs on the host
    extra_inputs: ExtraInputs = field(default=none_extra, repr=False)
    # The large encoder's component (T5; a decoder LM), which `load_model_folder(t5=)` keeps on the host or leaves
    # out, and how the host runs it: (component, config, its tensors, dtype, where, int8=) -> `loading.host_encoder`'s
    host_encoder: str | None = None
    on_host: Callable[..., Any] = field(default=host_t5, repr=False)
    # False: the CLIP encoders read a prompt's first 77 tokens as they are, one chunk and no emphasis, as diffusers'
    # pipelines with a T5 encoder do (the T5 reads the long prompt); True: A1111's chunks and emphasis
    chunked_prompts: bool = True
    # Whether requests may skip CLIP's last layers (`clip_skip`); False where the pipeline reads only a pooled vector
    clip_skip: bool = True
    # A text side whose own tokenizer reads the prompts in the extra inputs (T5, Qwen3's chat template): from the
    # folder, (prompt, negative prompt or None when unguided) -> how they fit (`PromptFit`); the folder's hook may be
    # None (T5 left out). None: nothing to measure (CLIP's own chunks say what they hold).
    fit_prompts: Callable[[Any], Callable[[str, str | None], PromptFit] | None] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class References:
    """How a denoiser that edits takes reference pictures (`GenerationRequest.references`): the contract between a
    request's pictures and the family's `denoise`.

    On the host (`serving.jobs`), each picture is drawn at `Limits.reference_size` (width, height: at most `pixels`,
    sides multiples of one token's pixels) by `prepare`, the family pipeline's own resize or crop, as [height, width,
    3] float32 in [-1, 1]. The references' sizes, in order, are static (`Plan.references`): requests bringing the same
    count and sizes share a batch, others get a plan of their own, and none recompiles per request. On a server with
    fixed sizes, the sizes are the nearest of a bounded set (`request_references.reference_shapes`: `resolutions`, or
    the offered sizes within `pixels`) and the picture reaches `prepare` resized to it, so a family writes no rule
    of its own for that. In `admit`, each
    is encoded by the family's `LatentFormat.encode` inside the program, and `Conditioning.references` holds a tuple of
    latent grids [rows, h_i, w_i, channels], one per reference in the request's order, rows as the slots' conditioning
    (each slot's (uncond, cond) pair when guided; an empty slot's are zeros). `denoise` reads them: the family decides
    their tokens and position ids (FLUX.2 [klein]: after the latent's, at times 10, 20, ...) and returns the
    prediction on the latent's grid only.
    """

    max_count: int  # the most reference pictures a request may bring (`Limits.max_references`)
    # (picture, width, height) -> [height, width, 3] float32 in [-1, 1]: the picture as the family's pipeline encodes it
    prepare: Callable[[Any, int, int], Any] = field(repr=False)
    pixels: int = 1024 * 1024  # a larger picture is shrunk to about this many (`Limits.reference_pixels`)
    min_count: int = 0  # the fewest a request may bring: a model that only edits (`Limits.min_references`)
    # (width, height) sizes a picture is drawn at instead, the one nearest its aspect (`Limits.reference_resolutions`)
    resolutions: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Denoiser:
    """The network the steps call: which component, how it is called, how guidance reaches it, what attaches."""

    # The component whose text projections `admit` holds: the UNet, or an MMDiT's transformer. Its config names
    # its `in_channels`.
    component: str
    # (models, latents, timesteps, projected text, conditioning, control residuals) -> the noise prediction
    denoise: Callable[..., jax.Array] = field(repr=False)
    # DeepCache (`Plan.deep_cache`): (models, latents, timesteps, projected text, conditioning, deep features) -> the
    # noise prediction from the denoiser's first level, the deep features those of an earlier whole step, which
    # `denoise(..., keep_deep=True)` returns beside its prediction; None: the denoiser has no such levels
    denoise_shallow: Callable[..., jax.Array] | None = field(default=None, repr=False)
    # "batch": classifier-free guidance as an unconditional second row per image (at scale > 1);
    # "embedding": the denoiser reads the scale (as its `timestep_cond`) and no unconditional row is ever computed
    # (LCM, FLUX.1 dev). See `guided_by_embedding`.
    guidance: str = "batch"
    # (denoiser config, guidance scale [batch] f32) -> `Conditioning.timestep_cond`, for a model guided by embedding
    guidance_input: Callable[[Any, jax.Array], jax.Array] = field(default=scale_embedding, repr=False)
    # (the denoiser, conditioning) -> the text as its attentions read it, held per slot (`Slots.kv`)
    project: Callable[[Any, Conditioning], Any] = field(default=project_context, repr=False)
    # What can be attached to a model of this family: "lora", "controlnet" (refused by name elsewhere)
    adapters: frozenset[str] = frozenset({"lora", "controlnet"})
    # Reference pictures the denoiser reads beside the latents (a model that edits); None: it takes none
    references: References | None = None
    # Which of its kernels `--quantize w8a8` computes in int8, by a kernel's path below the component (the others stay
    # float: the ends, the modulations); None: not offered (refused at load with what to start with instead)
    w8a8: Callable[[tuple[str, ...]], bool] | None = field(default=None, repr=False)

    def guided_by_embedding(self, config: Any) -> bool:
        """Whether a denoiser with this config reads the guidance scale as an embedding rather than taking a
        second, unconditional row: one guided by embedding, or a UNet with `time_cond_proj_dim`, which diffusers'
        SD and SDXL pipelines also feed that way (`do_classifier_free_guidance` is off for it)."""
        return self.guidance == "embedding" or getattr(config, "time_cond_proj_dim", None) is not None


def scaled_encode(vae: Any, images: jax.Array) -> jax.Array:
    """Pictures [batch, H, W, 3] in [-1, 1] -> the denoiser's latents: the posterior's mean
    (`retrieve_latents(..., sample_mode="argmax")`) moved and scaled as the VAE's config says."""
    mean, _ = vae.encode(images)
    cfg = vae.config
    if cfg.latents_mean is not None and cfg.latents_std is not None:  # as diffusers' SDXL pipelines
        return (mean - jnp.asarray(cfg.latents_mean)) * cfg.scaling_factor / jnp.asarray(cfg.latents_std)
    if cfg.shift_factor is not None:
        return (mean - cfg.shift_factor) * cfg.scaling_factor
    return mean * cfg.scaling_factor


def scaled_decode(vae: Any, x: jax.Array) -> jax.Array:
    """The denoiser's latents -> pictures [batch, H, W, 3] in about [-1, 1]: `scaled_encode`'s inverse, decoded."""
    cfg = vae.config
    if cfg.latents_mean is not None and cfg.latents_std is not None:  # as diffusers' SDXL pipeline
        x = x * jnp.asarray(cfg.latents_std) / cfg.scaling_factor + jnp.asarray(cfg.latents_mean)
    elif cfg.shift_factor is not None:
        x = x / cfg.scaling_factor + cfg.shift_factor
    else:
        x = x / cfg.scaling_factor
    return vae.decode(x)


TASKS = ("text-to-image", "inpainting")


@dataclass(frozen=True)
class LatentFormat:
    """The latents the steps draw, as the folder's configs say them, and how the denoiser reads them.

    Widths come from the configs, not from here: the steps' latents have the VAE's `latent_channels` (times
    `vae_patch`'s square where the format packs VAE patches, FLUX.2), and the denoiser's `in_channels` says its task
    relative to them: the latents' channels (times `denoiser_patch`'s square where the denoiser packs patches itself,
    FLUX.1) for text-to-image; twice as many plus one (latents, mask, masked picture) for inpainting.
    """

    tiny_vae: str  # the Hub id of the matching TAESD (madebyollin/taesd, taesdxl, ...)
    # Latent pixels per side of one input vector of the denoiser, which packs them itself (FLUX.1: 2)
    denoiser_patch: int = 1
    # Whether the family has an inpainting denoiser (its input: latents, mask and the masked picture's latents)
    inpainting: bool = False
    # VAE latent pixels per side the format packs into one latent of the steps before its normalisation (FLUX.2: 2)
    vae_patch: int = 1
    # (vae, pictures in [-1, 1]) -> the steps' latents, and back: the format's own scaling or normalisation
    encode: Callable[[Any, jax.Array], jax.Array] = field(default=scaled_encode, repr=False)
    decode: Callable[[Any, jax.Array], jax.Array] = field(default=scaled_decode, repr=False)

    def channels(self, vae_config: Any) -> int:
        """Channels of the steps' latents for this VAE."""
        return vae_config.latent_channels * self.vae_patch**2

    def scale_factor(self, vae_config: Any) -> int:
        """Picture pixels per side of one latent of the steps."""
        return vae_config.vae_scale_factor * self.vae_patch

    def task(self, in_channels: int, vae_config: Any) -> str | None:
        """The task of a denoiser reading `in_channels` over this VAE's latents; None when it fits none."""
        per_token = self.denoiser_patch**2
        latents = self.channels(vae_config)
        if in_channels == per_token * latents:
            return "text-to-image"
        if self.inpainting and in_channels == per_token * (2 * latents + 1):
            return "inpainting"
        return None

    def vae_channels(self, in_channels: int, task: str) -> int:
        """The VAE latent channels a denoiser reading `in_channels` for `task` draws: what a VAE given in place of
        the folder's must have."""
        latents = in_channels // self.denoiser_patch**2
        if task == "inpainting":
            latents = (latents - 1) // 2
        return latents // self.vae_patch**2

    def widths(self, vae_config: Any) -> str:
        """The input widths this format's tasks take over this VAE, for a refusal."""
        per_token, latents = self.denoiser_patch**2, self.channels(vae_config)
        said = [f"text-to-image ({per_token * latents})"]
        if self.inpainting:
            said.append(f"inpainting ({per_token * (2 * latents + 1)})")
        return " or ".join(said)


@dataclass(frozen=True)
class Sampling:
    """A family's generation defaults and the schedule its pipelines ask for."""

    defaults: Mapping[str, Any]  # num_inference_steps, guidance_scale, scheduler (a folder's scheduler comes first)
    max_side: int  # pixels: twice the side the family was trained at
    # (configs by component) -> defaults a model's own config decides (FLUX.1: dev's guidance or schnell's none)
    config_defaults: Callable[[Mapping[str, Any]], Mapping[str, Any]] = field(default=lambda configs: {}, repr=False)
    # Generation defaults of a Turbo (adversarially distilled) folder of this family
    turbo_defaults: Mapping[str, Any] = field(
        default_factory=lambda: MappingProxyType({"num_inference_steps": 1, "guidance_scale": 0.0})
    )
    # (the folder's scheduler config) -> whether it is this family's Turbo schedule, for a family whose Turbo differs
    # from its base model in the scheduler alone (Z-Image-Turbo: a static shift of 3, the base model's 6)
    turbo_schedule: Callable[[Any], bool] = field(default=lambda scheduler: False, repr=False)
    # The flow schedule FluxPipeline asks for: sigmas linspace(1, 1/n, n) (`schedulers.tables(uniform_sigmas=)`)
    uniform_sigmas: bool | str = False  # or "torch": torch.linspace's sigmas, as ZImagePipeline computes them
    # (image tokens, steps) -> the flow schedule's dynamic shift where the pipeline computes it itself (FLUX.2
    # [klein]: `compute_empirical_mu`, `schedulers.tables(mu=)`); None: the scheduler config's `calculate_shift`
    shift: Callable[[int, int], float] | None = field(default=None, repr=False)
    # (model_index.json) -> whether the folder is step-distilled and takes no guidance whatever the scale, as its
    # pipeline ignores it (FLUX.2 [klein]'s `is_distilled`); such a folder gets `turbo_defaults`
    distilled: Callable[[Mapping[str, Any]], bool] = field(default=lambda index: False, repr=False)


def no_layout_check(configs: Mapping[str, Any], where: str) -> None:
    return None


def every_tensor(component: str, config: Any, tensors: dict[str, Any]) -> dict[str, Any]:
    return tensors


@dataclass(frozen=True, eq=False)
class Family:
    """One model family: its folders' components and four parts. Identity equality: there is one record per family
    (`engine.families.FAMILIES`); parts that families share are one object (`sd.CLIP_TEXT`, `sd3.flow_sampling`)."""

    name: str  # the registry key; also what `Plan.family`, `Variant.family` and the engine's `family` hold
    pipelines: tuple[str, ...]  # model_index.json `_class_name`s of this family (every task)
    configs: Mapping[str, type]  # component sub-folder -> its config class, in load order
    # (configs by component, rngs) -> the networks by component name, built from shapes alone
    build: Callable[[Mapping[str, Any], nnx.Rngs], dict[str, nnx.Module]] = field(repr=False)
    text: TextSide
    denoiser: Denoiser
    latent: LatentFormat
    sampling: Sampling
    # (configs by component, where) -> None, or ConfigError naming what disagrees
    check_layout: Callable[[Mapping[str, Any], str], None] = field(default=no_layout_check, repr=False)
    # Components a folder of this family may leave out (model_index.json [null, null]): SD3 without T5
    optional: frozenset[str] = frozenset()
    # (component, its config, its checkpoint's tensors) -> the tensors its built network loads: a decoder LM built up
    # to the last layer read leaves the later layers and its `lm_head` out (FLUX.2 [klein]'s Qwen3ForCausalLM)
    tensors: Callable[[str, Any, dict[str, Any]], dict[str, Any]] = field(default=every_tensor, repr=False)


@dataclass(frozen=True)
class Variant:
    """One task of a family: what the denoiser was trained for and the picture inputs it needs."""

    family: str  # `Family.name`
    task: str  # "text-to-image" | "inpainting" (`LatentFormat.task` tells a folder's from its widths)
    label: str  # for people
    pipelines: tuple[str, ...]  # model_index.json `_class_name`s saved for this variant
    text_encoders: tuple[str, ...]  # sub-folders, in the order the encoders run
    tokenizers: tuple[str, ...]
    max_side: int  # pixels: twice the side the family was trained at
    defaults: MappingProxyType = field(compare=False)  # num_inference_steps, guidance_scale, scheduler
    strength: float  # image-to-image default, as the family's diffusers img2img pipeline
    inpaint_strength: float  # inpainting default, as the family's diffusers inpaint pipeline
    needs: frozenset[str] = frozenset()  # picture inputs a request must bring

    def check(self, image: Any, mask_image: Any) -> None:
        """The picture inputs this model can use; the message says what to change."""
        given = {name for name, value in (("image", image), ("mask_image", mask_image)) if value is not None}
        missing = sorted(self.needs - given)
        if missing:
            raise InvalidRequest(
                f"this {self.label} model repaints part of a picture: give {' and '.join(missing)} "
                "(white in the mask is repainted)"
            )

    def default_strength(self, mask_image: Any) -> float:
        return self.inpaint_strength if mask_image is not None else self.strength


def text_to_image(family: Family, label: str, pipelines: tuple[str, ...], strength: float, inpaint: float) -> Variant:
    """A family's text-to-image task (image-to-image and inpainting by blending use the same model).

    strength, inpaint: the defaults of the family's diffusers img2img and inpaint pipelines."""
    return Variant(
        family.name,
        "text-to-image",
        label,
        pipelines,
        text_encoders=family.text.encoders,
        tokenizers=family.text.tokenizers,
        max_side=family.sampling.max_side,
        defaults=MappingProxyType(dict(family.sampling.defaults)),
        strength=strength,
        inpaint_strength=inpaint,
    )


def variants(
    family: Family, label: str, text_to_image_pipelines: tuple[str, ...], inpainting: tuple[str, ...], strengths: tuple
) -> tuple[Variant, Variant]:
    """A family's two tasks: text-to-image and inpainting (a denoiser reading latents, mask and picture).

    strengths: (img2img, inpaint with a text-to-image model, inpainting model), as the family's diffusers pipelines.
    """
    img2img, inpaint, inpainting_model = strengths
    plain = text_to_image(family, label, text_to_image_pipelines, img2img, inpaint)
    return plain, dataclasses.replace(
        plain,
        task="inpainting",
        label=f"{label} Inpainting",
        pipelines=inpainting,
        strength=inpainting_model,
        inpaint_strength=inpainting_model,
        needs=frozenset({"image", "mask_image"}),
    )
