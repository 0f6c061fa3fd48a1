"""What a model family is, as data: the `Family` record, its tasks (`Variant`), and the values they pass.

A family (SD 1.x/2.x, SDXL; SD3 and FLUX.1 next) is one module in this folder that fills a `Family`:
which components a folder holds and which classes build them, how a prompt's token ids become the
denoiser's conditioning, how the denoiser is called, whether guidance is a second batch row or an
embedding, its latent format, its defaults, and the checks its folders must pass. A task
(text-to-image, inpainting) is a `Variant` of a family. The sampling programs and the loader ask
these records; no code outside `engine/families/` names a family.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import jax
from flax import nnx

from ..errors import InvalidRequest
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


jax.tree_util.register_dataclass(
    Conditioning, data_fields=["context", "text_embeds", "time_ids", "timestep_cond"], meta_fields=[]
)


@dataclass(frozen=True)
class LatentFormat:
    """How a family's latents look: their channels, the tiny autoencoder that decodes them in a blink.

    The scale and shift between the VAE's latents and the denoiser's come from the VAE's own config
    (`scaling_factor`, `shift_factor`, `latents_mean`/`latents_std`), which is the folder's truth.
    """

    channels: int
    tiny_vae: str  # the Hub id of the matching TAESD (madebyollin/taesd, taesdxl, ...)


def scale_embedding(config: Any, scale: jax.Array) -> jax.Array:
    """What a UNet guided by embedding reads (LCM, `time_cond_proj_dim`): `guidance_scale_embedding(scale - 1)`."""
    return guidance_scale_embedding(scale - 1.0, config.time_cond_proj_dim)


def no_extra_inputs(plan: Any, prompt: str, negative_prompt: str | None) -> dict:
    return {}


# The signature every family's `encode` has: (models, token ids, extra inputs, plan, negative) -> Conditioning.
# `plan` is the sampling program's static `Plan`; an encoder reads its `clip_skip`.
Encode = Callable[[Models, jax.Array, dict, Any, bool], Conditioning]


@dataclass(frozen=True, eq=False)
class Family:
    """One model family. Identity equality: there is one record per family (`engine.families.FAMILIES`)."""

    name: str  # the registry key; also what `Plan.family`, `Variant.family` and the engine's `family` hold
    pipelines: tuple[str, ...]  # model_index.json `_class_name`s of this family (every task)
    configs: Mapping[str, type]  # component sub-folder -> its config class, in load order
    text_encoders: tuple[str, ...]  # the text encoders' sub-folders, in the order they run
    tokenizers: tuple[str, ...]
    encode: Encode = field(repr=False)
    # (configs by component, rngs) -> the networks by component name, built from shapes alone
    build: Callable[[Mapping[str, Any], nnx.Rngs], dict[str, nnx.Module]] = field(repr=False)
    # (models, latents, timesteps, projected text, conditioning, control residuals) -> the noise prediction
    denoise: Callable[..., jax.Array] = field(repr=False)
    latent: LatentFormat
    defaults: Mapping[str, Any]  # num_inference_steps, guidance_scale, scheduler (a folder's scheduler comes first)
    max_side: int  # pixels: twice the side the family was trained at
    # "batch": classifier-free guidance as an unconditional second row per image (at scale > 1);
    # "embedding": the denoiser reads the scale (`guidance_scale_embedding(scale - 1)` as its `timestep_cond`) and
    # no unconditional row is ever computed (LCM). See `guided_by_embedding`.
    guidance: str = "batch"
    # (denoiser config, guidance scale [batch] f32) -> `Conditioning.timestep_cond`, for a model guided by embedding
    guidance_input: Callable[[Any, jax.Array], jax.Array] = field(default=scale_embedding, repr=False)
    # The component the denoising steps call and whose text projections `admit` holds: the UNet here, a
    # transformer in the MMDiT families. Its config names its `in_channels`; it has `project_context`.
    denoiser: str = "unet"
    # (configs by component, where) -> None, or ConfigError naming what disagrees
    check_layout: Callable[[Mapping[str, Any], str], None] = field(default=lambda configs, where: None, repr=False)
    # (model_index.json, vae_scale_factor, the folder or None, the host encoder or None) -> the folder's
    # (plan, prompt, negative_prompt) -> per-image inputs besides CLIP token ids, batch first (SDXL: time ids, and
    # whether no negative prompt means zero embeddings; SD3, FLUX.1: both prompts' T5 token ids, or their T5
    # embeddings when T5 runs on the host)
    extra_inputs: Callable[[Mapping[str, Any], int, Any, Any], Callable[[Any, str, str | None], dict]] = field(
        default=lambda index, vae_scale_factor, folder, host: no_extra_inputs, repr=False
    )
    # The T5 encoder's component, which `load_pipeline(t5=)` keeps on the host or leaves out; None: no T5
    t5_encoder: str | None = None
    # Components a folder of this family may leave out (model_index.json [null, null]): SD3 without T5
    optional: frozenset[str] = frozenset()
    # False: the CLIP encoders read a prompt's first 77 tokens as they are, one chunk and no emphasis, as diffusers'
    # pipelines with a T5 encoder do (the T5 reads the long prompt); True: A1111's chunks and emphasis
    chunked_prompts: bool = True
    # (configs by component) -> defaults a model's own config decides (FLUX.1: dev's guidance or schnell's none)
    config_defaults: Callable[[Mapping[str, Any]], Mapping[str, Any]] = field(default=lambda configs: {}, repr=False)
    # Whether requests may skip CLIP's last layers (`clip_skip`); False where the pipeline reads only a pooled vector
    clip_skip: bool = True
    # Generation defaults of a Turbo (adversarially distilled) folder of this family
    turbo_defaults: Mapping[str, Any] = field(
        default_factory=lambda: MappingProxyType({"num_inference_steps": 1, "guidance_scale": 0.0})
    )
    # The flow schedule FluxPipeline asks for: sigmas linspace(1, 1/n, n) (`schedulers.tables(uniform_sigmas=)`)
    uniform_sigmas: bool = False
    # What can be attached to a model of this family: "lora", "controlnet" (refused by name elsewhere)
    adapters: frozenset[str] = frozenset({"lora", "controlnet"})
    # DeepCache (`Plan.deep_cache`): (models, latents, timesteps, projected text, conditioning, deep features) -> the
    # noise prediction from the denoiser's first level, the deep features those of an earlier whole step, which
    # `denoise(..., keep_deep=True)` returns beside its prediction; None: the denoiser has no such levels
    denoise_shallow: Callable[..., jax.Array] | None = field(default=None, repr=False)

    def guided_by_embedding(self, unet: Any) -> bool:
        """Whether a model of this family with this UNet config reads the guidance scale as an embedding rather than
        taking a second, unconditional row: a family guided by embedding, or a UNet with `time_cond_proj_dim`,
        which diffusers' SD and SDXL pipelines also feed that way (`do_classifier_free_guidance` is off for it)."""
        return self.guidance == "embedding" or getattr(unet, "time_cond_proj_dim", None) is not None


@dataclass(frozen=True)
class Variant:
    """One task of a family: what the denoiser was trained for and the picture inputs it needs."""

    family: str  # `Family.name`
    task: str  # "text-to-image" | "inpainting"
    label: str  # for people
    pipelines: tuple[str, ...]  # model_index.json `_class_name`s saved for this variant
    text_encoders: tuple[str, ...]  # sub-folders, in the order the encoders run
    tokenizers: tuple[str, ...]
    unet_in_channels: int  # the denoiser's input channels: 4 latents; 9 latents, mask and masked-picture latents
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


def variants(
    family: Family, label: str, text_to_image: tuple[str, ...], inpainting: tuple[str, ...], strengths: tuple
) -> tuple[Variant, Variant]:
    """A family's two tasks: text-to-image (4-channel UNet) and inpainting (9 channels: latents, mask, picture).

    strengths: (img2img, inpaint with a text-to-image model, inpainting model), as the family's diffusers pipelines.
    """
    common = dict(
        text_encoders=family.text_encoders,
        tokenizers=family.tokenizers,
        max_side=family.max_side,
        defaults=MappingProxyType(dict(family.defaults)),
    )
    img2img, inpaint, inpainting_model = strengths
    return (
        Variant(
            family.name,
            "text-to-image",
            label,
            text_to_image,
            unet_in_channels=4,
            **common,
            strength=img2img,
            inpaint_strength=inpaint,
        ),
        Variant(
            family.name,
            "inpainting",
            f"{label} Inpainting",
            inpainting,
            unet_in_channels=9,
            **common,
            strength=inpainting_model,
            inpaint_strength=inpainting_model,
            needs=frozenset({"image", "mask_image"}),
        ),
    )
