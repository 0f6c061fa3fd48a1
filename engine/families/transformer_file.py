"""Transformer single files of FLUX.1 (and Kontext), SD 3/3.5, Z-Image and FLUX.2 [klein]: a transformer alone (as
Black Forest Labs, Stability and ComfyUI publish it, or in diffusers' names), a GGUF transformer (quantized files as
city96's converter writes them for ComfyUI-GGUF), or an all-in-one file that adds the VAE and text encoders under
ComfyUI's prefixes. What the file is comes from its keys (`TransformerKind.marker`); a GGUF's
`general.architecture` must be one its kind is published under (city96's converter names FLUX.2's files "flux",
its keys being BFL's, and Z-Image's "lumina2", its layout being Lumina 2's). No option says it.

Everything the file does not hold (configs, tokenizers, scheduler, and usually the text encoders and the VAE) comes
from a diffusers folder or Hub id of the same family (`config=`, as diffusers' `from_single_file(..., config=)`; a
FLUX.1 Kontext [dev] folder for a Kontext file, whose keys are FLUX.1-dev's), else from the Hub repo diffusers uses
for that kind: FLUX.1-dev or -schnell (told by the guidance embedder), SD 3.5 Large or Medium, SD 3 Medium,
Z-Image-Turbo; for FLUX.2, whose repo in diffusers is [dev] (not served here), [klein] 4B or 9B told by the width.
Every file but the transformer's weights is downloaded or cached (offline and not cached: a message that names
`config=`).

Weights: bf16, f16 and f32 as they are; fp8 (`float8_e4m3fn`, `float8_e5m2`) widened to the run dtype at load
(ComfyUI's "scaled" fp8, each weight times its `scale_weight`: `ScaledFP8`); a GGUF's Q8_0 kernels kept as our int8
exactly (`loading.quantize.Int8Kernel` with Q8_0's block scales: see `loading.gguf_file`), its other quantized types
dequantized to the run dtype.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from ..errors import ConfigError, SourceError, WeightsError
from ..loading.dit_keys import Plan, apply_plan, flux2_plan, flux_plan, sd3_plan, strip_prefix, z_image_plan
from ..loading.gguf_file import SUFFIX as GGUF_SUFFIX
from ..loading.gguf_file import Q8Tensor, read_gguf
from ..loading.ldm_keys import vae_to_diffusers
from ..loading.sources import ModelFolder, hub_snapshot, resolve, select_hub_files
from ..loading.weights import map_safetensors
from ..schedulers import SchedulerConfig
from . import family_of, flux, flux2, flux_kontext, sd3, z_image
from .base import Family

log = logging.getLogger(__name__)
VAE_PREFIX = "first_stage_model."
TEXT_PREFIX = "text_encoders."  # ComfyUI's all-in-one files: text_encoders.{clip_l,clip_g,t5xxl}.transformer.


Shapes = Mapping[str, tuple[int, ...]]  # a file's (prefix-free) tensor names -> their shapes


@dataclass(frozen=True)
class TransformerKind:
    name: str
    label: str
    families: tuple[Family, ...]  # the families whose folders may be its config=
    architectures: tuple[str, ...]  # the `general.architecture` its GGUF files carry
    marker: str  # a key of the original layout
    diffusers_marker: str  # a key of diffusers' layout
    plan: Callable[[Shapes], Plan]
    text_encoders: Mapping[str, str]  # an all-in-one file's text encoder (under TEXT_PREFIX) -> our component
    repo: Callable[[Shapes], str | None]  # the Hub repo for a file of these keys (either layout); None: config=
    unlike: tuple[str, ...] = ()  # keys its files never hold: another kind's that shares its markers
    unused: tuple[str, ...] = ()  # tensors of the original layout that the model never reads, dropped


def _flux_repo(names: Shapes) -> str:
    dev = any(name.startswith(("guidance_in.", "time_text_embed.guidance_embedder.")) for name in names)
    return "black-forest-labs/FLUX.1-dev" if dev else "black-forest-labs/FLUX.1-schnell"


# FLUX.2 [klein] by its inner width (24 or 32 heads of 128): the published transformers' configs
KLEIN_REPOS = {3072: "black-forest-labs/FLUX.2-klein-4B", 4096: "black-forest-labs/FLUX.2-klein-9B"}


def klein_repo(shapes: Shapes) -> str | None:
    """The distilled [klein] of the file's width (the base models share their keys); None for another width
    ([dev]'s 6144, or a model of its own), which needs config=."""
    embedder = shapes.get("img_in.weight") or shapes.get("x_embedder.weight")
    return KLEIN_REPOS.get(embedder[0]) if embedder else None


def _sd3_repo(names: Shapes) -> str:
    if any(name.startswith(("joint_blocks.37.", "transformer_blocks.37.")) for name in names):  # 38 blocks: Large
        return "stabilityai/stable-diffusion-3.5-large"
    if any(".attn2." in name for name in names):  # dual attention: 3.5 Medium
        return "stabilityai/stable-diffusion-3.5-medium"
    return "stabilityai/stable-diffusion-3-medium-diffusers"


FLUX2_MODULATION = ("single_stream_modulation.lin.weight", "single_stream_modulation.linear.weight")
KINDS = (
    TransformerKind(
        "flux",
        "FLUX.1",
        (flux.FAMILY, flux_kontext.FAMILY),  # Kontext [dev]: FLUX.1-dev's keys, its own folder
        ("flux",),
        "double_blocks.0.img_attn.norm.key_norm.scale",
        "single_transformer_blocks.0.attn.norm_k.weight",
        flux_plan,
        {"clip_l": "text_encoder", "t5xxl": "text_encoder_2"},
        _flux_repo,
        unlike=FLUX2_MODULATION,  # FLUX.2's blocks have FLUX.1's names (one modulation per stream instead of per block)
    ),
    TransformerKind(
        "sd3",
        "Stable Diffusion 3",
        (sd3.FAMILY,),
        ("sd3",),
        "joint_blocks.0.context_block.adaLN_modulation.1.bias",
        "pos_embed.proj.weight",
        sd3_plan,
        {"clip_l": "text_encoder", "clip_g": "text_encoder_2", "t5xxl": sd3.T5},
        _sd3_repo,
    ),
    TransformerKind(
        "z-image",
        "Z-Image",
        (z_image.FAMILY,),
        ("lumina2",),
        "layers.0.attention.qkv.weight",
        "layers.0.attention.to_q.weight",
        z_image_plan,
        {},
        lambda shapes: "Tongyi-MAI/Z-Image-Turbo",  # the base model shares its keys: config=Tongyi-MAI/Z-Image
        unused=("norm_final.weight",),  # a final norm that ComfyUI's NextDiT defines and never applies
    ),
    TransformerKind(
        "flux2",
        "FLUX.2 [klein]",
        (flux2.FAMILY,),
        ("flux",),
        FLUX2_MODULATION[0],
        FLUX2_MODULATION[1],
        flux2_plan,
        {},
        klein_repo,
    ),
)
SERVED = ", ".join(kind.label for kind in KINDS)
ARCHITECTURES = sorted({name for kind in KINDS for name in kind.architectures})


def _kind_of_keys(names: set[str]) -> tuple[TransformerKind, bool] | None:
    """The kind of a transformer's (prefix-free) keys and whether they are the original layout, or None."""
    kinds = [kind for kind in KINDS if not any(name in names for name in kind.unlike)]
    for kind in kinds:
        if kind.marker in names:
            return kind, True
    for kind in kinds:
        if kind.diffusers_marker in names and not any(
            name.startswith(("input_blocks.", "down_blocks.")) for name in names
        ):
            return kind, False
    return None


def is_transformer_file(source: Any) -> bool:
    """A GGUF file, or a .safetensors whose keys are a transformer of `KINDS` (its header is all that is read)."""
    if source is None:
        return False
    path = Path(source).expanduser()
    if not path.is_file():
        return False
    if path.suffix.lower() == GGUF_SUFFIX:
        return True
    if path.suffix.lower() != ".safetensors":
        return False
    try:
        names = set(strip_prefix(map_safetensors(path)))
    except WeightsError:
        return False  # the single-file reader says what is wrong with it
    return _kind_of_keys(names) is not None


def _hub_folder(repo_id: str, where: str, variant: str | None) -> Path:
    """A family's Hub repo without its transformer's weights: configs, tokenizers, scheduler, text encoders, VAE."""
    hint = (
        f"{where}: its text encoders, VAE and configs come from {repo_id!r} on the Hugging Face Hub, which cannot be "
        f"reached (or is gated: log in with `hf auth login`) and is not in the local cache. Name a diffusers folder "
        f"of the same model for them: config=DIR (--config DIR)"
    )

    def choose(files: list[str]) -> list[str]:
        return [f for f in select_hub_files(files, variant) if not re.match(r"^transformer/.*\.safetensors", f)]

    return hub_snapshot(repo_id, hint, choose)


@dataclass
class TransformerFile:
    path: Path
    kind: TransformerKind
    transformer: dict[str, Any]  # diffusers' names; Int8Kernel (our layout) where the file held Q8_0
    others: dict[str, dict[str, np.ndarray]]  # an all-in-one file's VAE (original layout) and text encoders
    folder: ModelFolder  # everything else; its name is the file

    def scheduler(self, config: SchedulerConfig) -> SchedulerConfig:
        return config

    def component_tensors(self, configs: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """The components the file holds, by diffusers' names; the loader reads the rest from `folder`."""
        out: dict[str, dict[str, Any]] = {"transformer": self.transformer}
        for name, tensors in self.others.items():
            out[name] = vae_to_diffusers(tensors, configs["vae"]) if name == "vae" else tensors
        return {name: tensors for name, tensors in out.items() if name in configs}


def _read(path: Path, dtype: str) -> tuple[dict[str, np.ndarray], dict[str, int], str | None]:
    """The file's tensors, a GGUF's tensor types and architecture; a GGUF of an architecture we do not serve is
    refused by name."""
    if path.suffix.lower() == GGUF_SUFFIX:
        contents = read_gguf(path, dtype)
        if contents.architecture not in ARCHITECTURES:
            served = ", ".join(f"{kind.label} ({'/'.join(kind.architectures)})" for kind in KINDS)
            raise SourceError(
                f"{path}: a GGUF file of architecture {contents.architecture!r}, which this engine does not serve; "
                f"it serves GGUF transformers of {served}"
            )
        return contents.tensors, contents.types, contents.architecture
    try:
        return map_safetensors(path), {}, None
    except WeightsError as err:
        raise SourceError(str(err)) from err


def _all_in_one(tensors: Mapping[str, np.ndarray], kind: TransformerKind) -> dict[str, dict[str, np.ndarray]]:
    """An all-in-one file's VAE (`first_stage_model.`) and text encoders (`text_encoders.NAME.transformer.`)."""
    out: dict[str, dict[str, np.ndarray]] = {}
    vae = {k[len(VAE_PREFIX) :]: v for k, v in tensors.items() if k.startswith(VAE_PREFIX)}
    if vae:
        out["vae"] = vae
    for theirs, ours in kind.text_encoders.items():
        prefix = f"{TEXT_PREFIX}{theirs}.transformer."
        found = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        if found:
            out[ours] = found
    return out


class ScaledFP8:
    """A weight of ComfyUI's "scaled" fp8 files (`scaled_fp8` among the keys): fp8 values beside `NAME.scale_weight`,
    the number they were divided by; the weight is their product, computed in f32 when it is read (a slice or
    `np.asarray`), one tensor at a time."""

    dtype = np.dtype(np.float32)

    def __init__(self, values: np.ndarray, scale: np.ndarray):
        self.values, self.scale = values, np.asarray(scale, np.float32)
        self.shape, self.ndim = values.shape, values.ndim

    def __getitem__(self, index) -> np.ndarray:
        return self.values[index].astype(np.float32) * self.scale

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        product = self[...]
        return product if dtype is None else product.astype(dtype)


def _unscaled(tensors: dict[str, Any]) -> dict[str, Any]:
    """A scaled fp8 file's weights as their products (`ScaledFP8`); `scale_input` (the activations' scale of fp8
    matmuls) has no use once the weights are widened. Any other file as it is."""
    if not any(name.endswith("scaled_fp8") for name in tensors):
        return tensors
    out = {}
    for name, array in tensors.items():
        if name.endswith(("scaled_fp8", ".scale_input", ".scale_weight")):
            continue
        scale = tensors.get(name.removesuffix(".weight") + ".scale_weight") if name.endswith(".weight") else None
        out[name] = array if scale is None else ScaledFP8(array, scale)
    return out


def _int8(transformer: dict[str, Any], dtype: str) -> dict[str, Any]:
    """The linear weights a GGUF holds as Q8_0 as Int8Kernels in our layout ([in, out]), values and block scales as
    the file has them (`Q8Tensor.kernel`), the scales in the run dtype. One whose blocks cross its rows (reshaped to
    be quantized) is widened instead, as its values."""
    scale_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    chosen = [
        k for k, v in transformer.items() if isinstance(v, Q8Tensor) and v.rows_of_blocks and k.endswith(".weight")
    ]
    return {**transformer, **{name: transformer[name].kernel(scale_dtype) for name in chosen}}


def open_transformer_file(source: str | Path, dtype: str, config: str | Path | None = None) -> TransformerFile:
    """Reads a transformer file of one of `KINDS` (mapped; a GGUF dequantized where it must be), tells its kind from
    its keys and finds the folder that supplies the rest."""
    path = Path(source).expanduser()
    where = str(source)
    raw, types, architecture = _read(path, dtype)
    if types:
        log.info("%s: GGUF of %s", where, ", ".join(f"{n} {kind}" for kind, n in sorted(types.items())))
    raw = _unscaled(raw)
    transformer = strip_prefix(raw)
    found = _kind_of_keys(set(transformer))
    if found is None:
        heads = sorted({".".join(name.split(".")[:2]) for name in transformer})
        listed = ", ".join(heads[:12]) + (" ..." if len(heads) > 12 else "") if heads else "no tensors"
        raise SourceError(f"{where}: not a {SERVED} transformer in a layout this engine reads; found {listed}")
    kind, original = found
    if architecture is not None and architecture not in kind.architectures:
        raise SourceError(
            f"{where}: a GGUF file of architecture {architecture!r} holding a {kind.label} transformer, whose GGUF "
            f"files are {' or '.join(map(repr, kind.architectures))}: it was converted as another model"
        )
    others = _all_in_one(raw, kind) if len(transformer) < len(raw) else {}
    if original:
        transformer = {name: v for name, v in transformer.items() if name not in kind.unused}
        try:
            plan = kind.plan({k: tuple(v.shape) for k, v in transformer.items()})
        except KeyError as err:  # a tensor the widths are read from
            raise SourceError(f"{where}: not a whole {kind.label} transformer: it lacks {err.args[0]}") from err
        try:
            transformer = apply_plan(plan, transformer, where, f"a whole {kind.label} transformer")
        except WeightsError as err:
            raise SourceError(str(err)) from err
    transformer = _int8(transformer, dtype)
    shapes = {name: tuple(v.shape) for name, v in strip_prefix(raw).items()}
    folder = _config_folder(kind, config, where, shapes, dtype)
    return TransformerFile(path, kind, transformer, others, dataclasses.replace(folder, name=where))


def _config_folder(
    kind: TransformerKind, config: str | Path | None, where: str, shapes: Shapes, dtype: str
) -> ModelFolder:
    if config is not None and Path(config).expanduser().is_dir():
        folder = resolve(config)
    else:
        repo = str(config) if config is not None else kind.repo(shapes)
        if repo is None:
            raise SourceError(
                f"{where}: a {kind.label} transformer of a width no published model of this kind has; name its "
                f"diffusers folder or Hub id as config=DIR (--config DIR)"
            )
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
            raise ConfigError(f"config {repo!r} is neither a diffusers folder nor a Hub id like 'owner/name'")
        root = _hub_folder(repo, where, "fp16" if dtype in ("float16", "bfloat16") else None)
        index_path = root / "model_index.json"
        if not index_path.is_file():
            raise SourceError(f"{where}: {repo}'s cached copy has no model_index.json; name config=DIR instead")
        index = json.loads(index_path.read_text())
        folder = ModelFolder(root=root, name=repo, class_name=index.get("_class_name", ""), index=index)
    if family_of(folder.class_name) not in kind.families:
        raise SourceError(
            f"{where} is a {kind.label} transformer, but its config {folder.name!r} is a "
            f"{folder.class_name or 'folder'} of another kind: name a {kind.label} diffusers folder or Hub id as config="
        )
    return folder
