"""Long prompts and emphasis, read as AUTOMATIC1111's web UI reads them.

Mirrors A1111's `parse_prompt_attention` (modules/prompt_parser.py) and its CLIP wrapper
`FrozenCLIPEmbedderWithCustomWordsBase` (modules/sd_hijack_clip.py, "Original" emphasis in sd_emphasis.py):

- `(words)` weighs words by 1.1, `((words))` by 1.21, `[words]` by 1 / 1.1, `(words:1.4)` by 1.4; `\\(`,
  `\\)`, `\\[`, `\\]` and `\\\\` are the characters themselves; an unclosed bracket weighs everything after it;
  a closing bracket without its opening one is text. `BREAK` ends the current chunk.
- The tokens are cut into chunks of 75, each wrapped in start and end tokens and padded to the encoder's
  77; a chunk that fills up within 20 tokens of a comma moves the words after that comma to the next chunk.
- The text encoder reads each chunk on its own; each token's output vector is multiplied by its weight and
  the chunk rescaled so that its mean stays what it was; the chunks are concatenated (77 tokens each) into
  one context for the UNet. SDXL's pooled embedding is the first chunk's.
- A textual inversion embedding's name (its tokens, as A1111's `find_embedding_at_position` finds them) becomes
  its placeholder ids, one per vector, weighed as the words around it; the encoder looks them up in rows appended
  to its token table (engine/loading/textual_inversion.py). An embedding is never split between two chunks.

Families whose T5 encoder reads the long prompt (SD3, FLUX.1; `TextSide.chunked_prompts` False) skip all this, as
diffusers does: their CLIP encoders read the first 77 tokens as text (`tokenize_plain`).

Not here: A1111's prompt editing (`[cat:dog:0.5]`, read as text) and `AND` (composable diffusion).
A plain prompt of up to 75 tokens gives one chunk of weight 1: exactly the ids and conditioning the
tokenizer and the family's encoder give without this module. The engine calls this module through
`pipeline.encode_prompts` (device side) and `Engine` (tokenizing on the host).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROUND = 1.1  # (words): A1111's factor per pair of round brackets
SQUARE = 1 / 1.1  # [words]
COMMA_BACKTRACK = 20  # A1111's `comma_padding_backtrack` default: tokens a comma may be from the chunk's end
BREAK = ("BREAK", -1.0)  # the marker `parse_prompt_attention` puts where a chunk must end, as A1111 does

# A tokenizer's textual inversion embeddings (engine/loading/textual_inversion.py): the token ids of an embedding's
# name -> the placeholder ids that look its vectors up in rows appended to the text encoder's token table.
Placeholders = Mapping[tuple[int, ...], Sequence[int]]

# One token of the attention syntax per match: an escaped character (a lone backslash escapes nothing and
# vanishes), an opening bracket, ":1.4)" closing a round bracket with its weight, a closing bracket, a run
# of plain text or a lone colon.
_SYNTAX = re.compile(
    r"""
    \\(?P<escaped>[()\[\]\\])?
  | (?P<open>[(\[])
  | :\s*(?P<weight>[+-]?[.\d]+)\s*\)
  | (?P<close>[)\]])
  | (?P<text>[^\\()\[\]:]+|:)
    """,
    re.VERBOSE,
)
_BREAK = re.compile(r"\s*\bBREAK\b\s*", re.S)


def parse_prompt_attention(text: str) -> list[tuple[str, float]]:
    """Splits a prompt into runs of text with their weights, merging neighbours of equal weight.

    `BREAK` becomes the `BREAK` pair ("BREAK", -1.0), which brackets around it multiply like any run (so
    "(BREAK)" is the word "break" again, as in A1111).
    """
    runs: list[list] = []  # [text, weight], mutable while brackets close
    round_open: list[int] = []  # where each open bracket's runs start
    square_open: list[int] = []

    def weigh(start: int, factor: float) -> None:
        for run in runs[start:]:
            run[1] *= factor

    for m in _SYNTAX.finditer(text):
        token = m.group(0)
        weight = _float(m.group("weight"))
        if token.startswith("\\"):
            runs.append([m.group("escaped") or "", 1.0])
        elif m.group("open"):
            (round_open if token == "(" else square_open).append(len(runs))
        elif weight is not None and round_open:
            weigh(round_open.pop(), weight)
        elif token == ")" and round_open:
            weigh(round_open.pop(), ROUND)
        elif token == "]" and square_open:
            weigh(square_open.pop(), SQUARE)
        else:  # text, or a bracket that closes nothing
            for k, part in enumerate(_BREAK.split(token)):
                if k:
                    runs.append(list(BREAK))
                runs.append([part, 1.0])
    for start in round_open:  # unclosed brackets weigh everything after them
        weigh(start, ROUND)
    for start in square_open:
        weigh(start, SQUARE)

    merged: list[list] = []
    for run in runs or [["", 1.0]]:
        if merged and merged[-1][1] == run[1]:
            merged[-1][0] += run[0]
        else:
            merged.append(run)
    return [(text, weight) for text, weight in merged]


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:  # "(a:1.2.3)": not a weight; the characters stay text
        return None


@dataclass(frozen=True, eq=False)  # arrays: compare `ids` and `weights` yourself
class TokenizedPrompt:
    """A prompt's token ids and weights in chunks of the encoder's length (77): host arrays.

    ids int32 and weights float32 [chunks, 77], or [chunks, encoders, 77] for several tokenizers (SDXL), so
    that `ids[k]` is what the plain tokenizer gives for a prompt of one chunk.
    """

    ids: np.ndarray
    weights: np.ndarray
    token_count: int  # the prompt's tokens as A1111's counter shows them (a full chunk counts 75)
    empty: np.ndarray = field(repr=False)  # [77] or [encoders, 77]: the ids of an empty chunk

    @property
    def chunks(self) -> int:
        return self.ids.shape[0]

    def padded(self, chunks: int) -> TokenizedPrompt:
        """With empty chunks (the encoding of "") added up to `chunks`, as A1111 pads cond and uncond."""
        extra = chunks - self.chunks
        if extra < 0:
            raise ValueError(f"a prompt of {self.chunks} chunks cannot be padded to {chunks}")
        if extra == 0:
            return self
        ids = np.concatenate([self.ids, np.broadcast_to(self.empty, (extra, *self.empty.shape))])
        weights = np.concatenate([self.weights, np.ones((extra, *self.empty.shape), np.float32)])
        return TokenizedPrompt(ids, weights, self.token_count, self.empty)

    def note(self, what: str = "prompt") -> str | None:
        """A line for the details when the prompt took more than one chunk."""
        if self.chunks == 1:
            return None
        return f"{what}: {self.token_count} tokens, encoded in {self.chunks} chunks of {self.ids.shape[-1] - 2}"


def tokenize_chunks(
    tokenizer: Any,
    text: str,
    comma_backtrack: int = COMMA_BACKTRACK,
    emphasis: bool = True,
    embeddings: Placeholders | None = None,
) -> TokenizedPrompt:
    """One tokenizer's chunks: ids and weights [chunks, 77].

    `tokenizer` is transformers' `CLIPTokenizer` or `loading.Tokenizer` around one. As A1111: each run of
    `parse_prompt_attention` is tokenized on its own; chunks are padded with the end token, and every
    token after a chunk's first end token is the tokenizer's pad token ("!" for SD 2.x and SDXL's second
    tokenizer, the end token itself for SD 1.x). `emphasis=False` reads brackets and BREAK as text.
    `embeddings`: an embedding's name, met as its tokens in a run, becomes its placeholder ids with the run's
    weight; one that does not fit in what is left of a chunk starts the next (A1111's `tokenize_line`).
    """
    tok = getattr(tokenizer, "inner", tokenizer)
    length = tok.model_max_length  # 77
    chunk_length = length - 2
    start, end = tok.bos_token_id, tok.eos_token_id
    pad = end if tok.pad_token_id is None else tok.pad_token_id
    comma = tok.convert_tokens_to_ids(",</w>")  # one lookup, not the 49,408-entry vocabulary copied per prompt
    comma = None if comma == tok.unk_token_id else comma
    runs = parse_prompt_attention(text) if emphasis else [(text, 1.0)]
    with getattr(tokenizer, "lock", contextlib.nullcontext()):  # `loading.Tokenizer`: one call at a time
        tokenized = tok([t for t, _ in runs], add_special_tokens=False, truncation=False, verbose=False).input_ids

    by_first = _by_first_token(embeddings or {})
    chunks: list[tuple[list[int], list[float]]] = []
    tokens: list[int] = []
    weights: list[float] = []
    last_comma = -1
    count = 0

    def close(last: bool = False) -> None:
        nonlocal tokens, weights, last_comma, count
        count += len(tokens) if last else chunk_length
        fill = chunk_length - len(tokens)
        chunks.append(([start, *tokens, *[end] * fill, end], [1.0, *weights, *[1.0] * fill, 1.0]))
        tokens, weights, last_comma = [], [], -1

    for ids, (run, weight) in zip(tokenized, runs, strict=True):
        if (run, weight) == BREAK:
            close()
            continue
        position = 0
        while position < len(ids):
            token = ids[position]
            if token == comma:
                last_comma = len(tokens)
            elif len(tokens) == chunk_length and last_comma != -1 and chunk_length - last_comma <= comma_backtrack:
                # The chunk is full and a comma is near its end: the words after the comma start the next one.
                moved = tokens[last_comma + 1 :], weights[last_comma + 1 :]
                tokens, weights = tokens[: last_comma + 1], weights[: last_comma + 1]
                close()
                tokens, weights = list(moved[0]), list(moved[1])
            if len(tokens) == chunk_length:
                close()
            name, placeholders = _embedding_at(by_first, ids, position)
            if len(tokens) + len(placeholders) > chunk_length:  # an embedding is never split between chunks
                close()
            tokens += placeholders or [token]
            weights += [weight] * max(1, len(placeholders))
            position += max(1, len(name))
    if tokens or not chunks:
        close(last=True)

    ids = np.asarray([c[0] for c in chunks], np.int32)  # [chunks, 77]
    after_end = np.cumsum(ids == end, axis=1) - (ids == end) > 0  # past each chunk's first end token
    ids = np.where(after_end, pad, ids).astype(np.int32)
    empty = np.full(length, pad, np.int32)
    empty[:2] = start, end
    return TokenizedPrompt(ids, np.asarray([c[1] for c in chunks], np.float32), count, empty)


def _by_first_token(embeddings: Placeholders) -> dict[int, list[tuple[tuple[int, ...], list[int]]]]:
    """The embeddings by their name's first token, longest name first (A1111's `EmbeddingDatabase.ids_lookup`)."""
    out: dict[int, list[tuple[tuple[int, ...], list[int]]]] = {}
    for name, placeholders in sorted(embeddings.items(), key=lambda item: -len(item[0])):
        out.setdefault(name[0], []).append((name, list(placeholders)))
    return out


def _embedding_at(by_first: dict, ids: Sequence[int], position: int) -> tuple[tuple[int, ...], list[int]]:
    """The name's tokens and the placeholder ids of the embedding whose name starts at `position`, or two empties."""
    for name, placeholders in by_first.get(ids[position], ()):
        if tuple(ids[position : position + len(name)]) == name:
            return name, placeholders
    return (), []


def tokenize_prompt(
    tokenizers: Sequence[Any], text: str, embeddings: Sequence[Placeholders] = (), **options
) -> TokenizedPrompt:
    """Every tokenizer's chunks: [chunks, 77] for one tokenizer, [chunks, encoders, 77] for several (SDXL).

    Each tokenizer is read on its own; the one that needs fewer chunks is padded with empty ones. `embeddings`: each
    tokenizer's placeholders (`loading.textual_inversion.Embeddings.placeholders`), or () for none.
    """
    each = [
        tokenize_chunks(tokenizer, text, embeddings=embeddings[k] if embeddings else None, **options)
        for k, tokenizer in enumerate(tokenizers)
    ]
    if len(each) == 1:
        return each[0]
    each = align(*each)
    return TokenizedPrompt(
        np.stack([p.ids for p in each], axis=1),
        np.stack([p.weights for p in each], axis=1),
        max(p.token_count for p in each),
        np.stack([p.empty for p in each]),
    )


def tokenize_plain(tokenizers: Sequence[Any], text: str) -> TokenizedPrompt:
    """One chunk of each CLIP tokenizer's first 77 tokens, no emphasis (brackets are text): what diffusers' SD3 and
    FLUX.1 pipelines give their CLIP encoders, whose T5 encoder reads the long prompt. [1, 77] or [1, encoders, 77].
    No tokenizers (a text side whose prompt travels in its extra inputs only): one placeholder id, [1, 1] zeros (an
    array of no entries would not split into each device's lanes, `pipeline.take_lanes`)."""
    if not tokenizers:
        none = np.zeros((1, 1), np.int32)
        return TokenizedPrompt(none, np.ones(none.shape, np.float32), 0, none[0])
    rows = [tokenizer(text)[0][0] for tokenizer in tokenizers]  # `loading.Tokenizer`: padded, truncated at 77
    ids = np.stack(rows)[None] if len(rows) > 1 else rows[0][None]
    empty = np.stack([tokenizer("")[0][0] for tokenizer in tokenizers])
    empty = empty if len(rows) > 1 else empty[0]
    count = max(min(len(getattr(t, "inner", t)(text).input_ids) - 2, 75) for t in tokenizers)
    return TokenizedPrompt(ids.astype(np.int32), np.ones(ids.shape, np.float32), count, empty)


def align(*prompts: TokenizedPrompt, chunks: int = 0) -> list[TokenizedPrompt]:
    """The prompts padded to one chunk count (the longest, or `chunks` if more): a prompt and its negative
    prompt, or the prompts of one batch, so that their contexts have the same length."""
    target = max([chunks, *(p.chunks for p in prompts)])
    return [p.padded(target) for p in prompts]


def stack(prompts: Sequence[TokenizedPrompt], chunks: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A batch: ids int32 and weights float32 [batch, chunks, ...], every prompt padded to one chunk count."""
    prompts = align(*prompts, chunks=chunks)
    return np.stack([p.ids for p in prompts]), np.stack([p.weights for p in prompts])


def emphasize(z: jax.Array, weights: jax.Array) -> jax.Array:
    """A1111's "Original" emphasis on each chunk: z [..., 77, d] times weights [..., 77], rescaled so that
    the chunk's mean over tokens and features is what it was.

    A1111 takes the mean over its whole batch; here it is per picture (and chunk), which is the same for
    the one prompt A1111 encodes at a time and keeps a picture independent of its batch. A chunk whose
    weights are all 1 is returned as it came, bit for bit.
    """
    w = weights.astype(jnp.float32)[..., None]
    z32 = z.astype(jnp.float32)
    before = jnp.mean(z32, axis=(-2, -1), keepdims=True)
    weighted = z32 * w
    after = jnp.mean(weighted, axis=(-2, -1), keepdims=True)
    scaled = weighted * (before / jnp.where(after == 0, 1.0, after))
    plain = jnp.all(weights == 1, axis=-1)[..., None, None]
    return jnp.where(plain, z, scaled.astype(z.dtype))


def apply_emphasis(z: jax.Array, weights: jax.Array) -> jax.Array:
    """Per-chunk encoder output z [batch, chunks, 77, d], weights [batch, chunks, 77] -> [batch, chunks * 77, d]."""
    b, c, n, d = z.shape
    return emphasize(z, weights).reshape(b, c * n, d)  # chunk k's tokens at k * 77 ...


def encode_chunks(
    text: Any, models: Any, ids: jax.Array, weights: jax.Array, extra: dict, plan: Any, negative: bool
) -> Any:
    """The family's `encode` (its `engine.families.TextSide`) over chunks, with emphasis: the UNet's conditioning.

    ids int32 and weights f32 [batch, chunks, 77] (SDXL: [batch, chunks, 2, 77]), from `stack`; extra and
    negative as for `TextSide.encode` (batch first). Every chunk goes through the family's encoder as one more row
    of the batch; each encoder's part of the context gets its own emphasis (A1111 weighs SDXL's two
    encoders apart); the context is [batch, chunks * 77, width], the pooled embedding and time ids are the
    first chunk's. Traceable: call it inside the jitted step; the chunk count is a shape, so static.
    """
    b, c = ids.shape[:2]
    rows = lambda a: a.reshape(b * c, *a.shape[2:])  # noqa: E731 [batch * chunks, ...], chunk-minor
    per_chunk = jax.tree.map(lambda a: jnp.repeat(a, c, axis=0), extra)
    cond = text.encode(models, rows(ids), per_chunk, plan, negative)
    context = cond.context.reshape(b, c, *cond.context.shape[1:])  # [batch, chunks, 77, width]
    widths = [getattr(models, name).config.hidden_size for name in text.encoders]
    if sum(widths) != context.shape[-1]:
        raise ValueError(f"a context {context.shape[-1]} wide is not the encoders' {' + '.join(map(str, widths))}")
    if weights.ndim == 3:  # one tokenizer: [batch, chunks, 77] -> [batch, chunks, 1, 77]
        weights = weights[:, :, None]
    parts = jnp.split(context, np.cumsum(widths)[:-1].tolist(), axis=-1)
    context = jnp.concatenate([emphasize(part, weights[:, :, k]) for k, part in enumerate(parts)], axis=-1)
    context = context.reshape(b, -1, context.shape[-1])  # [batch, chunks * 77, width]
    first = lambda a: None if a is None else a.reshape(b, c, *a.shape[1:])[:, 0]  # noqa: E731
    return dataclasses.replace(
        cond, context=context, text_embeds=first(cond.text_embeds), time_ids=first(cond.time_ids)
    )
