"""Where a model comes from: the embedded default, a local diffusers folder, or a Hub id.

A diffusers folder holds `model_index.json` and one sub-folder per component (`unet/`,
`vae/`, `text_encoder/`, `tokenizer/`, `scheduler/`, and for SDXL `text_encoder_2/`,
`tokenizer_2/`), each with its `config.json` and `*.safetensors`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import SourceError

ASSETS = Path(__file__).parents[1] / "assets"  # engine/assets
DEFAULT_MODEL = ASSETS / "default"

# Every family's networks (SD3 and FLUX.1 name their denoiser `transformer`, SD3 its T5 `text_encoder_3`)
WEIGHT_COMPONENTS = ("unet", "transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3")
SAFETY_FEATURE_EXTRACTOR = "feature_extractor/preprocessor_config.json"  # the safety checker's preprocessing
_WEIGHT_NAME = re.compile(
    r"^(diffusion_pytorch_model|model)(\.(?P<variant>[\w-]+?))?(-\d+-of-\d+)?\.safetensors(\.index\.json)?$"
)


@dataclass(frozen=True)
class ModelFolder:
    root: Path
    name: str  # what the user asked for: "embedded default", a folder, or a Hub id
    class_name: str  # model_index.json's `_class_name`: the pipeline, which names the family
    index: dict
    # What a load reads from the folder once for several users (`read_once`): a prompt's ids and its fit
    # (`TextSide.fit_prompts`) read one tokenizer
    _read: dict = field(default_factory=dict, compare=False, repr=False)

    def read_once(self, key: str, read: Callable[[], Any]) -> Any:
        """`read()` the first time `key` is asked of this folder; the same object every time after."""
        if key not in self._read:
            self._read[key] = read()
        return self._read[key]

    def component(self, name: str) -> Path:
        path = self.root / name
        if not path.is_dir():
            raise SourceError(f"{self.name}: the model folder has no {name}/ sub-folder")
        return path

    def has(self, name: str) -> bool:
        """Whether the folder holds component `name`: a sub-folder that model_index.json names with a class
        (diffusers saves a left-out component, SD3 without T5, as [null, null])."""
        entry = self.index.get(name)
        return (self.root / name).is_dir() and isinstance(entry, list) and entry[-1] is not None

    def weight_files(self, name: str, variant: str | None = None) -> list[Path]:
        """The safetensors files of one component, preferring `variant` (e.g. "fp16") when present."""
        folder = self.component(name)
        files = _weight_files_in(folder, variant)
        if not files:
            bins = [f.name for f in folder.glob("*.bin")]
            hint = " (only PyTorch .bin files, which we do not read: convert them to safetensors)" if bins else ""
            raise SourceError(f"{self.name}: no .safetensors weights in {name}/{hint}")
        return files


def _prefer(by_variant: dict[str | None, list], variant: str | None) -> list:
    """The files of `variant` when there are some, else the plain ones, else some variant's (fp16 only)."""
    return by_variant.get(variant) or by_variant.get(None) or next(iter(by_variant.values()), [])


def _weight_files_in(folder: Path, variant: str | None, stem: str | None = None) -> list[Path]:
    """A folder's safetensors files (named `stem`*, when given), one variant's, preferring `variant`."""
    by_variant: dict[str | None, list[Path]] = {}
    for file in sorted(folder.iterdir()):
        match = _WEIGHT_NAME.match(file.name)
        if match and (stem is None or match[1] == stem) and not file.name.endswith(".index.json"):
            by_variant.setdefault(match["variant"], []).append(file)
    return _prefer(by_variant, variant)


def select_hub_files(files: list[str], variant: str | None = None, safety_checker: bool = False) -> list[str]:
    """The files of a Hub repo that a text-to-image load needs: configs, tokenizers, one weights variant.

    With `safety_checker`, also the checker's config and weights and the feature extractor's config.
    """
    components = WEIGHT_COMPONENTS + (("safety_checker",) if safety_checker else ())
    wanted = [f for f in files if f == "model_index.json" or re.match(r"^(scheduler|tokenizer(_[23])?)/", f)]
    wanted += [f for f in files if re.match(rf"^({'|'.join(components)})/config\.json$", f)]
    if safety_checker:
        wanted += [f for f in files if f == SAFETY_FEATURE_EXTRACTOR]
    for component in components:
        by_variant: dict[str | None, list[str]] = {}
        for f in files:
            head, _, tail = f.partition("/")
            match = _WEIGHT_NAME.match(tail) if head == component else None
            if match:
                by_variant.setdefault(match["variant"], []).append(f)
        wanted += _prefer(by_variant, variant)
    return sorted(set(wanted))


def hub_files_or_cache(repo_id: str, hint: str) -> list[str] | Path:
    """A Hub repository's file names; offline (or unreachable), the folder of its local snapshot instead, which is
    then all there is to read. Neither: SourceError saying `hint` and why the Hub could not be asked."""
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    try:
        return huggingface_hub.list_repo_files(repo_id)
    except (OfflineModeIsEnabled, OSError, HfHubHTTPError) as err:
        try:
            return Path(huggingface_hub.snapshot_download(repo_id, local_files_only=True))
        except Exception as cache_err:
            raise SourceError(f"{hint} ({type(err).__name__}: {err})") from cache_err


def hub_snapshot(repo_id: str, hint: str, choose: Callable[[list[str]], list[str]]) -> Path:
    """The files `choose` picks from a Hub repository's file names, downloaded (or found in the cache); offline, the
    repository's local snapshot as it is. Failing both: SourceError saying `hint` and why."""
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError

    files = hub_files_or_cache(repo_id, hint)
    if isinstance(files, Path):
        return files
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=choose(files)))
    except (OSError, HfHubHTTPError) as err:
        raise SourceError(f"{hint} ({type(err).__name__}: {err})") from err


def _fetch_from_hub(repo_id: str, variant: str | None, safety_checker: bool = False) -> Path:
    offline_hint = (
        f"cannot fetch {repo_id!r} from the Hugging Face Hub and it is not in the local cache. "
        f"Download it where there is a network (`hf download {repo_id} --local-dir DIR`) "
        "and pass that folder instead (--model DIR or MODEL_ID=DIR)."
    )
    return hub_snapshot(repo_id, offline_hint, lambda files: select_hub_files(files, variant, safety_checker))


def component_weight_files(folder: Path, variant: str | None, what: str) -> list[Path]:
    """One model's `diffusion_pytorch_model*.safetensors` in `folder` (a ControlNet, a VAE), preferring `variant`."""
    files = _weight_files_in(folder, variant, stem="diffusion_pytorch_model")
    if not files:
        raise SourceError(f"{folder}: no diffusion_pytorch_model*.safetensors {what} weights")
    return files


def _fetch_component(repo_id: str, variant: str | None, what: str, subfolder: str) -> Path:
    """A Hub repository holding one model (config.json and its weights at the top, or in `subfolder/` of a
    pipeline repository), downloaded; offline, whatever the local cache holds."""

    def choose(files: list[str]) -> list[str]:
        inner = "config.json" not in files and f"{subfolder}/config.json" in files
        prefix = f"{subfolder}/" if inner else ""
        by_variant: dict[str | None, list[str]] = {}
        for f in files:
            # That folder's own files only: a name with a further "/" never matches.
            match = _WEIGHT_NAME.match(f[len(prefix) :]) if f.startswith(prefix) else None
            if match and match[1] == "diffusion_pytorch_model":
                by_variant.setdefault(match["variant"], []).append(f)
        return [f"{prefix}config.json", *_prefer(by_variant, variant)]

    hint = f"cannot fetch the {what} {repo_id!r} from the Hugging Face Hub and it is not in the local cache"
    return hub_snapshot(repo_id, hint, choose)


def component_folder(source: str | Path, what: str, subfolder: str, variant: str | None = None) -> Path:
    """The folder of one diffusers model (a ControlNet, a VAE): a folder with config.json, a pipeline folder's
    `subfolder/`, or a Hub id (the same two layouts), downloaded."""
    if Path(source).expanduser().is_dir():
        root = Path(source).expanduser()
    elif isinstance(source, str) and re.fullmatch(r"[\w.-]+/[\w.-]+", source):
        root = _fetch_component(source, variant, what, subfolder)
    else:
        raise SourceError(f"{what} source {str(source)!r} is neither a folder nor a Hub id like 'owner/name'")
    if not (root / "config.json").is_file() and (root / subfolder / "config.json").is_file():
        root = root / subfolder
    if not (root / "config.json").is_file():
        raise SourceError(f"{source}: no config.json, so this is not a diffusers-format {what} folder")
    return root


def resolve(source: str | Path | None = None, variant: str | None = None, safety_checker: bool = False) -> ModelFolder:
    """Finds (and, for a Hub id, downloads) a diffusers-format folder and reads its model_index.json.

    `safety_checker`: a Hub download also fetches the safety checker's files (engine/loading/safety.py).
    """
    if source is None:
        root, name = DEFAULT_MODEL, "embedded default"
    elif Path(source).expanduser().is_dir():
        root, name = Path(source).expanduser(), str(source)
    elif isinstance(source, str) and re.fullmatch(r"[\w.-]+/[\w.-]+", source):
        root, name = _fetch_from_hub(source, variant, safety_checker), source
    else:
        raise SourceError(f"model source {str(source)!r} is neither a folder nor a Hub id like 'owner/name'")
    index_path = root / "model_index.json"
    if not index_path.is_file():
        raise SourceError(f"{name}: no model_index.json, so this is not a diffusers-format model folder")
    index = json.loads(index_path.read_text())
    return ModelFolder(root=root, name=name, class_name=index.get("_class_name", ""), index=index)
