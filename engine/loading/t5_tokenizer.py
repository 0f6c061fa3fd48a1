"""A model folder's T5 tokenizer (SD3's tokenizer_3, FLUX.1's tokenizer_2): transformers' `T5TokenizerFast`.

It runs the `tokenizers` library on the folder's tokenizer.json (no sentencepiece). Ids are what diffusers'
SD3 and FLUX pipelines give the T5 encoder: the prompt's tokens and `</s>`, cut to `max_length` (SD3 256,
FLUX.1-dev 512, FLUX.1-schnell 256) with `</s>` kept last, then `<pad>` to `max_length`.
"""

from __future__ import annotations

from pathlib import Path

from .tokenizer import Tokenizer


class T5Tokenizer(Tokenizer):
    """transformers' T5TokenizerFast, padded to `max_length` tokens; says when a prompt was cut."""

    unit = "T5 tokens"

    def __init__(self, folder: Path, max_length: int):
        super().__init__(folder, max_length)

    @staticmethod
    def load(folder: Path):
        from transformers import T5TokenizerFast

        return T5TokenizerFast.from_pretrained(str(folder))
