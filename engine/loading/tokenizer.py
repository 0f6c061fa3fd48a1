"""A model folder's tokenizers: CLIP's (transformers' `CLIPTokenizer`) and, through `t5_tokenizer.py`, T5's; both
run the `tokenizers` library."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np


class Tokenizer:
    """transformers' CLIPTokenizer, padded to its 77 tokens; says when a prompt was cut."""

    unit = "tokens"  # what the truncation warning counts

    def __init__(self, folder: Path, max_length: int | None = None):
        self.inner = self.load(folder)
        self.max_length = max_length or self.inner.model_max_length
        # A call sets padding and truncation on the shared Rust tokenizer before it encodes: two threads
        # interleaving would get each other's settings (ids of the wrong length). One call at a time.
        self.lock = threading.Lock()

    @staticmethod
    def load(folder: Path):
        from transformers import CLIPTokenizer

        return CLIPTokenizer.from_pretrained(str(folder))

    def __call__(self, text: str, what: str = "prompt") -> tuple[np.ndarray, list[str]]:
        """int32 ids [1, max_length], and the warnings (what truncation dropped; the end token stays, last)."""
        with self.lock:
            full = self.inner(text, truncation=False).input_ids
            ids = self.inner(text, padding="max_length", max_length=self.max_length, truncation=True).input_ids
        warnings = []
        if len(full) > self.max_length:
            dropped = self.inner.decode(full[self.max_length - 1 : -1])
            warnings.append(f"{what} truncated to {self.max_length} {self.unit}; dropped: {dropped!r}")
        return np.asarray(ids, np.int32)[None], warnings
