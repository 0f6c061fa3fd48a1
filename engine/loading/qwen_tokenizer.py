"""A model folder's Qwen tokenizer (Z-Image's and FLUX.2 [klein]'s `tokenizer/`): tokenizer.json through the
`tokenizers` library, and the chat template rendered as transformers' `apply_chat_template` renders it.

The folder is what transformers saves for `Qwen2Tokenizer`: tokenizer.json (byte-level BPE, its added tokens
`<|im_start|>`, `<|im_end|>`, `<think>`, ...) and tokenizer_config.json (the pad and end tokens, and the chat
template, unless chat_template.jinja beside it holds the template: that file wins, as in transformers).

Templates run in jinja2's immutable sandbox with transformers' settings: `trim_blocks` and `lstrip_blocks`, the
loop controls extension (`break`, `continue`), a `tojson` that keeps non-ASCII text, `raise_exception`,
`strftime_now`, and the special tokens' strings (`eos_token`, ...) beside the caller's options (`enable_thinking`).
Ids are the rendered text's tokens, cut to `max_length` from the right and padded on the right with the pad
token, as `tokenizer(text, padding="max_length", truncation=True, max_length=...)` gives them; the mask marks the
real tokens.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value: Any) -> str | None:
    """A tokenizer_config.json token: a string, or an AddedToken's dict with its `content`."""
    return value.get("content") if isinstance(value, dict) else value


def chat_template_source(folder: Path, config: dict) -> str | None:
    """The folder's default chat template: chat_template.jinja, else tokenizer_config.json's `chat_template` (a
    string, or a list of named templates, of which "default")."""
    file = folder / "chat_template.jinja"
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        return named.get("default")
    return template


def compile_template(source: str):
    """A chat template compiled as transformers compiles it (`_compile_jinja_template`'s environment)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja2's own tojson escapes HTML characters; templates expect plain JSON text
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class QwenTokenizer:
    """A folder's tokenizer.json and chat template: `chat(prompt, max_length, ...)` -> ids, mask, warnings."""

    unit = "Qwen tokens"  # what the truncation warning counts

    def __init__(self, folder: str | Path):
        from tokenizers import Tokenizer

        folder = Path(folder)
        where = str(folder)
        try:
            self.inner = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as err:  # the library's own error type is not exported
            raise ConfigError(f"{where}: cannot read tokenizer.json ({err})") from err
        config_file = folder / "tokenizer_config.json"
        try:
            config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"cannot read {config_file}: {err}") from err
        # What templates see besides the messages (transformers' `special_tokens_map`): the tokens that are set.
        self.special_tokens = {
            name: text for name in SPECIAL_NAMES if (text := _token_text(config.get(name))) is not None
        }
        pad = self.special_tokens.get("pad_token")
        self.pad_id = self.inner.token_to_id(pad) if pad is not None else None
        if self.pad_id is None:
            raise ConfigError(f"{where}: tokenizer_config.json names no pad_token that tokenizer.json holds ({pad!r})")
        for side in ("padding_side", "truncation_side"):
            if config.get(side, "right") != "right":
                raise ConfigError(f"{where}: {side} {config[side]!r}: only 'right' is supported, as Qwen's folders say")
        source = chat_template_source(folder, config)
        if source is None:
            raise ConfigError(f"{where}: no chat template (tokenizer_config.json's chat_template, chat_template.jinja)")
        self.template = compile_template(source)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **options) -> str:
        """The conversation as text: transformers' `apply_chat_template(messages, tokenize=False, ...)`."""
        messages = [{k: v for k, v in message.items() if v is not None} for message in messages]
        values = {**self.special_tokens, **options}
        return self.template.render(messages=messages, tools=None, documents=None,
                                    add_generation_prompt=add_generation_prompt, **values)  # fmt: skip

    def encode(self, text: str, max_length: int, what: str = "prompt") -> tuple[np.ndarray, np.ndarray, list[str]]:
        """int32 ids and bool mask [max_length] of `text` (cut, then padded on the right), and the warnings."""
        ids = self.inner.encode(text).ids
        warnings = []
        if len(ids) > max_length:
            dropped = self.inner.decode(ids[max_length:], skip_special_tokens=False)
            warnings.append(
                f"{what} truncated to {max_length} {self.unit} (with its chat template); dropped: {dropped!r}"
            )
            ids = ids[:max_length]
        out = np.full(max_length, self.pad_id, np.int32)
        out[: len(ids)] = ids
        return out, np.arange(max_length) < len(ids), warnings

    def chat(
        self, prompt: str, max_length: int, what: str = "prompt", **options
    ) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """One user message rendered with the generation prompt, as the diffusion pipelines tokenize a prompt:
        ids [1, max_length] int32, mask [1, max_length] bool, warnings. `options`: the template's (enable_thinking)."""
        text = self.render([{"role": "user", "content": prompt}], add_generation_prompt=True, **options)
        ids, mask, warnings = self.encode(text, max_length, what)
        return ids[None], mask[None], warnings
