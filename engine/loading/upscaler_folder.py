"""The upscalers a server offers: PIL's `Lanczos` and `Nearest`, and every network file found in its folders
(`--upscalers DIR`, or the models folder's `ESRGAN/` and `RealESRGAN/`, as A1111 keeps them).

A file is read and its layout told at start (`upscaler.detect`): the listing knows each network's architecture and
scale, and a file of no known layout, or a pickle that names code, is left out with its reason kept, so asking for
it says why. Its weights are converted and placed on the device at its first use, then kept.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import jax

from ..errors import InvalidRequest, SourceError, WeightsError
from .upscaler import UPSCALER_SUFFIXES, LoadedUpscaler, detect, load_upscaler, read_state_dict

log = logging.getLogger("jax-sd")

RESAMPLER_NAMES = ("Lanczos", "Nearest")  # engine.sampling.upscale.RESAMPLERS, named here without PIL
MODEL_SUBFOLDERS = ("ESRGAN", "RealESRGAN")  # where A1111 keeps upscalers inside its models folder


@dataclass(frozen=True)
class UpscalerEntry:
    name: str  # the file's stem
    path: Path
    architecture: str  # "RRDBNet" | "SRVGGNetCompact"
    scale: int  # output pixels per input pixel along a side, in one pass


class UpscalerFolder:
    """The offered upscalers by name: `names()`, `entries` (the networks), `refused` (file stem -> why) and
    `get(name)`, which `engine.sampling.upscale.upscale` takes as its `upscaler`."""

    def __init__(self, folders: Iterable[str | Path] = ()):
        self.entries: dict[str, UpscalerEntry] = {}
        self.refused: dict[str, str] = {}
        self._loaded: dict[str, LoadedUpscaler] = {}
        self._lock = threading.Lock()
        for folder in folders:
            for file in sorted(p for p in Path(folder).rglob("*") if p.suffix in UPSCALER_SUFFIXES and p.is_file()):
                self._add(file)

    @classmethod
    def for_models(cls, models: str | Path | None = None, upscalers: str | Path | None = None) -> UpscalerFolder:
        """`upscalers` where given, else the `ESRGAN/` and `RealESRGAN/` folders of `models` that exist."""
        if upscalers is not None:
            if not Path(upscalers).is_dir():
                raise SourceError(f"{upscalers}: no such folder of upscalers")
            return cls([upscalers])
        folders = [Path(models) / sub for sub in MODEL_SUBFOLDERS] if models is not None else []
        return cls([f for f in folders if f.is_dir()])

    def _add(self, file: Path) -> None:
        name = file.stem
        if name in self.entries or name in self.refused or name in RESAMPLER_NAMES:
            log.warning("upscaler %s left out: an upscaler named %r is already offered", file, name)
            return
        try:
            architecture, config, _ = detect(read_state_dict(file), str(file))
        except (SourceError, WeightsError) as err:
            self.refused[name] = str(err)
            log.warning("upscaler %s left out: %s", file, err)
            return
        self.entries[name] = UpscalerEntry(name, file, architecture, config.scale)

    def names(self) -> list[str]:
        """The resamplers, then the networks in the order of their files."""
        return [*RESAMPLER_NAMES, *self.entries]

    def get(self, name: str) -> str | LoadedUpscaler:
        """A resampler's name, or the network loaded (once; its params on the device). Refused by name: an unknown
        name (InvalidRequest, with the offered ones), a file left out at start (its reason), weights that do not fit
        (WeightsError)."""
        if name in RESAMPLER_NAMES:
            return name
        if name in self.refused:
            raise SourceError(f"upscaler {name!r} is not offered: {self.refused[name]}")
        if name not in self.entries:
            raise InvalidRequest(f"unknown upscaler {name!r}; this server offers {', '.join(self.names())}")
        with self._lock:  # one load per network, however many requests ask at once
            if name not in self._loaded:
                loaded = load_upscaler(self.entries[name].path)
                self._loaded[name] = replace(loaded, params=jax.device_put(loaded.params))
            return self._loaded[name]
