"""A diffusers-format folder -> configs, tokenizer, scheduler config and one param tree on the host.

An optional `jax_sd.json` beside `model_index.json` carries generation defaults and example
prompts for a model (the embedded default uses it); diffusers ignores that file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from .clip import CLIPTextModel
from .config import CLIPTextConfig, UNetConfig, VAEConfig
from .pipeline import Models, Plan
from .schedulers import SchedulerConfig
from .sources import ModelFolder, resolve
from .unet import UNet2DConditionModel
from .vae import AutoencoderKL
from .weights import convert, read_safetensors

FAMILY_DEFAULTS = {
    "sd": {"num_inference_steps": 50, "guidance_scale": 7.5},
    "sdxl": {"num_inference_steps": 25, "guidance_scale": 5.0, "scheduler": "euler"},
}


class Tokenizer:
    """transformers' CLIPTokenizer, padded to its 77 tokens; says when a prompt was cut."""

    def __init__(self, folder: Path):
        from transformers import CLIPTokenizer

        self.inner = CLIPTokenizer.from_pretrained(str(folder))
        self.max_length = self.inner.model_max_length

    def __call__(self, text: str, what: str = "prompt") -> tuple[np.ndarray, list[str]]:
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
    graphdef: nnx.GraphDef
    params: nnx.State  # host numpy arrays in the run dtype
    unet_config: UNetConfig
    vae_config: VAEConfig
    scheduler_config: SchedulerConfig
    tokenizers: list[Tokenizer]
    defaults: dict[str, Any]
    example_prompts: list[str] = field(default_factory=list)
    extra_inputs: Callable[[Plan], dict] = lambda plan: {}

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae_config.block_out_channels) - 1)

    @property
    def latent_channels(self) -> int:
        return self.unet_config.in_channels

    def tokenize(self, text: str, what: str = "prompt") -> tuple[np.ndarray, list[str]]:
        ids, warnings = self.tokenizers[0](text, what)
        return ids, warnings


def _defaults(
    folder: ModelFolder, unet: UNetConfig, vae: VAEConfig, scheduler: SchedulerConfig
) -> tuple[dict, list[str]]:
    side = (unet.sample_size or 64) * 2 ** (len(vae.block_out_channels) - 1)
    defaults = {"height": side, "width": side, "scheduler": scheduler.default_kind or "pndm"}
    defaults.update(FAMILY_DEFAULTS[folder.family])
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
    if folder.family != "sd":
        raise NotImplementedError(f"{folder.name}: {folder.family} models are not supported yet")
    unet_cfg = UNetConfig.from_json(folder.component("unet") / "config.json")
    vae_cfg = VAEConfig.from_json(folder.component("vae") / "config.json")
    clip_cfg = CLIPTextConfig.from_json(folder.component("text_encoder") / "config.json")
    sched_cfg = SchedulerConfig.from_json(folder.component("scheduler") / "scheduler_config.json")
    tensors = {}
    for name in ("text_encoder", "unet", "vae"):
        for key, value in read_safetensors(folder.weight_files(name, variant)).items():
            tensors[f"{name}.{key}"] = value

    def make():
        rngs = nnx.Rngs(0)
        return Models(CLIPTextModel(clip_cfg, rngs), UNet2DConditionModel(unet_cfg, rngs), AutoencoderKL(vae_cfg, rngs))

    graphdef, params = convert(make, tensors, dtype, where=folder.name)
    defaults, examples = _defaults(folder, unet_cfg, vae_cfg, sched_cfg)
    return LoadedModel(
        name=folder.name,
        family=folder.family,
        graphdef=graphdef,
        params=params,
        unet_config=unet_cfg,
        vae_config=vae_cfg,
        scheduler_config=sched_cfg,
        tokenizers=[Tokenizer(folder.component("tokenizer"))],
        defaults=defaults,
        example_prompts=examples,
    )
