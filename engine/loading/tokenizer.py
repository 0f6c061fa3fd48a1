"""A model folder's CLIP tokenizer (transformers' `CLIPTokenizer`, which runs the `tokenizers` library)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np


class Tokenizer:
    """transformers' CLIPTokenizer, padded to its 77 tokens; says when a prompt was cut."""

    def __init__(self, folder: Path):
        from transformers import CLIPTokenizer

        self.inner = CLIPTokenizer.from_pretrained(str(folder))
        self.max_length = self.inner.model_max_length
        # A call sets padding and truncation on the shared Rust tokenizer before it encodes: two threads
        # interleaving would get each other's settings (ids of the wrong length). One call at a time.
        self.lock = threading.Lock()

    def __call__(self, text: str, what: str = "prompt") -> tuple[np.ndarray, list[str]]:
        with self.lock:
            full = self.inner(text, truncation=False).input_ids
            ids = self.inner(text, padding="max_length", max_length=self.max_length, truncation=True).input_ids
        warnings = []
        if len(full) > self.max_length:
            dropped = self.inner.decode(full[self.max_length - 1 : -1])
            warnings.append(f"{what} truncated to {self.max_length} tokens; dropped: {dropped!r}")
        return np.asarray(ids, np.int32)[None], warnings
