"""Any VAE in place of a model's own: a diffusers `AutoencoderKL` (stabilityai/sd-vae-ft-mse) or `AutoencoderTiny`
(TAESD: madebyollin/taesd for SD 1.x/2.x, madebyollin/taesdxl for SDXL, taesd3, taef1 for FLUX.1, Kontext and
Z-Image; TAEF2 for FLUX.2 [klein], its config.json naming `use_midblock_gn`), as after diffusers'
`pipe.vae = AutoencoderTiny.from_pretrained(...)`.

The class comes from the folder's config.json `_class_name`; loading is strict like every load (every tensor
matched). The VAE must draw the latents the model's UNet draws: the same channels and the same pixels per
latent, or it is refused by name. Sampling reads only what both classes share: `encode` -> (mean, logvar),
`decode`, and the config's `scaling_factor`, `shift_factor`, `latents_mean`/`latents_std`, `latent_channels`,
`vae_scale_factor`.

A tiny VAE also comes in madebyollin/taesd's own files, without config.json (`taesd_files.py`): one file, or a folder
or Hub repository holding them (madebyollin/taef2). A decoder alone draws pictures and previews but reads none: the
requests that need a picture read (image to image, inpainting, reference pictures, hires fix through an upscaler
of pixels) are refused by name (`request.Limits.encodes`), and a model that cannot draw without one is refused at start.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

from flax import nnx

from ..errors import ConfigError, SourceError, WeightsError
from ..models.autoencoder_tiny import AutoencoderTiny
from ..models.config import AutoencoderTinyConfig, VAEConfig
from ..models.vae import AutoencoderKL
from . import taesd_files
from .sources import component_folder, component_weight_files, hub_files_or_cache, hub_snapshot
from .weights import convert, read_safetensors

# config.json `_class_name` -> (config, model)
VAE_CLASSES = {"AutoencoderKL": (VAEConfig, AutoencoderKL), "AutoencoderTiny": (AutoencoderTinyConfig, AutoencoderTiny)}
OWN_VAE = "the model's own VAE"  # what `LoadedModel.vae` says when no other VAE was given


@dataclass
class LoadedVAE:
    name: str  # what the user asked for: a folder or a Hub id
    class_name: str  # "AutoencoderKL" | "AutoencoderTiny"
    config: VAEConfig | AutoencoderTinyConfig
    graphdef: nnx.GraphDef
    params: nnx.State  # host numpy arrays in the run dtype (f32 where fp16 would overflow: `force_upcast`)
    encodes: bool = True  # False for a tiny VAE's decoder alone: it draws pictures but reads none


def read_vae_config(
    path: Path, default_class: str | None = None
) -> tuple[object, VAEConfig | AutoencoderTinyConfig | None]:
    """A VAE's config.json read as the class its `_class_name` names (`default_class` where it names none):
    (that name, the config), or (that name, None) when it is not a class we have."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(f"cannot read {path}: {err}") from err
    class_name = raw.get("_class_name", default_class) if isinstance(raw, dict) else None
    if not isinstance(class_name, str) or class_name not in VAE_CLASSES:
        return class_name, None
    return class_name, VAE_CLASSES[class_name][0].from_dict(raw, where=str(path))


def load_vae(source: str | Path, dtype: str = "float32") -> LoadedVAE:
    """A diffusers-format VAE folder (config.json + diffusion_pytorch_model*.safetensors), a pipeline folder's
    `vae/` sub-folder, or a Hub id (either layout); or a tiny VAE in madebyollin/taesd's files: one file, a folder or
    a Hub id holding them without config.json. Every tensor must fit (missing ones are named)."""
    found = vae_files(source)
    if isinstance(found, list):
        return load_tiny_vae_files(source, found, dtype)
    variant = "fp16" if dtype in ("float16", "bfloat16") else None
    root = component_folder(found, "VAE", "vae", variant)
    class_name, cfg = read_vae_config(root / "config.json")
    if cfg is None:
        raise SourceError(
            f"{source}: a VAE of class {class_name!r} is not supported (supported: {', '.join(VAE_CLASSES)})"
        )
    model_class = VAE_CLASSES[class_name][1]
    # As the model's own VAE: one that overflows in fp16 runs in f32 (diffusers upcasts it too).
    run_dtype = "float32" if dtype == "float16" and cfg.force_upcast else dtype
    tensors = read_safetensors(component_weight_files(root, variant, "VAE"))
    graphdef, params = convert(lambda: model_class(cfg, nnx.Rngs(0)), tensors, run_dtype, where=str(source))
    return LoadedVAE(name=str(source), class_name=class_name, config=cfg, graphdef=graphdef, params=params)


def _diffusers_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() or (folder / "vae" / "config.json").is_file()


def vae_files(source: str | Path) -> list[Path] | str | Path:
    """The taesd.py files `source` names (a file; a folder, or a Hub repository's top, without config.json), or what
    `component_folder` reads a diffusers-format VAE from: `source` itself, or the local snapshot an offline Hub id
    found (and `component_folder` refuses what is neither a path nor a Hub id)."""
    path = Path(source).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        return source if _diffusers_folder(path) else taesd_files.folder_files(path, str(source))
    if not (isinstance(source, str) and re.fullmatch(r"[\w.-]+/[\w.-]+", source)):
        return source
    hint = f"cannot fetch the VAE {source!r} from the Hugging Face Hub and it is not in the local cache"
    names = hub_files_or_cache(source, hint)
    if isinstance(names, Path):  # offline: the local snapshot is all there is
        return names if _diffusers_folder(names) else taesd_files.folder_files(names, source)
    if "config.json" in names or "vae/config.json" in names:
        return source
    if not taesd_files.weight_files(names):
        raise SourceError(
            f"{source}: the Hub repository holds neither a diffusers-format VAE (config.json) nor a tiny VAE in "
            f"madebyollin/taesd's files ({', '.join('*' + s for s in taesd_files.SUFFIXES)} at its top)"
        )
    return taesd_files.folder_files(hub_snapshot(source, hint, taesd_files.weight_files), source)


def load_tiny_vae_files(source: str | Path, files: list[Path], dtype: str) -> LoadedVAE:
    """A tiny VAE from taesd.py's files, its config read from their shapes (`taesd_files`); built without an
    encoder when none is given."""
    where = str(source)
    tiny = taesd_files.read_tiny_vae(files, where)
    try:
        graphdef, params = convert(
            lambda: AutoencoderTiny(tiny.config, nnx.Rngs(0), encoder=tiny.encodes), tiny.tensors, dtype, where=where
        )
    except WeightsError as err:
        raise taesd_files.check_fits(where, err) from err
    return LoadedVAE(where, "AutoencoderTiny", tiny.config, graphdef, params, encodes=tiny.encodes)


def vae_encodes(params: nnx.State) -> bool:
    """Whether the VAE in a model's param tree reads pictures: every VAE but a tiny one's decoder alone."""
    return "encoder" in params["vae"]


def attach_vae(model, vae: LoadedVAE, reads_pictures: bool = False):
    """`model` (a `families.loader.LoadedModel`) with `vae` as `Models.vae` in its one param tree and as its
    `vae_config`. Refuses a VAE whose latents are not the UNet's: other channels, or other pixels per latent; and a
    decoder alone where every request reads a picture (`reads_pictures`: an inpainting model, one that only edits)."""
    if reads_pictures and not vae.encodes:
        raise SourceError(
            f"VAE {vae.name} is a tiny VAE's decoder alone, and the model {model.name} reads a picture in every "
            "request, which needs its encoder: give the folder holding both files (e.g. taesd_encoder.safetensors "
            "beside taesd_decoder.safetensors)"
        )
    problems = []
    want = model.unet_latent_channels
    if vae.config.latent_channels != want:
        problems.append(f"its latent_channels is {vae.config.latent_channels}, the model's UNet draws {want}")
    # The VAEs' own pixels per latent: the steps' may be more (FLUX.2 packs 2x2 of its VAE's latents)
    factor, own = vae.config.vae_scale_factor, model.vae_config.vae_scale_factor
    if factor != own:
        problems.append(
            f"its vae_scale_factor is {factor} (pixels per latent along a side), the model's own VAE's is {own}"
        )
    if problems:
        raise SourceError(
            f"VAE {vae.name} does not fit the model {model.name}: {'; '.join(problems)}. "
            "Is it a VAE for another model family (SD 1.x/2.x/XL draw 4 channels, SD3, FLUX.1 and Z-Image 16, "
            "FLUX.2 32)?"
        )
    models = nnx.merge(model.graphdef, model.params)  # host arrays stay host arrays
    models.vae = nnx.merge(vae.graphdef, vae.params)
    graphdef, params = nnx.split(models)
    return dataclasses.replace(model, graphdef=graphdef, params=params, vae_config=vae.config, vae=vae.name)
