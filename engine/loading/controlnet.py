"""ControlNet folders and Hub repositories -> a `LoadedControlNet`, and attaching one to a loaded model.

Strict like every load: a ControlNet made for another UNet layout is refused at load, by field.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from ..errors import SourceError
from ..models.config import UNetConfig
from ..models.controlnet import ControlNetConfig, ControlNetModel
from .sources import _WEIGHT_NAME
from .weights import convert, read_safetensors


@dataclass
class LoadedControlNet:
    name: str  # what the user asked for: a folder or a Hub id
    config: ControlNetConfig
    graphdef: nnx.GraphDef
    params: nnx.State  # host numpy arrays in the run dtype

    def model(self) -> ControlNetModel:
        return nnx.merge(self.graphdef, jax.tree.map(jnp.asarray, self.params))


def _weight_files(folder: Path, variant: str | None) -> list[Path]:
    by_variant: dict[str | None, list[Path]] = {}
    for file in sorted(folder.iterdir()):
        match = _WEIGHT_NAME.match(file.name)
        if match and match[1] == "diffusion_pytorch_model" and not file.name.endswith(".index.json"):
            by_variant.setdefault(match["variant"], []).append(file)
    files = by_variant.get(variant) or by_variant.get(None) or next(iter(by_variant.values()), None)
    if not files:
        raise SourceError(f"{folder}: no diffusion_pytorch_model*.safetensors ControlNet weights")
    return files


def _from_hub(repo_id: str, variant: str | None) -> Path:
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    hint = f"cannot fetch the ControlNet {repo_id!r} from the Hugging Face Hub and it is not in the local cache"
    try:
        files = huggingface_hub.list_repo_files(repo_id)
    except (OfflineModeIsEnabled, OSError, HfHubHTTPError) as err:
        try:
            return Path(huggingface_hub.snapshot_download(repo_id, local_files_only=True))
        except Exception as cache_err:
            raise SourceError(f"{hint} ({type(err).__name__}: {err})") from cache_err
    by_variant: dict[str | None, list[str]] = {}
    for f in files:
        match = _WEIGHT_NAME.match(f)  # top-level files only: a name with a "/" never matches
        if match and match[1] == "diffusion_pytorch_model":
            by_variant.setdefault(match["variant"], []).append(f)
    chosen = by_variant.get(variant) or by_variant.get(None) or next(iter(by_variant.values()), [])
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=["config.json", *chosen]))
    except (OSError, HfHubHTTPError) as err:
        raise SourceError(f"{hint} ({type(err).__name__}: {err})") from err


def load_controlnet(source: str | Path, dtype: str = "float32") -> LoadedControlNet:
    """A diffusers-format ControlNet folder (config.json + diffusion_pytorch_model*.safetensors), a pipeline
    folder's `controlnet/` sub-folder, or a Hub id; every tensor must fit (missing ones are named)."""
    variant = "fp16" if dtype in ("float16", "bfloat16") else None
    if Path(source).expanduser().is_dir():
        root = Path(source).expanduser()
    elif isinstance(source, str) and re.fullmatch(r"[\w.-]+/[\w.-]+", source):
        root = _from_hub(source, variant)
    else:
        raise SourceError(f"ControlNet source {str(source)!r} is neither a folder nor a Hub id like 'owner/name'")
    if not (root / "config.json").is_file() and (root / "controlnet" / "config.json").is_file():
        root = root / "controlnet"
    if not (root / "config.json").is_file():
        raise SourceError(f"{source}: no config.json, so this is not a diffusers-format ControlNet folder")
    cfg = ControlNetConfig.from_json(root / "config.json")
    tensors = read_safetensors(_weight_files(root, variant))
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
    ours, theirs = model.unet_config, controlnet.config.unet

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
