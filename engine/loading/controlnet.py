"""ControlNet folders and Hub repositories -> a `LoadedControlNet`, and attaching one to a loaded model.

Strict like every load: a ControlNet made for another UNet layout is refused at load, by field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from ..errors import SourceError
from ..models.config import UNetConfig
from ..models.controlnet import ControlNetConfig, ControlNetModel
from .sources import component_folder, component_weight_files
from .weights import convert, read_safetensors


@dataclass
class LoadedControlNet:
    name: str  # what the user asked for: a folder or a Hub id
    config: ControlNetConfig
    graphdef: nnx.GraphDef
    params: nnx.State  # host numpy arrays in the run dtype

    def model(self) -> ControlNetModel:
        return nnx.merge(self.graphdef, jax.tree.map(jnp.asarray, self.params))


def load_controlnet(source: str | Path, dtype: str = "float32") -> LoadedControlNet:
    """A diffusers-format ControlNet folder (config.json + diffusion_pytorch_model*.safetensors), a pipeline
    folder's `controlnet/` sub-folder, or a Hub id; every tensor must fit (missing ones are named)."""
    variant = "fp16" if dtype in ("float16", "bfloat16") else None
    root = component_folder(source, "ControlNet", "controlnet", variant)
    cfg = ControlNetConfig.from_json(root / "config.json")
    tensors = read_safetensors(component_weight_files(root, variant, "ControlNet"))
    graphdef, params = convert(lambda: ControlNetModel(cfg, nnx.Rngs(0)), tensors, dtype, where=str(source))
    return LoadedControlNet(name=str(source), config=cfg, graphdef=graphdef, params=params)


# The UNet fields that a ControlNet's residuals must agree with, one per skip connection and the mid block.
MATCHING_FIELDS = (
    "in_channels",
    "block_out_channels",
    "layers_per_block",
    "down_block_types",
    "cross_attention_dim",
    "addition_embed_type",
)


def attach_controlnet(model, controlnet: LoadedControlNet):
    """`model` (a `loading.LoadedModel`) with the ControlNet as `Models.controlnet`, in its one param tree:
    replicated, merged and split with the rest. Refuses a ControlNet made for another UNet layout, by field."""
    ours, theirs = model.denoiser_config, controlnet.config.unet

    def value(cfg: UNetConfig, name: str):
        return cfg.per_block(name) if name in ("cross_attention_dim", "layers_per_block") else getattr(cfg, name)

    wrong = [
        f"{name} {value(theirs, name)!r} (the UNet's: {value(ours, name)!r})"
        for name in MATCHING_FIELDS
        if value(theirs, name) != value(ours, name)
    ]
    if wrong:
        raise SourceError(
            f"ControlNet {controlnet.name} does not fit the model {model.name}: {'; '.join(wrong)}. "
            "Is it a ControlNet for another model family (SD 1.x, SD 2.x, SDXL)?"
        )
    models = nnx.merge(model.graphdef, model.params)  # host arrays stay host arrays
    models.controlnet = nnx.data(nnx.merge(controlnet.graphdef, controlnet.params))  # None until now: static
    graphdef, params = nnx.split(models)
    return dataclasses.replace(model, graphdef=graphdef, params=params, controlnet=controlnet.name)
