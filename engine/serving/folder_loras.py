"""A models folder's LoRAs (`Lora/`), added to a model's engine at the first request that calls each.

A1111 reads a LoRA where a prompt calls it (`<lora:name:w>`) and nowhere else. So on a model served from a folder,
each LoRA is read, matched against the model (`lora.lora_factors`: one that does not fit is refused by name) and
added to the engine (`Engine.add_loras`) when a request first calls it, with no restart; a file put into `Lora/`
after the start is found by a rescan. Every folder LoRA a request does not call weighs 0 for it (a LoRA given at
start, `--lora`, keeps diffusers' 1.0 when left out).
"""

from __future__ import annotations

import dataclasses
import threading

from ..errors import InvalidRequest, SourceError, WeightsError
from ..loading.lora import load_lora, lora_factors
from ..loading.models_folder import ModelsFolder
from ..request import GenerationRequest
from .engine import Engine


class FolderLoRAs:
    """The folder's LoRAs each model's engine holds, by the model's title."""

    def __init__(self, folder: ModelsFolder):
        self.folder = folder
        self._added: dict[str, set[str]] = {}  # title -> the folder's LoRAs added to its engine
        self._lock = threading.Lock()

    @staticmethod
    def present(engine: Engine, request: GenerationRequest) -> bool:
        """Every LoRA the request calls is in the engine already."""
        return all(name in engine.loras.names for name in request.lora_scales or {})

    def add(self, title: str, engine: Engine, request: GenerationRequest) -> None:
        """Adds the LoRAs the request calls that the engine lacks; refuses by name one the folder does not have
        (after a rescan of `Lora/`) or that does not fit the model."""
        with self._lock:
            missing = [name for name in request.lora_scales or {} if name not in engine.loras.names]
            if any(name not in self.folder.loras for name in missing):
                self.folder.scan_loras()
            unknown = [name for name in missing if name not in self.folder.loras]
            if unknown:
                offered = ", ".join(sorted({*engine.loras.names, *self.folder.loras})) or "none"
                raise InvalidRequest(f"unknown LoRA {', '.join(map(repr, unknown))}; this server offers: {offered}")
            factors = {}
            for name in missing:
                try:
                    factors[name] = lora_factors(load_lora(self.folder.loras[name]), engine.model.params)
                except (SourceError, WeightsError, ValueError) as err:
                    reason = self.folder.public(str(err))
                    raise InvalidRequest(f"LoRA {name!r} does not fit model {title!r}: {reason}") from err
            if factors:
                engine.add_loras(factors)
                self._added.setdefault(title, set()).update(factors)

    def weighed(self, title: str, request: GenerationRequest) -> GenerationRequest:
        """The request with every folder LoRA of the model's engine that it does not call at weight 0."""
        left_out = self._added.get(title, set()) - set(request.lora_scales or {})
        if not left_out:
            return request
        return dataclasses.replace(request, lora_scales={**dict.fromkeys(left_out, 0.0), **(request.lora_scales or {})})

    def forget(self, title: str) -> None:
        """The model's engine is closed: a new one starts with none of the folder's LoRAs."""
        self._added.pop(title, None)
