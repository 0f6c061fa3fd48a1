"""A diffusers-format folder -> configs, tokenizers, scheduler config and one param tree on the host.

The family comes from `model_index.json`'s `_class_name` (`family_of`); the family's record says which
components to read, which classes build them and what must agree between them. Generation defaults
follow the family, and Turbo (few-step, guidance-free) folders get the family's Turbo defaults. A component the
family marks optional (SD3's T5) may be missing: model_index.json names it [null, null], as diffusers saves a
pipeline without it.

An optional `jax_sd.json` beside `model_index.json` carries generation defaults and example
prompts for a model (the embedded default uses it); diffusers ignores that file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from ..errors import ConfigError, SourceError
from ..loading.quantize import int8_components, streaming
from ..loading.sources import ModelFolder, resolve
from ..loading.textual_inversion import NO_EMBEDDINGS, Embeddings
from ..loading.tokenizer import Tokenizer
from ..loading.vae import OWN_VAE
from ..loading.weights import convert, read_safetensors, rename_legacy
from ..models.config import AutoencoderTinyConfig, VAEConfig
from ..schedulers import SCHEDULERS, SchedulerConfig
from . import FAMILIES, PIPELINE_FAMILIES, family_of, find
from .base import Family, Models, PromptFit, Variant, no_extra_inputs
from .single_file import is_single_file, open_single_file
from .transformer_file import is_transformer_file, open_transformer_file


@dataclass
class LoadedModel:
    name: str
    family: str  # `Family.name`; the record is `engine.families.FAMILIES[family]`
    variant: Variant
    graphdef: nnx.GraphDef
    params: nnx.State  # host numpy arrays in the run dtype
    denoiser_config: Any  # the denoiser's config (`Denoiser.component`): a `UNetConfig`, an MMDiT transformer's
    vae_config: VAEConfig | AutoencoderTinyConfig  # the folder's own, or the one given (`loading.vae.attach_vae`)
    scheduler_config: SchedulerConfig
    tokenizers: list[Tokenizer]  # one per text encoder
    defaults: dict[str, Any]
    label: str = ""  # for people: "Stable Diffusion XL Turbo"
    example_prompts: list[str] = field(default_factory=list)
    max_clip_skip: int = 0
    # The family's per-image inputs besides token ids, from the plan and the negative prompt (None: none at all).
    extra_inputs: Callable[[Any, str, str | None], dict] = no_extra_inputs
    controlnet: str | None = None  # the ControlNet's source, when one is attached (`controlnet.attach_controlnet`)
    vae: str = OWN_VAE  # which VAE draws: the folder's own, or the source given (`loading.vae.attach_vae`)
    # A single file's configs, tokenizers and scheduler (`single_file.open_single_file`); None for a folder
    config_folder: ModelFolder | None = None
    # Textual inversion embeddings in the text encoders' tables (`loading.textual_inversion.attach_embeddings`)
    embeddings: Embeddings = NO_EMBEDDINGS
    # Whether the model takes classifier-free guidance: not a step-distilled folder's (`Sampling.distilled`)
    guided: bool = True
    # (prompt, negative prompt or None) -> how they fit the text side's own tokenizer (`TextSide.fit_prompts`)
    fit_prompts: Callable[[str, str | None], PromptFit] | None = None

    @property
    def vae_scale_factor(self) -> int:
        """Picture pixels per side of one latent of the steps (`LatentFormat.scale_factor`)."""
        return FAMILIES[self.family].latent.scale_factor(self.vae_config)

    @property
    def tiny_vae(self) -> bool:
        """The VAE is a tiny autoencoder (TAESD): decoding costs little, so previews are decoded pictures."""
        return isinstance(self.vae_config, AutoencoderTinyConfig)

    @property
    def unet_latent_channels(self) -> int:
        """The VAE latent channels the denoiser draws, from its input width and task (`LatentFormat.vae_channels`):
        what a VAE given in place of the folder's must have."""
        latent = FAMILIES[self.family].latent
        return latent.vae_channels(self.denoiser_config.in_channels, self.variant.task)

    @property
    def patch_size(self) -> int:
        """Latent pixels per side of one denoiser token (an MMDiT's patch; 1 for a UNet): picture sides are multiples
        of it times the VAE's factor, and a flow schedule's dynamic shift counts the tokens."""
        config = self.denoiser_config
        return getattr(config, "latent_patch_size", None) or getattr(config, "patch_size", 1)

    @property
    def latent_channels(self) -> int:
        """Channels of the latents the steps draw (an inpainting UNet reads more: mask and masked picture)."""
        return FAMILIES[self.family].latent.channels(self.vae_config)

    def tokenize(self, text: str, what: str = "prompt") -> tuple[np.ndarray, list[str]]:
        """ids [1, 77] with one tokenizer, [1, tokenizers, 77] with several (SDXL), one placeholder [1, 1] with none
        (a text side whose prompt travels in its extra inputs; `prompts.tokenize_plain`)."""
        if not self.tokenizers:
            return np.zeros((1, 1), np.int32), []
        rows, warnings = [], []
        for tokenizer in self.tokenizers:
            ids, notes = tokenizer(text, what)
            rows.append(ids)
            warnings += [note for note in notes if note not in warnings]  # both cut at 77 tokens: say it once
        return (rows[0] if len(rows) == 1 else np.stack(rows, axis=1)), warnings


def is_turbo(folder: ModelFolder, scheduler: SchedulerConfig, family: Family) -> bool:
    """Turbo folders ship a "trailing" schedule (zero-SNR models do too, with many steps; not those), or the one
    their family's Turbo has (`Sampling.turbo_schedule`)."""
    trailing = scheduler.timestep_spacing == "trailing" and not scheduler.rescale_betas_zero_snr
    return trailing or "turbo" in folder.name.lower() or family.sampling.turbo_schedule(scheduler)


def _defaults(
    folder: ModelFolder, family: Family, variant: Variant, configs: dict, vae: VAEConfig, scheduler: SchedulerConfig
) -> tuple[dict, list[str]]:
    denoiser = configs[family.denoiser.component]
    side = (getattr(denoiser, "sample_size", None) or 64) * vae.vae_scale_factor
    defaults = {"height": side, "width": side, **variant.defaults, **family.sampling.config_defaults(configs)}
    if scheduler.default_kind in SCHEDULERS:
        defaults["scheduler"] = scheduler.default_kind
    if is_turbo(folder, scheduler, family) or family.sampling.distilled(folder.index):
        defaults.update(family.sampling.turbo_defaults)
    extra_path = folder.root / "jax_sd.json"
    extra = json.loads(extra_path.read_text()) if extra_path.is_file() else {}
    defaults.update(
        {
            k: v
            for k, v in extra.items()
            if k in ("num_inference_steps", "guidance_scale", "height", "width", "scheduler")
        }
    )
    return defaults, list(extra.get("example_prompts", []))


def folder_family(folder: ModelFolder) -> Family:
    """The family of a folder's model_index.json class; a class we do not have is refused by name."""
    family = family_of(folder.class_name)
    if family is None:
        known = ", ".join(PIPELINE_FAMILIES)
        raise SourceError(f"{folder.name}: model type {folder.class_name!r} is not supported (supported: {known})")
    return family


T5_PLACES = ("device", "host", "off")


def load_model_folder(
    source: str | Path | None,
    dtype: str,
    t5: str = "device",
    config: str | Path | None = None,
    prediction_type: str | None = None,
    safety_checker: bool = False,
    quantize: str | None = None,
) -> LoadedModel:
    """`t5`: where a family's T5 encoder runs (`TextSide.host_encoder`): "device" with the other networks, "host" on the
    CPU once per request (`loading.host_encoder`), or "off" (left out: zeros in its place, where the family allows
    it, as diffusers without it). Families without T5 ignore it.

    A single-file checkpoint (`single_file.open_single_file`; FLUX.1's, SD3's, Z-Image's and FLUX.2's transformer
    files and GGUFs, `transformer_file.open_transformer_file`) takes its configs from `config` (a diffusers folder or
    Hub id) or the Hub repo of its kind (and a transformer file its text encoders and VAE too, unless it holds them),
    its prediction type from `prediction_type` or a `.yaml` beside it;
    `safety_checker` has a Hub download of its configs include the repo's safety checker. `quantize`: each kernel it
    takes is quantized as its tensor is read, so the load never holds the float model beside its int8 copy: with
    "int8" those of `loading.quantize.int8_components` (the denoiser, a Qwen3 text encoder, on the devices or the
    host) as int8 weights; with "w8a8" the denoiser's that its family's `Denoiser.w8a8` takes, computed in int8
    (refused for a family without one), and a Qwen3 text encoder's as int8 weights."""
    if t5 not in T5_PLACES:
        raise ConfigError(f"t5 must be one of {', '.join(T5_PLACES)}, not {t5!r}")
    weights_variant = "fp16" if dtype in ("float16", "bfloat16") else None
    single = None
    if is_transformer_file(source):  # a DiT's transformer (or all-in-one) file, GGUF included
        if prediction_type is not None:
            raise ConfigError(f"{source}: prediction_type= is for SD 2.x checkpoints; this is a flow-matching model")
        single = open_transformer_file(source, dtype, config)
    elif is_single_file(source):
        single = open_single_file(source, config, prediction_type, safety_checker)
    elif config is not None or prediction_type is not None:
        raise ConfigError(
            f"{source}: config= and prediction_type= are for a single-file checkpoint (.safetensors, .ckpt), "
            "and this is not one"
        )
    folder = single.folder if single is not None else resolve(source, weights_variant)
    family = folder_family(folder)
    text = family.text
    if t5 == "off" and text.host_encoder is not None and text.host_encoder not in family.optional:
        raise ConfigError(
            f"{folder.name}: this model needs its {family.configs[text.host_encoder].__name__.removesuffix('Config')} "
            f"text encoder ({text.host_encoder}); keep it on the device or the host"
        )
    left_out = {text.host_encoder} if t5 == "off" else set()
    configs = {
        name: cls.from_json(folder.component(name) / "config.json")
        for name, cls in family.configs.items()
        if name not in left_out and (name not in family.optional or folder.has(name))
    }
    denoiser_cfg, vae_cfg = configs[family.denoiser.component], configs["vae"]
    variant = find(family.name, denoiser_cfg.in_channels, vae_cfg, where=folder.name)
    family.check_layout(configs, folder.name)
    sched_cfg = SchedulerConfig.from_json(folder.component("scheduler") / "scheduler_config.json")
    if single is not None:
        sched_cfg = single.scheduler(sched_cfg)
    if single is not None:  # renamed from the original layout to diffusers'; what the file lacks, from the folder
        by_component = single.component_tensors(configs)
        for name in configs:
            if name not in by_component:
                by_component[name] = read_safetensors(folder.weight_files(name, weights_variant))
    else:
        by_component = {name: read_safetensors(folder.weight_files(name, weights_variant)) for name in configs}
    tensors = {
        f"{name}.{key}": value
        for name in configs
        for key, value in family.tensors(name, configs[name], rename_legacy(by_component.get(name, {}))).items()
    }

    # the kernels `quantize` takes are quantized as they are read (`quantize.streaming`): the float model is never held
    int8 = int8_components(family.denoiser.component, family.configs, quantize) if quantize else ()
    w8a8 = (family.denoiser.component, family.denoiser.w8a8) if quantize == "w8a8" else None
    host = None
    if t5 == "host" and text.host_encoder in configs:
        name = text.host_encoder
        mine = {key[len(name) + 1 :]: tensors.pop(key) for key in [k for k in tensors if k.startswith(name + ".")]}
        host = text.on_host(name, configs[name], mine, dtype, folder.name, int8=name in int8)
    on_device = {name: config for name, config in configs.items() if host is None or name != text.host_encoder}
    graphdef, params = convert(
        lambda: Models(**family.build(on_device, nnx.Rngs(0))),
        tensors,
        dtype,
        where=folder.name,
        quantized=streaming(int8, w8a8) if quantize else None,
    )
    if dtype == "float16" and vae_cfg.force_upcast:  # the SD/SDXL VAEs overflow in fp16; diffusers upcasts too
        params["vae"] = jax.tree.map(lambda a: a.astype(np.float32), params["vae"])
    defaults, examples = _defaults(folder, family, variant, configs, vae_cfg, sched_cfg)
    vae_scale_factor = family.latent.scale_factor(vae_cfg)
    return LoadedModel(
        name=folder.name,
        family=family.name,
        variant=variant,
        graphdef=graphdef,
        params=params,
        denoiser_config=denoiser_cfg,
        vae_config=vae_cfg,
        scheduler_config=sched_cfg,
        tokenizers=[Tokenizer(folder.component(name)) for name in variant.tokenizers],
        defaults=defaults,
        label=variant.label + (" Turbo" if is_turbo(folder, sched_cfg, family) else ""),
        example_prompts=examples,
        max_clip_skip=min(configs[name].num_hidden_layers for name in text.encoders) - 1 if text.clip_skip else 0,
        extra_inputs=text.extra_inputs(folder.index, vae_scale_factor, folder if t5 != "off" else None, host),
        fit_prompts=None if text.fit_prompts is None else text.fit_prompts(folder if t5 != "off" else None),
        config_folder=folder if single is not None else None,
        guided=not family.sampling.distilled(folder.index),
    )
