"""How a pipeline turns a prompt into Qwen3 text tokens: its chat template options, length and hidden layers.

Z-Image (`ZImagePipeline._encode_prompt`) renders the prompt as one user message with the generation prompt and
`enable_thinking=True`, pads it to 512 tokens, and takes `hidden_states[-2]` (the second-to-last layer's output,
not normed), keeping only the real tokens (`prompt_embeds[i][mask[i]]`). FLUX.2 [klein]
(`Flux2KleinPipeline._get_qwen3_prompt_embeds`) renders it with `enable_thinking=False` (an empty think block),
pads it to 512 tokens, and reads layers 9, 18 and 27 side by side, padding included. Either way the text encoder
sees the attention mask, and needs no layer after the last it reads (`QwenPrompt.layers`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ..loading.host_encoder import host_qwen3
from ..loading.qwen_tokenizer import QwenTokenizer
from ..models.qwen3 import Qwen3Config, layers_needed, prompt_embeds
from .base import Encode, PromptFit, TextSide


@dataclass(frozen=True)
class QwenPrompt:
    """A pipeline's Qwen3 prompt encoding."""

    enable_thinking: bool  # the chat template's option: False closes an empty <think> block after the prompt
    hidden_layers: tuple[int, ...]  # transformers' `hidden_states` indices, side by side in this order
    max_sequence_length: int = 512  # the pipelines' default; tokens past it are cut, the rest padded to it
    # Whether the embeddings include the padding's rows. Where they do not (Z-Image keeps the real tokens only),
    # the padding changes nothing that is read (causal, right-padded), so fewer than 512 tokens may be run.
    reads_padding: bool = True
    # Where the padding is not read: the lengths a prompt is padded to, shortest first (`fit`), so that a
    # short prompt runs the text encoder and the denoiser's caption tokens over a quarter of the 512. Each is a
    # static length of its plan (`Plan.text_tokens`): a few, to bound the programs compiled.
    lengths: tuple[int, ...] = ()

    def __post_init__(self):
        if self.lengths and (self.reads_padding or self.lengths[-1] != self.max_sequence_length):
            raise ValueError("lengths: only where the padding is not read, the longest max_sequence_length")

    def tokenize(
        self, tokenizer: QwenTokenizer, prompts: list[str], max_length: int | None = None, what: str = "prompt"
    ) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """ids int32 and mask bool [len(prompts), max_length], and the warnings (what truncation dropped)."""
        length = max_length or self.max_sequence_length
        rows = [tokenizer.chat(p, length, what, enable_thinking=self.enable_thinking) for p in prompts]
        warnings = [w for _, _, found in rows for w in found]
        return np.concatenate([r[0] for r in rows]), np.concatenate([r[1] for r in rows]), warnings

    def fit(self, tokenizer: QwenTokenizer, prompt: str, negative_prompt: str | None) -> PromptFit:
        """The prompt and the negative prompt (None: unguided, not read) in the chat template: the shortest of
        `lengths` that holds both (the longest where none does; 0 without lengths), and what cutting them at
        `max_sequence_length` dropped."""
        texts = {"prompt": prompt, **({} if negative_prompt is None else {"negative prompt": negative_prompt})}
        rows = [self.tokenize(tokenizer, [text], what=what) for what, text in texts.items()]
        need = max(int(mask.sum()) for _, mask, _ in rows)
        length = next((n for n in self.lengths if n >= need), self.max_sequence_length) if self.lengths else 0
        return PromptFit(length, tuple(note for _, _, notes in rows for note in notes))

    def layers(self, config: Qwen3Config) -> int:
        """How many of the encoder's layers this reading needs: build `Qwen3Model(config, rngs, num_layers=...)`."""
        return layers_needed(config, self.hidden_layers)

    def embeds(self, config: Qwen3Config, hidden_states: tuple[jax.Array, ...]) -> jax.Array:
        """[batch, tokens, len(hidden_layers) * hidden_size] from the encoder's hidden states."""
        return prompt_embeds(config, hidden_states, self.hidden_layers)

    def text_side(self, encode: Encode, extra_inputs: Callable) -> TextSide:
        """A family's text side on this reading of a Qwen3 `text_encoder`: no CLIP (the Qwen tokenizer's ids and
        mask travel in the extra inputs, whole prompts, no chunks or emphasis), and Qwen3 on the host's CPU, once per
        prompt, where `load_pipeline(t5="host")` puts it."""
        return TextSide(
            encoders=(),
            tokenizers=(),
            encode=encode,
            extra_inputs=extra_inputs,
            host_encoder="text_encoder",
            on_host=functools.partial(host_qwen3, hidden_layers=self.hidden_layers),
            chunked_prompts=False,
            clip_skip=False,
            fit_prompts=self.folder_fit,
        )

    def folder_fit(self, folder: Any) -> Callable[[str, str | None], PromptFit]:
        """`fit` with the folder's tokenizer: `TextSide.fit_prompts`."""
        return functools.partial(self.fit, folder_tokenizer(folder))


def folder_tokenizer(folder: Any) -> QwenTokenizer:
    """The folder's Qwen tokenizer (sub-folder `tokenizer`), read once for the prompt's ids and its fit."""
    return folder.read_once("qwen tokenizer", lambda: QwenTokenizer(folder.component("tokenizer")))


Z_IMAGE = QwenPrompt(enable_thinking=True, hidden_layers=(-2,), reads_padding=False, lengths=(128, 256, 512))
FLUX2_KLEIN = QwenPrompt(enable_thinking=False, hidden_layers=(9, 18, 27))
