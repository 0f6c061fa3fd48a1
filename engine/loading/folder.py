"""A diffusers-format folder -> configs, tokenizers, scheduler config and one param tree on the host.

The family comes from `model_index.json`: "sd" (SD 1.x/2.x: one CLIP encoder) or "sdxl" (two
encoders, `text_time` conditioning). Generation defaults follow the family, and Turbo (few-step,
guidance-free) folders get their own.

An optional `jax_sd.json` beside `model_index.json` carries generation defaults and example
prompts for a model (the embedded default uses it); diffusers ignores that file.
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from ..families import sdxl, variants
from ..models.clip import CLIPTextModel
from ..models.config import CLIPTextConfig, UNetConfig, VAEConfig
from ..models.unet import UNet2DConditionModel
from ..models.vae import AutoencoderKL
from ..sampling.pipeline import Models, Plan
from ..schedulers import SCHEDULERS, SchedulerConfig
from .sources import ModelFolder, resolve
from .weights import convert, read_safetensors, rename_legacy

# Adversarially distilled models (SD-Turbo, SDXL-Turbo; Sauer et al. 2023) take 1-4 steps without guidance.
TURBO_DEFAULTS = {"num_inference_steps": 1, "guidance_scale": 0.0}


class Tokenizer:
    """transformers' CLIPTokenizer, padded to its 77 tokens; says when a prompt was cut."""

    def __init__(self, folder: Path):
        from transformers import CLIPTokenizer

        self.inner = CLIPTokenizer.from_pretrained(str(folder))
        self.max_length = self.inner.model_max_length
        # A call sets padding and truncation on the shared Rust tokenizer before it encodes: two threads
        # interleaving would get each other's settings (ids of the wrong length). One call at a time.
        self.lock = threading.Lock()

    def __call__(self, text: str, what: str = "prompt") -> tuple[np.ndarray, list[str]]:
        with self.lock:
            full = self.inner(text, truncation=False).input_ids
            ids = self.inner(text, padding="max_length", max_length=self.max_length, truncation=True).input_ids
        warnings = []
        if len(full) > self.max_length:
            dropped = self.inner.decode(full[self.max_length - 1 : -1])
            warnings.append(f"{what} truncated to {self.max_length} tokens; dropped: {dropped!r}")
        return np.asarray(ids, np.int32)[None], warnings


@dataclass
class LoadedModel:
    name: str
    family: str
    variant: variants.Variant
    graphdef: nnx.GraphDef
    params: nnx.State  # host numpy arrays in the run dtype
    unet_config: UNetConfig
    vae_config: VAEConfig
    scheduler_config: SchedulerConfig
    tokenizers: list[Tokenizer]  # one per text encoder
    defaults: dict[str, Any]
    label: str = ""  # for people: "Stable Diffusion XL Turbo"
    example_prompts: list[str] = field(default_factory=list)
    max_clip_skip: int = 0
    # The family's per-image inputs besides token ids, from the plan and the negative prompt (None: none at all).
    extra_inputs: Callable[[Plan, str | None], dict] = lambda plan, negative_prompt: {}
    controlnet: str | None = None  # the ControlNet's source, when one is attached (`controlnet.attach_controlnet`)

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae_config.block_out_channels) - 1)

    @property
    def latent_channels(self) -> int:
        return self.vae_config.latent_channels  # an inpainting UNet reads more: mask and masked picture

    def tokenize(self, text: str, what: str = "prompt") -> tuple[np.ndarray, list[str]]:
        """ids [1, 77] with one tokenizer, [1, tokenizers, 77] with several (SDXL)."""
        rows, warnings = [], []
        for tokenizer in self.tokenizers:
            ids, notes = tokenizer(text, what)
            rows.append(ids)
            warnings += [note for note in notes if note not in warnings]  # both cut at 77 tokens: say it once
        return (rows[0] if len(rows) == 1 else np.stack(rows, axis=1)), warnings


def is_turbo(folder: ModelFolder, scheduler: SchedulerConfig) -> bool:
    """Turbo folders ship a "trailing" schedule (zero-SNR models do too, with many steps; not those)."""
    trailing = scheduler.timestep_spacing == "trailing" and not scheduler.rescale_betas_zero_snr
    return trailing or "turbo" in folder.name.lower()


def _defaults(
    folder: ModelFolder, variant: variants.Variant, unet: UNetConfig, vae: VAEConfig, scheduler: SchedulerConfig
) -> tuple[dict, list[str]]:
    side = (unet.sample_size or 64) * 2 ** (len(vae.block_out_channels) - 1)
    defaults = {"height": side, "width": side, **variant.defaults}
    if scheduler.default_kind in SCHEDULERS:
        defaults["scheduler"] = scheduler.default_kind
    if is_turbo(folder, scheduler):
        defaults.update(TURBO_DEFAULTS)
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


def load_model_folder(source: str | Path | None, dtype: str) -> LoadedModel:
    variant = "fp16" if dtype in ("float16", "bfloat16") else None
    folder = resolve(source, variant)
    family = folder.family
    unet_cfg = UNetConfig.from_json(folder.component("unet") / "config.json")
    vae_cfg = VAEConfig.from_json(folder.component("vae") / "config.json")
    variant = variants.find(family, unet_cfg.in_channels, where=folder.name)
    encoders = variant.text_encoders
    clip_cfgs = [CLIPTextConfig.from_json(folder.component(name) / "config.json") for name in encoders]
    if family == "sdxl":
        sdxl.check_layout(unet_cfg, *clip_cfgs, where=folder.name)
    sched_cfg = SchedulerConfig.from_json(folder.component("scheduler") / "scheduler_config.json")
    tensors = {}
    for name in (*encoders, "unet", "vae"):
        for key, value in rename_legacy(read_safetensors(folder.weight_files(name, variant))).items():
            tensors[f"{name}.{key}"] = value

    def make():
        rngs = nnx.Rngs(0)
        # SDXL's second encoder is `CLIPTextModelWithProjection`: its pooled output is projected.
        clips = [CLIPTextModel(cfg, rngs, with_projection=i == 1) for i, cfg in enumerate(clip_cfgs)]
        return Models(clips[0], UNet2DConditionModel(unet_cfg, rngs), AutoencoderKL(vae_cfg, rngs), *clips[1:])

    graphdef, params = convert(make, tensors, dtype, where=folder.name)
    if dtype == "float16" and vae_cfg.force_upcast:  # the SD/SDXL VAEs overflow in fp16; diffusers upcasts too
        params["vae"] = jax.tree.map(lambda a: a.astype(np.float32), params["vae"])
    defaults, examples = _defaults(folder, variant, unet_cfg, vae_cfg, sched_cfg)
    family_parts = {}
    if family == "sdxl":
        family_parts["extra_inputs"] = functools.partial(
            sdxl.extra_inputs,
            vae_scale_factor=2 ** (len(vae_cfg.block_out_channels) - 1),
            force_zeros=bool(folder.index.get("force_zeros_for_empty_prompt", True)),  # diffusers' default: True
        )
    return LoadedModel(
        name=folder.name,
        family=family,
        variant=variant,
        graphdef=graphdef,
        params=params,
        unet_config=unet_cfg,
        vae_config=vae_cfg,
        scheduler_config=sched_cfg,
        tokenizers=[Tokenizer(folder.component(name)) for name in variant.tokenizers],
        defaults=defaults,
        label=variant.label + (" Turbo" if is_turbo(folder, sched_cfg) else ""),
        example_prompts=examples,
        max_clip_skip=min(cfg.num_hidden_layers for cfg in clip_cfgs) - 1,
        **family_parts,
    )
