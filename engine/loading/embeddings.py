"""Textual inversion embeddings read from disk as AUTOMATIC1111's web UI reads them
(modules/textual_inversion/textual_inversion.py: `EmbeddingDatabase.load_from_file`).

An embedding is a few learned token vectors that a prompt calls by the file's name (its stem, as A1111 names it).
The layouts, told from the tensors a file holds:

- A1111's own `.pt`: `string_to_param` -> `*` [vectors, width] (a `ParameterDict` in older files), beside
  `string_to_token`, `name`, `step`, `sd_checkpoint` and `sd_checkpoint_name`; read through `pickle_reader`, never
  unpickled with code run.
- `.safetensors` (and `.pt`) with `emb_params` [vectors, width].
- SDXL's pair: `clip_l` [vectors, 768] for the first text encoder, `clip_g` [vectors, 1280] for the second.
- diffusers' `learned_embeds.bin` / `.safetensors`: one tensor, named after its token ([width] or [vectors, width]).

Anything else is refused by name, with the tensors the file holds. `read_folder` reads a folder (and its sub-folders)
as A1111's `embeddings/`: a file that cannot be read is skipped with its reason, as A1111 lists `skipped`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import SourceError
from .pickle_reader import flatten, load_pickle
from .weights import map_safetensors

SUFFIXES = (".pt", ".bin", ".safetensors")  # what A1111 reads as embeddings (besides pictures with one inside)
PICTURES = (".png", ".webp", ".jpg", ".jpeg", ".avif")  # A1111 also hides embeddings in pictures: not read here
PAIR = ("clip_l", "clip_g")  # SDXL's embeddings: one tensor per text encoder, in the order the encoders run
SINGLE = ""  # the part of a one-tensor embedding (A1111's `*`, `emb_params`)

log = logging.getLogger("jax-sd")


@dataclass(frozen=True, eq=False)  # arrays inside
class Embedding:
    """One embedding file's vectors: `parts` maps SINGLE, or "clip_l" and "clip_g", to [vectors, width] float arrays."""

    name: str  # the word a prompt calls it by: the file's stem
    parts: dict[str, np.ndarray] = field(repr=False)
    file: Path
    step: int | None = None  # training steps, when the file says (A1111's .pt)
    sd_checkpoint: str | None = None  # the hash and name of the model it was trained on, when the file says
    sd_checkpoint_name: str | None = None

    @property
    def vectors(self) -> int:
        return next(iter(self.parts.values())).shape[0]

    @property
    def widths(self) -> dict[str, int]:
        return {part: array.shape[1] for part, array in self.parts.items()}

    @property
    def shape(self) -> int:
        """A1111's `shape`: a vector's width, summed over the parts (2048 for SDXL's 768 + 1280)."""
        return sum(self.widths.values())

    def describe(self) -> str:
        """ "2 vectors 768 wide", "2 vectors: clip_l 768 and clip_g 1280 wide"."""
        count = f"{self.vectors} vector{'s' if self.vectors != 1 else ''}"
        if set(self.parts) == {SINGLE}:
            return f"{count} {self.widths[SINGLE]} wide"
        return f"{count}: " + " and ".join(f"{part} {width}" for part, width in self.widths.items()) + " wide"


def read_embedding(file: str | Path) -> Embedding:
    """One embedding file; SourceError names the file and why it is refused."""
    file = Path(file)
    suffix = file.suffix.lower()
    info: dict[str, Any] = {}
    if suffix == ".safetensors":
        try:
            tensors = dict(map_safetensors(file))
        except ValueError as err:  # WeightsError: not a safetensors file
            raise SourceError(f"embedding {file}: {err}") from err
    elif suffix in (".pt", ".bin"):
        tree = load_pickle(file)  # refuses a pickle that calls anything, by name
        tensors = flatten(tree)
        info = tree if isinstance(tree, dict) else {}
    else:
        raise SourceError(f"embedding {file}: not an embedding file (A1111's are {', '.join(SUFFIXES)})")
    parts = _parts(tensors, file)
    for part, array in parts.items():
        array = np.asarray(array)
        if array.ndim == 1:  # one vector, as diffusers' learned_embeds.bin holds it
            array = array[None]
        floating = array.dtype.kind == "f" or array.dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2")
        if array.ndim != 2 or not floating:
            raise SourceError(
                f"embedding {file}: {_label(part)} is {array.dtype} of shape {list(array.shape)}, "
                "not float vectors [vectors, width]"
            )
        parts[part] = np.asarray(array, np.float32)
    counts = {array.shape[0] for array in parts.values()}
    if len(counts) != 1 or 0 in counts:
        raise SourceError(
            f"embedding {file}: its parts hold different numbers of vectors ("
            + ", ".join(f"{_label(p)} {a.shape[0]}" for p, a in parts.items())
            + ")"
        )
    return Embedding(
        name=file.stem,
        parts=parts,
        file=file,
        step=_int(info.get("step")),
        sd_checkpoint=_text(info.get("sd_checkpoint")),
        sd_checkpoint_name=_text(info.get("sd_checkpoint_name")),
    )


def _parts(tensors: dict[str, np.ndarray], file: Path) -> dict[str, np.ndarray]:
    """The file's vectors by part, told from its tensors' names as A1111 tells them."""
    a1111 = {key: value for key, value in tensors.items() if key.startswith("string_to_param.")}
    if a1111:
        if len(a1111) != 1:  # A1111 asserts one token per file
            raise SourceError(
                f"embedding {file}: string_to_param holds {len(a1111)} tokens ({', '.join(a1111)}), not 1"
            )
        return {SINGLE: next(iter(a1111.values()))}
    if "emb_params" in tensors:
        return {SINGLE: tensors["emb_params"]}
    if set(PAIR) <= set(tensors):
        return {part: tensors[part] for part in PAIR}
    if len(tensors) == 1 and not set(tensors) & set(PAIR):  # diffusers' learned_embeds: {token: vector}
        return {SINGLE: next(iter(tensors.values()))}
    held = ", ".join(f"{key} {list(np.shape(value))}" for key, value in sorted(tensors.items())[:12]) or "no tensors"
    raise SourceError(
        f"embedding {file}: of no known layout; it holds {held}. A1111's embeddings hold string_to_param (.pt) or "
        "emb_params (.safetensors), SDXL's clip_l and clip_g, diffusers' one tensor named after its token"
    )


def read_folder(folder: str | Path) -> tuple[list[Embedding], dict[str, str]]:
    """Every embedding of a folder and its sub-folders, by name, and the files skipped: name -> why.

    A name taken by an earlier file (in sorted order) is skipped; a picture is skipped (embeddings hidden in PNG and
    WebP files are not read here); a file of no known layout, or one that does not read, is skipped with its reason.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise SourceError(f"embeddings folder {folder} does not exist")
    found: list[Embedding] = []
    skipped: dict[str, str] = {}
    for file in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith(".")):
        suffix = file.suffix.lower()
        if suffix not in SUFFIXES + PICTURES:
            continue
        if suffix in PICTURES:
            skip(skipped, file, "an embedding inside a picture is not read; save it as .safetensors or .pt")
        elif any(e.name == file.stem for e in found):
            skip(skipped, file, f"the name {file.stem!r} is taken by an earlier file")
        else:
            try:
                found.append(read_embedding(file))
            except (SourceError, OSError) as err:
                skip(skipped, file, str(err))
    return found, skipped


def skip(skipped: dict[str, str], file: Path, reason: str) -> None:
    """Logs why a file of an embeddings folder is skipped and lists it by name, as A1111 lists `skipped`."""
    log.warning("embedding %s skipped: %s", file, reason)
    skipped.setdefault(file.stem, reason)


def _label(part: str) -> str:
    return part or "its tensor"


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None
