"""A model folder's T5 tokenizer (SD3's tokenizer_3, FLUX.1's tokenizer_2): transformers' `T5TokenizerFast`.

It runs the `tokenizers` library on the folder's tokenizer.json (no sentencepiece). Ids are what diffusers'
SD3 and FLUX pipelines give the T5 encoder: the prompt's tokens and `</s>`, cut to `max_length` (SD3 256,
FLUX.1-dev 512, FLUX.1-schnell 256) with `</s>` kept last, then `<pad>` to `max_length`.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np


class T5Tokenizer:
    """transformers' T5TokenizerFast, padded to `max_length` tokens; says when a prompt was cut."""

    def __init__(self, folder: Path, max_length: int):
        from transformers import T5TokenizerFast

        self.inner = T5TokenizerFast.from_pretrained(str(folder))
        self.max_length = max_length
        # As CLIP's (tokenizer.py): a call sets padding and truncation on the shared Rust tokenizer. One at a time.
        self.lock = threading.Lock()

    def __call__(self, text: str, what: str = "prompt") -> tuple[np.ndarray, list[str]]:
        """int32 ids [1, max_length], and the warnings (what truncation dropped, as diffusers logs it)."""
        with self.lock:
            full = self.inner(text, truncation=False).input_ids
            ids = self.inner(text, padding="max_length", max_length=self.max_length, truncation=True).input_ids
        warnings = []
        if len(full) > self.max_length:
            dropped = self.inner.decode(full[self.max_length - 1 : -1])  # the end token stays, last
            warnings.append(f"{what} truncated to {self.max_length} T5 tokens; dropped: {dropped!r}")
        return np.asarray(ids, np.int32)[None], warnings
