"""Embeddings (textual inversion) attached to a model: their vectors as rows appended to each text encoder's token
embedding table, once at load, and the placeholder ids a prompt's tokens turn into.

As diffusers' `load_textual_inversion` adds tokens `name`, `name_1`, ... and resizes the embedding matrix, each
embedding gets one new row per vector in every text encoder's table (an SDXL pair: clip_l's rows in the first,
clip_g's in the second); a prompt calls it by its name, which the tokenizer turns into that name's usual tokens
and `sampling.prompts.tokenize_chunks` then into the placeholder ids of those rows (`Embeddings.placeholders`),
matching the name's token ids as A1111's `EmbeddingDatabase.find_embedding_at_position` does. The rows are data
and the table's size is fixed at load, so a prompt with or without an embedding runs the same compiled programs.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from ..errors import SourceError
from .embeddings import PAIR, SINGLE, Embedding, read_embedding, read_folder, skip
from .weights import aligned_copy

MAX_VECTORS = 75  # a chunk's tokens: an embedding never spans two chunks (A1111 moves it whole to the next)


@dataclass(frozen=True)
class LoadedEmbedding:
    """What the page and A1111's /sdapi/v1/embeddings show of a loaded embedding."""

    name: str  # the word a prompt calls it by
    vectors: int  # tokens it takes in a chunk
    encoders: tuple[str, ...]  # the text encoders it feeds ("text_encoder", "text_encoder_2")
    shape: int  # A1111's `shape`: a vector's width, summed over the encoders
    file: str
    step: int | None = None
    sd_checkpoint: str | None = None
    sd_checkpoint_name: str | None = None


@dataclass(frozen=True)
class Embeddings:
    """A model's embeddings: those loaded, those skipped (name -> why), and per tokenizer the placeholder ids."""

    loaded: tuple[LoadedEmbedding, ...] = ()
    skipped: dict[str, str] = field(default_factory=dict)
    # Per tokenizer, in the order the encoders run: the token ids of an embedding's name -> its placeholder ids.
    placeholders: tuple[dict[tuple[int, ...], tuple[int, ...]], ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.loaded)

    def a1111(self) -> dict[str, dict[str, dict[str, Any]]]:
        """A1111's /sdapi/v1/embeddings: {"loaded": {name: {step, sd_checkpoint, sd_checkpoint_name, shape, vectors}},
        "skipped": {name: ...}}; a skipped file's entry also carries why (`reason`)."""

        def entry(e: LoadedEmbedding) -> dict[str, Any]:
            return dict(
                step=e.step,
                sd_checkpoint=e.sd_checkpoint,
                sd_checkpoint_name=e.sd_checkpoint_name,
                shape=e.shape,
                vectors=e.vectors,
            )

        skipped = {
            name: dict(step=None, sd_checkpoint=None, sd_checkpoint_name=None, shape=0, vectors=0, reason=reason)
            for name, reason in self.skipped.items()
        }
        return {"loaded": {e.name: entry(e) for e in self.loaded}, "skipped": skipped}


NO_EMBEDDINGS = Embeddings()


def encoder_parts(family: Any) -> dict[str, str]:
    """The text encoders of a family (its `engine.families.Family` record) that take embeddings -> the part of a file
    each reads: SINGLE with one encoder, clip_l and clip_g with SDXL's two. Empty for families whose encoders read no
    embeddings (those with a T5 encoder, whose CLIP encoders read a prompt as plain text)."""
    text = family.text  # its `TextSide`
    if not text.chunked_prompts:
        return {}
    encoders = text.encoders
    if len(encoders) == 1:
        return {encoders[0]: SINGLE}
    if len(encoders) == len(PAIR):
        return dict(zip(encoders, PAIR, strict=True))
    return {}


def fit(embedding: Embedding, parts: dict[str, str], widths: dict[str, int], label: str) -> dict[str, np.ndarray]:
    """The embedding's vectors per text encoder; SourceError, naming the embedding, when it does not fit.

    `parts`: `encoder_parts` of the model's family; `widths`: each of those encoders' token vector width;
    `label`: the model, for people."""
    where = f"embedding {embedding.name!r} ({embedding.file.name}: {embedding.describe()})"
    wanted = " and ".join(f"{part or 'one tensor'} {widths[encoder]} wide" for encoder, part in parts.items())
    if set(embedding.parts) != set(parts.values()):
        kind = "one tensor" if SINGLE in embedding.parts else "an SDXL pair (clip_l, clip_g)"
        raise SourceError(f"{where} is {kind}, but {label} takes {wanted}: an embedding for another model family")
    for encoder, part in parts.items():
        if embedding.widths[part] != widths[encoder]:
            raise SourceError(
                f"{where} does not fit {label}, whose text encoders take {wanted}: an embedding for another model family"
            )
    if embedding.vectors > MAX_VECTORS:
        raise SourceError(f"{where}: more vectors than a chunk's {MAX_VECTORS} tokens")
    return {encoder: embedding.parts[part] for encoder, part in parts.items()}


def _table(models: Any, encoder: str) -> nnx.Param:
    return getattr(models, encoder).text_model.embeddings.token_embedding.embedding


def attach_embeddings(model, source: str | os.PathLike, family: Any):
    """`model` (a `families.loader.LoadedModel`) with the embeddings of `source` (a folder, as A1111's `embeddings/`,
    or one file) appended to its text encoders' token tables, and its `embeddings` saying which. `family`: the
    model's `engine.families.Family` record.

    One file that does not fit is refused (SourceError, by name); in a folder it is skipped with its reason, logged
    and listed in `Embeddings.skipped`, as A1111 lists it."""
    source = Path(source)
    label = model.label or model.family
    parts = encoder_parts(family)
    if not parts:
        raise SourceError(f"{label} models take no embeddings: start without embeddings")
    models = nnx.merge(model.graphdef, model.params)  # host arrays stay host arrays
    tables = {encoder: _table(models, encoder) for encoder in parts}
    widths = {encoder: table[...].shape[1] for encoder, table in tables.items()}
    if source.is_dir():
        found, skipped = read_folder(source)
    else:
        found, skipped = [read_embedding(source)], {}
    fitted: list[tuple[Embedding, dict[str, np.ndarray], list[tuple[int, ...]]]] = []
    tokens_taken: dict[tuple[int, ...], str] = {}
    for embedding in found:
        try:
            vectors = fit(embedding, parts, widths, label)
            names = [_token_ids(tokenizer, embedding.name) for tokenizer in model.tokenizers]
            if not all(names):
                raise SourceError(f"embedding {embedding.name!r}: its name gives no tokens to call it by")
            if names[0] in tokens_taken:
                raise SourceError(
                    f"embedding {embedding.name!r}: called by the same tokens as {tokens_taken[names[0]]!r}"
                )
        except SourceError as err:
            if not source.is_dir():
                raise
            skip(skipped, embedding.file, str(err))
            continue
        tokens_taken[names[0]] = embedding.name
        fitted.append((embedding, vectors, names))

    placeholders: list[dict[tuple[int, ...], tuple[int, ...]]] = [{} for _ in model.tokenizers]
    rows = {encoder: [] for encoder in parts}
    offset = 0
    for embedding, vectors, names in fitted:
        for k, (encoder, name) in enumerate(zip(parts, names, strict=True)):
            first = tables[encoder][...].shape[0] + offset  # this embedding's rows follow the table's own
            placeholders[k][name] = tuple(range(first, first + embedding.vectors))
            rows[encoder].append(vectors[encoder])
        offset += embedding.vectors
    for encoder, table in tables.items():
        if rows[encoder]:
            own = np.asarray(table[...])
            table.set_value(aligned_copy(np.concatenate([own, *rows[encoder]]), own.dtype))  # [vocab + vectors, width]
    graphdef, params = nnx.split(models)
    loaded = tuple(
        LoadedEmbedding(
            name=e.name,
            vectors=e.vectors,
            encoders=tuple(parts),
            shape=e.shape,
            file=str(e.file),
            step=e.step,
            sd_checkpoint=e.sd_checkpoint,
            sd_checkpoint_name=e.sd_checkpoint_name,
        )
        for e, _, _ in fitted
    )
    embeddings = Embeddings(loaded, skipped, tuple(placeholders))
    return dataclasses.replace(model, graphdef=graphdef, params=params, embeddings=embeddings)


def _token_ids(tokenizer: Any, name: str) -> tuple[int, ...]:
    """The tokens a prompt gives for the name, as A1111 tokenizes an embedding's name to find it in prompts."""
    inner = getattr(tokenizer, "inner", tokenizer)
    lock = getattr(tokenizer, "lock", None)
    if lock is None:
        return tuple(inner(name, add_special_tokens=False, truncation=False, verbose=False).input_ids)
    with lock:
        return tuple(inner(name, add_special_tokens=False, truncation=False, verbose=False).input_ids)
