"""Writes a small CLIP BPE tokenizer folder (vocab.json, merges.txt, configs) for shipped models.

CLIP's tokenizer works with any vocabulary: every byte is a token (with and without the
end-of-word mark `</w>`), so any text tokenizes; listed words are merged into one token each.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL = ("<|startoftext|>", "<|endoftext|>")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible map from bytes to printable characters."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def _bpe(parts: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """CLIP's byte-pair merge loop: join the best-ranked adjacent pair everywhere until none is left."""
    while len(parts) > 1:
        best = min(zip(parts, parts[1:], strict=False), key=lambda pair: ranks.get(pair, len(ranks)))
        if best not in ranks:
            return parts
        joined, i = [], 0
        while i < len(parts):
            if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                joined.append(parts[i] + parts[i + 1])
                i += 2
            else:
                joined.append(parts[i])
                i += 1
        parts = joined
    return parts


def write_tokenizer(folder: str | Path, words: list[str], max_length: int = 77) -> int:
    """Writes the tokenizer files; returns the vocabulary size."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    chars = list(bytes_to_unicode().values())
    vocab_list = chars + [c + "</w>" for c in chars]
    merges: list[tuple[str, str]] = []
    for word in sorted({w.lower() for w in words}):
        # BPE applies the merges by rank, so first see what the merges so far make of this word
        # (an earlier "and" merges "a n" inside "orange"), then join what is left, left to right;
        # the new merges rank after every earlier one, so they cannot break an earlier word.
        parts = _bpe(list(word[:-1]) + [word[-1] + "</w>"], {pair: i for i, pair in enumerate(merges)})
        while len(parts) > 1:
            pair = (parts[0], parts[1])
            merged = pair[0] + pair[1]
            if pair not in merges:
                merges.append(pair)
            if merged not in vocab_list:
                vocab_list.append(merged)
            parts = [merged, *parts[2:]]
    vocab_list += list(SPECIAL)
    vocab = {token: i for i, token in enumerate(vocab_list)}
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    config = {
        "tokenizer_class": "CLIPTokenizer",
        "model_max_length": max_length,
        "bos_token": SPECIAL[0],
        "eos_token": SPECIAL[1],
        "unk_token": SPECIAL[1],
        "pad_token": SPECIAL[1],
        "do_lower_case": True,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    specials = {"bos_token": SPECIAL[0], "eos_token": SPECIAL[1], "unk_token": SPECIAL[1], "pad_token": SPECIAL[1]}
    (folder / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))
    return len(vocab)
