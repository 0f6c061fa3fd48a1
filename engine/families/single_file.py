"""Single-file checkpoints in the original (LDM / A1111) layout: one `.safetensors` (or `.ckpt`, read by
`loading.pickle_reader`) holding the UNet, the VAE and the text encoders under the prefixes Stability's code
gave them. What the file is comes from its keys, as diffusers' `single_file_utils.infer_diffusers_model_type`
tells it; the configs, tokenizers and scheduler come from a diffusers folder or Hub id (`config=`, as
`from_single_file(..., config=)` takes it), else from the Hub repo diffusers uses for that kind (configs only,
cached); the tensors are renamed to diffusers' names (`loading.ldm_keys`) and loaded as a folder's are.

SD 2.x files do not say whether they predict noise (512 "base") or velocity (768 "v"): a `.yaml` beside the file
with `parameterization: "v"` says so as A1111 reads it, or `prediction_type=`; else the config's scheduler
decides, and without `config=` diffusers' choice for SD 2.x (stabilityai/stable-diffusion-2-1: v).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, SourceError, WeightsError
from ..loading.ldm_keys import openclip_to_diffusers, unet_to_diffusers, vae_to_diffusers
from ..loading.pickle_reader import PICKLE_SUFFIXES, read_tensors
from ..loading.sources import ModelFolder, hub_snapshot, resolve
from ..loading.weights import map_safetensors
from ..schedulers import SchedulerConfig
from . import family_of, sd, sdxl
from .base import Family

SUFFIXES = (".safetensors", *PICKLE_SUFFIXES)
UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
PREDICTION_TYPES = ("epsilon", "v_prediction")
# Keys of single files we recognise but do not read yet, for the refusal's message (FLUX.1's and SD 3's transformer
# files are read by `transformer_file`, which the loader asks first).
NOT_YET = {
    "conditioner.embedders.0.model.text_projection": "an SDXL refiner",
}


@dataclass(frozen=True)
class TextEncoderLayout:
    component: str  # our (diffusers') component: text_encoder, text_encoder_2
    prefix: str  # where the file keeps it
    openclip: bool  # OpenCLIP's names (`loading.ldm_keys.openclip_to_diffusers`); else transformers' CLIP's
    projection: bool = False  # CLIPTextModelWithProjection: the file's `text_projection` is kept


@dataclass(frozen=True)
class CheckpointKind:
    """One kind of single file, as diffusers' `infer_diffusers_model_type` names it."""

    name: str  # diffusers' model type: v1, v2, xl_base
    label: str
    family: Family
    marker: str  # a key only this kind's text encoder has
    text_encoders: tuple[TextEncoderLayout, ...]
    repo: str  # diffusers' DIFFUSERS_DEFAULT_PIPELINE_PATHS: where the configs come from without config=
    inpainting_repo: str  # the same for the kind's 9-channel inpainting UNet
    epsilon_repo: str | None = None  # SD 2.x: `repo` predicts v; this one noise


# Most specific first: SDXL's files hold a CLIP under `conditioner.embedders.0` too.
KINDS = (
    CheckpointKind(
        "xl_base",
        "Stable Diffusion XL",
        sdxl.FAMILY,
        "conditioner.embedders.1.model.positional_embedding",
        (
            TextEncoderLayout("text_encoder", "conditioner.embedders.0.transformer.", openclip=False),
            TextEncoderLayout("text_encoder_2", "conditioner.embedders.1.model.", openclip=True, projection=True),
        ),
        repo="stabilityai/stable-diffusion-xl-base-1.0",
        inpainting_repo="diffusers/stable-diffusion-xl-1.0-inpainting-0.1",
    ),
    CheckpointKind(
        "v2",
        "Stable Diffusion 2.x",
        sd.FAMILY,
        "cond_stage_model.model.token_embedding.weight",
        (TextEncoderLayout("text_encoder", "cond_stage_model.model.", openclip=True),),
        repo="stabilityai/stable-diffusion-2-1",
        inpainting_repo="stabilityai/stable-diffusion-2-inpainting",
        epsilon_repo="stabilityai/stable-diffusion-2-1-base",
    ),
    CheckpointKind(
        "v1",
        "Stable Diffusion 1.x",
        sd.FAMILY,
        "cond_stage_model.transformer.",  # a prefix: older files lack `text_model.`
        (TextEncoderLayout("text_encoder", "cond_stage_model.transformer.", openclip=False),),
        repo="stable-diffusion-v1-5/stable-diffusion-v1-5",
        inpainting_repo="stable-diffusion-v1-5/stable-diffusion-inpainting",
    ),
)


def is_single_file(source: Any) -> bool:
    return source is not None and Path(source).expanduser().is_file() and Path(source).suffix.lower() in SUFFIXES


def read_checkpoint(file: Path) -> dict[str, np.ndarray]:
    """A file's tensors by name: safetensors mapped, PyTorch pickles through the restricted reader (a Lightning
    checkpoint's `state_dict.` taken off)."""
    if file.suffix.lower() == ".safetensors":
        try:
            return map_safetensors(file)
        except WeightsError as err:
            raise SourceError(str(err)) from err
    tensors = read_tensors(file)
    if any(name.startswith("state_dict.") for name in tensors):
        tensors = {name[len("state_dict.") :]: v for name, v in tensors.items() if name.startswith("state_dict.")}
    return tensors


def detect(tensors: Mapping[str, np.ndarray], where: str) -> tuple[CheckpointKind, bool]:
    """The file's kind and whether its UNet is an inpainting one (9 input channels), from its keys."""
    for key, what in NOT_YET.items():
        if key in tensors or f"{UNET_PREFIX}{key}" in tensors:
            raise SourceError(f"{where}: {what} single file, which this engine does not read yet")
    conv_in = tensors.get(f"{UNET_PREFIX}input_blocks.0.0.weight")
    kind = next((k for k in KINDS if any(name.startswith(k.marker) for name in tensors)), None)
    if conv_in is None or kind is None:
        heads = sorted({".".join(name.split(".")[:2]) for name in tensors})
        found = ", ".join(heads[:12]) + (" ..." if len(heads) > 12 else "") if heads else "no tensors"
        raise SourceError(
            f"{where}: not a Stable Diffusion checkpoint in the original layout (a UNet under {UNET_PREFIX} and "
            f"a CLIP or OpenCLIP text encoder); found {found}"
        )
    return kind, conv_in.ndim == 4 and conv_in.shape[1] == 9


def yaml_prediction_type(file: Path) -> str | None:
    """What a `.yaml` beside the file (`model.params.parameterization`, as A1111 reads it) says: "v" is
    v_prediction; any other yaml, epsilon (LDM's default, "eps"); None without one."""
    path = file.with_suffix(".yaml")
    if not path.is_file():
        return None
    import yaml

    try:
        params = ((yaml.safe_load(path.read_text()) or {}).get("model") or {}).get("params") or {}
    except (yaml.YAMLError, AttributeError) as err:
        raise SourceError(f"{path}: not a model config the engine can read ({err})") from err
    return "v_prediction" if params.get("parameterization") == "v" else "epsilon"


CONFIG_FILES = re.compile(r"^(model_index\.json|scheduler/.*|tokenizer(_[23])?/.*|[\w]+/config\.json)$")


def _hub_configs(repo_id: str, where: str, safety_checker: bool) -> Path:
    """A Hub repo's configs, tokenizers and scheduler, not its weights (besides the safety checker's when asked),
    downloaded or cached."""
    hint = (
        f"{where}: its configs come from {repo_id!r} on the Hugging Face Hub, which cannot be reached and is not in "
        f"the local cache. Name a diffusers folder of the same kind for them: config=DIR (--config DIR), or fetch "
        f"them where there is a network (`hf download {repo_id} --exclude '*.safetensors' '*.bin'`)"
    )

    def choose(files: list[str]) -> list[str]:
        wanted = [f for f in files if CONFIG_FILES.match(f)]
        if safety_checker:
            wanted += [f for f in files if f.startswith(("safety_checker/", "feature_extractor/"))]
            wanted = [f for f in wanted if not f.endswith((".bin", ".msgpack", ".h5", ".onnx"))]
        return sorted(set(wanted))

    return hub_snapshot(repo_id, hint, choose)


@dataclass
class SingleFile:
    path: Path
    kind: CheckpointKind
    inpainting: bool
    tensors: Mapping[str, np.ndarray]  # the file's own names
    folder: ModelFolder  # configs, tokenizers and scheduler; its name is the file
    prediction_type: str | None  # given or the yaml's; None: the config's scheduler decides

    def scheduler(self, config: SchedulerConfig) -> SchedulerConfig:
        if self.prediction_type is None:
            return config
        return dataclasses.replace(config, prediction_type=self.prediction_type)

    def component_tensors(self, configs: Mapping[str, Any]) -> dict[str, dict[str, np.ndarray]]:
        """Each component's tensors by diffusers' names (the configs say the UNet's and VAE's block layout)."""

        def under(prefix: str) -> dict[str, np.ndarray]:
            return {name[len(prefix) :]: v for name, v in self.tensors.items() if name.startswith(prefix)}

        out = {
            "unet": unet_to_diffusers(under(UNET_PREFIX), configs["unet"]),
            "vae": vae_to_diffusers(under(VAE_PREFIX), configs["vae"]),
        }
        for layout in self.kind.text_encoders:
            tensors = under(layout.prefix)
            if layout.openclip:
                tensors = openclip_to_diffusers(tensors, configs[layout.component], layout.projection)
            out[layout.component] = tensors
        return out


def open_single_file(
    source: str | Path,
    config: str | Path | None = None,
    prediction_type: str | None = None,
    safety_checker: bool = False,
) -> SingleFile:
    """Reads a single file's keys (mapped, nothing loaded yet), tells its kind and finds its configs.

    `safety_checker`: when the configs come from the Hub, fetch the repo's safety checker too (SD 1.x's)."""
    if prediction_type is not None and prediction_type not in PREDICTION_TYPES:
        raise ConfigError(f"prediction_type={prediction_type!r} is not one of {', '.join(PREDICTION_TYPES)}")
    path = Path(source).expanduser()
    where = str(source)
    tensors = read_checkpoint(path)
    kind, inpainting = detect(tensors, where)
    prediction_type = prediction_type or yaml_prediction_type(path)
    if config is not None and Path(config).expanduser().is_dir():
        folder = resolve(config)
    else:
        repo = str(config) if config is not None else kind.inpainting_repo if inpainting else kind.repo
        if config is None and kind.epsilon_repo and prediction_type == "epsilon" and not inpainting:
            repo = kind.epsilon_repo
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
            raise SourceError(f"config {repo!r} is neither a diffusers folder nor a Hub id like 'owner/name'")
        root = _hub_configs(repo, where, safety_checker)
        index_path = root / "model_index.json"
        if not index_path.is_file():
            raise SourceError(f"{where}: {repo}'s cached copy has no model_index.json; name config=DIR instead")
        index = json.loads(index_path.read_text())
        folder = ModelFolder(root=root, name=repo, class_name=index.get("_class_name", ""), index=index)
    family = family_of(folder.class_name)
    if family is not kind.family:
        raise SourceError(
            f"{where} is a {kind.label} checkpoint, but its config {folder.name!r} is a {folder.class_name or 'folder'} "
            f"of another kind: name a {kind.label} diffusers folder or Hub id as config="
        )
    folder = dataclasses.replace(folder, name=where)
    return SingleFile(path, kind, inpainting, tensors, folder, prediction_type)
