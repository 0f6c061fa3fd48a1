"""A models folder in AUTOMATIC1111's layout, and the names a client may call its checkpoints by.

    MODELS/Stable-diffusion/   checkpoints: single files (.safetensors, .ckpt, .gguf) and diffusers folders alike
    MODELS/Lora/               LoRA files, called from a prompt as <lora:NAME:WEIGHT>
    MODELS/VAE/                VAEs (listed, as A1111's /sd-vae lists them)
    MODELS/embeddings/         textual inversion embeddings, for every checkpoint
    MODELS/ESRGAN/, RealESRGAN/  upscaler networks (loading/upscaler_folder.py)

A checkpoint is named as A1111 names it (`modules/sd_models.py`, `CheckpointInfo`): `name` is its path under
`Stable-diffusion/` ("sub/dreamshaper_8.safetensors"), `model_name` that without its extension and with "/" as "_",
`hash` the first 10 hex digits of the file's sha256 (A1111's "shorthash"), `title` "name [hash]". A client may
call it by any of those, by its full sha256, or by its file's stem; a title with a stale hash still finds its name.
A diffusers folder has no file to hash: its title is its name. Hashes are kept per (path, size, mtime) in
`HASH_CACHE` (JAX_SD_HASH_CACHE, default ~/.cache/jax-sd/model-hashes.json, as A1111 keeps its cache.json): a
start or a rescan reads only new or changed files (a 2 GB checkpoint takes seconds to hash).

A file that is not a checkpoint the engine can read (a truncated safetensors, a header that does not parse) is
listed with `problem` saying why, and never offered; one that fails when it is loaded is marked so then.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InvalidRequest, SourceError

log = logging.getLogger("jax-sd")

CHECKPOINTS = "Stable-diffusion"
LORAS = "Lora"
VAES = "VAE"
EMBEDDINGS = "embeddings"
CHECKPOINT_SUFFIXES = (".safetensors", ".ckpt", ".gguf")
LORA_SUFFIXES = (".safetensors",)
VAE_SUFFIXES = (".safetensors", ".ckpt", ".pt")
HASH_CACHE = "JAX_SD_HASH_CACHE"  # the file the checkpoints' hashes are kept in
_HASHED = re.compile(r"^(?P<name>.*?)\s*\[(?P<hash>[0-9a-fA-F]{8,64})\]$")


@dataclass(frozen=True)
class Checkpoint:
    """One entry of `Stable-diffusion/`, named as A1111 names it."""

    name: str  # its path under Stable-diffusion/, with the extension: "sub/dreamshaper_8.safetensors"
    path: Path
    sha256: str | None = None  # None: a diffusers folder (no one file to hash)
    problem: str | None = None  # why it cannot be used; None: usable

    @property
    def model_name(self) -> str:
        """A1111's `model_name`: the name without its extension, "/" as "_"."""
        stem = self.name[: -len(self.path.suffix)] if self.path.is_file() and self.path.suffix else self.name
        return stem.replace("/", "_").replace("\\", "_")

    @property
    def hash(self) -> str | None:
        """A1111's short hash: the sha256's first 10 hex digits."""
        return self.sha256[:10] if self.sha256 else None

    @property
    def title(self) -> str:
        return f"{self.name} [{self.hash}]" if self.hash else self.name

    def aliases(self) -> set[str]:
        """Every name a client may call it by (A1111's `CheckpointInfo.ids`, and the file's stem)."""
        names = {self.title, self.name, self.model_name, Path(self.name).stem}
        if self.sha256:
            names |= {self.hash, self.sha256, f"{self.model_name} [{self.hash}]"}
        return names

    def a1111(self) -> dict:
        """Its item of A1111's /sdapi/v1/sd-models; `filename` is its path in the models folder, not the server's."""
        return {
            "title": self.title,
            "model_name": self.model_name,
            "hash": self.hash,
            "sha256": self.sha256,
            "filename": f"{CHECKPOINTS}/{self.name}",
            "config": None,
        }


def title_parts(title: str) -> tuple[str, str | None]:
    """(A1111's model name, short hash) from a checkpoint's title, for PNG parameters' `Model` and `Model hash`."""
    match = _HASHED.match(title)
    name, short = (match["name"], match["hash"]) if match else (title, None)
    stem = re.sub(r"\.(safetensors|ckpt|gguf)$", "", name)
    return stem.replace("/", "_").replace("\\", "_"), short


@dataclass
class ModelsFolder:
    """What a models folder holds; `scan()` reads it again (A1111's refresh-checkpoints, refresh-loras)."""

    root: Path
    checkpoints: dict[str, Checkpoint] = field(default_factory=dict)  # by title, in the folder's order
    loras: dict[str, Path] = field(default_factory=dict)  # name (the file's stem) -> file
    vaes: dict[str, Path] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def open(cls, root: str | Path) -> ModelsFolder:
        root = Path(root).expanduser()
        if not (root / CHECKPOINTS).is_dir():
            raise SourceError(
                f"{root}: not a models folder: it has no {CHECKPOINTS}/ (A1111's layout: {CHECKPOINTS}/, {LORAS}/, "
                f"{VAES}/, {EMBEDDINGS}/)"
            )
        folder = cls(root)
        folder.scan()
        return folder

    @property
    def embeddings(self) -> Path | None:
        path = self.root / EMBEDDINGS
        return path if path.is_dir() else None

    def scan(self) -> None:
        """Reads the folder again: new files are hashed and checked, removed ones leave the lists."""
        found = {}
        for path in _entries(self.root / CHECKPOINTS, CHECKPOINT_SUFFIXES, diffusers=True):
            checkpoint = self._checkpoint(path)
            if checkpoint.problem:
                log.warning("checkpoint %s left out: %s", checkpoint.name, checkpoint.problem)
            found[checkpoint.title] = checkpoint
        loras = {p.stem: p for p in _entries(self.root / LORAS, LORA_SUFFIXES)}
        vaes = {p.stem if p.is_file() else p.name: p for p in _entries(self.root / VAES, VAE_SUFFIXES, diffusers=True)}
        with self._lock:
            self.checkpoints, self.loras, self.vaes = found, loras, vaes

    def scan_loras(self) -> None:
        """Reads `Lora/` again (a LoRA a prompt calls that was not there at the last scan)."""
        loras = {p.stem: p for p in _entries(self.root / LORAS, LORA_SUFFIXES)}
        with self._lock:
            self.loras = loras

    def _checkpoint(self, path: Path) -> Checkpoint:
        name = path.relative_to(self.root / CHECKPOINTS).as_posix()
        if path.is_dir():
            return Checkpoint(name, path)
        problem = _file_problem(path)
        if problem:
            return Checkpoint(name, path, problem=problem)
        stat = path.stat()
        hashes = _hash_cache()
        entry = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
        if entry not in hashes:
            started = time.perf_counter()
            hashes[entry] = _sha256(path)
            log.info("hashed %s in %.1f s", name, time.perf_counter() - started)
            _save_hash_cache(hashes)
        return Checkpoint(name, path, sha256=hashes[entry])

    def usable(self) -> list[Checkpoint]:
        return [c for c in self.checkpoints.values() if not c.problem]

    def mark_unusable(self, title: str, problem: str) -> None:
        """A checkpoint that failed to load: listed with why, never offered again until a rescan."""
        with self._lock:
            old = self.checkpoints.get(title)
            if old is not None:
                self.checkpoints[title] = Checkpoint(old.name, old.path, old.sha256, problem)

    def match(self, wanted: str) -> Checkpoint:
        """The checkpoint a client names (as A1111's `get_closet_checkpoint_match`, exact names only: a title, a
        name with or without its extension, a short or full hash; a title whose hash is stale finds its name).
        Refused by name, with the names offered: an unknown name, an unusable checkpoint (with why)."""
        wanted = str(wanted).strip()
        candidates = [wanted]
        if match := _HASHED.match(wanted):
            candidates += [match["name"], match["hash"].lower()]
        for name in candidates:
            for checkpoint in self.checkpoints.values():
                if name in checkpoint.aliases():
                    if checkpoint.problem:
                        raise InvalidRequest(
                            f"model {checkpoint.name!r} cannot be used: {self.public(checkpoint.problem)}"
                        )
                    return checkpoint
        offered = ", ".join(repr(c.title) for c in self.usable()) or "none"
        raise InvalidRequest(f"model {wanted!r} is not served here; this server offers {offered}")

    def public(self, text: str) -> str:
        """`text` with the folder's place on the server replaced by its name (a refusal never shows server paths)."""
        return text.replace(str(self.root), "models")

    def lora_items(self) -> list[dict]:
        """A1111's /sdapi/v1/loras items: name, alias, the file's path in the models folder."""
        return [
            {"name": name, "alias": name, "path": f"{LORAS}/{path.relative_to(self.root / LORAS).as_posix()}"}
            for name, path in self.loras.items()
        ]

    def vae_items(self) -> list[dict]:
        """A1111's /sdapi/v1/sd-vae items: model_name and the file's path in the models folder."""
        return [
            {"model_name": name, "filename": f"{VAES}/{path.relative_to(self.root / VAES).as_posix()}"}
            for name, path in self.vaes.items()
        ]


def _entries(folder: Path, suffixes: tuple[str, ...], diffusers: bool = False) -> list[Path]:
    """Files with one of `suffixes` under `folder` and its sub-folders, and, with `diffusers`, the diffusers folders
    (a model_index.json, or a config.json: a VAE's; nothing inside one is an entry of its own), in the order A1111
    sorts them (case-insensitively). Hidden files and folders are skipped."""
    if not folder.is_dir():
        return []
    found = []
    for path in sorted(folder.iterdir(), key=lambda p: p.name.lower()):
        if path.name.startswith("."):
            continue
        if path.is_dir():
            whole = diffusers and any((path / marker).is_file() for marker in ("model_index.json", "config.json"))
            found += [path] if whole else _entries(path, suffixes, diffusers)
        elif path.suffix.lower() in suffixes:
            found.append(path)
    return found


def _file_problem(path: Path) -> str | None:
    """Why a checkpoint file cannot be read, told cheaply from its header; None where it looks whole."""
    if path.suffix.lower() != ".safetensors":
        return None  # .ckpt and .gguf are read whole at load: a broken one is marked then
    try:
        from safetensors import safe_open

        with safe_open(str(path), "np") as f:
            if not list(f.keys()):
                return "it holds no tensors"
    except Exception as err:  # safetensors' own errors: a truncated file, a header that does not parse
        return f"not a readable safetensors file ({type(err).__name__}: {str(err)[:120]})"
    return None


_hashes: dict[str, str] | None = None  # "path|size|mtime_ns" -> sha256, read from HASH_CACHE once per process
_hashes_lock = threading.Lock()


def _hash_file() -> Path:
    return Path(os.environ.get(HASH_CACHE) or Path.home() / ".cache" / "jax-sd" / "model-hashes.json")


def _hash_cache() -> dict[str, str]:
    global _hashes
    with _hashes_lock:
        if _hashes is None:
            try:
                _hashes = dict(json.loads(_hash_file().read_text()))
            except (OSError, ValueError, TypeError):  # none yet, or unreadable: hashed again
                _hashes = {}
        return _hashes


def _save_hash_cache(hashes: dict[str, str]) -> None:
    path = _hash_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _hashes_lock:
            text = json.dumps(hashes, indent=0, sort_keys=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(text)
        partial.replace(path)
    except OSError as err:  # a read-only home: the hashes are kept for this process only
        log.warning("could not keep checkpoint hashes in %s: %s", path, err)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
