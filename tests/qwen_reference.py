"""Tiny Qwen tokenizers and Qwen3 text encoders made offline, saved as Z-Image's and FLUX.2 [klein]'s folders hold them.

`save_tiny_qwen_tokenizer(folder)` trains a byte-level BPE (the `tokenizers` package, a few hundred tokens) with
Qwen2's pipeline (NFC, Qwen's split regex, byte-level pre-tokenizer and decoder), adds Qwen's `<|endoftext|>`
(pad), `<|im_start|>`, `<|im_end|>` (eos) and `<think>`/`</think>` after the vocabulary as Qwen numbers them,
and writes tokenizer.json and a tokenizer_config.json holding the real Qwen3 chat template (`QWEN3_CHAT_TEMPLATE`,
which closes an empty think block when `enable_thinking=False`), so that transformers' `AutoTokenizer` loads it
as a `Qwen2Tokenizer`. `template_file=True` writes the template to chat_template.jinja instead, as newer saves do.

`save_tiny_qwen3(folder, vocab_size, causal_lm=...)` saves a random `Qwen3Model` (Z-Image's text_encoder: keys
`embed_tokens`, `layers.N`, `norm`) or `Qwen3ForCausalLM` (FLUX.2 [klein]'s: the same under `model.`, beside
`lm_head`) of a layout in Qwen3Config's names (`QWEN3_LAYOUTS`); its weights are redrawn from a seeded normal,
so no one-init hides a wrong mapping.

    vocab = save_tiny_qwen_tokenizer(tmp / "tokenizer")
    model = save_tiny_qwen3(tmp / "text_encoder", vocab, causal_lm=True, **QWEN3_LAYOUTS["klein"])

or both at once, as a pipeline folder holds them: `save_tiny_qwen_components(tmp, "klein")`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model
from transformers.initialization import no_init_weights

torch.set_num_threads(1)  # JAX holds the other core

# transformers' Qwen2Tokenizer's split (tokenization_qwen2.py), as Qwen's tokenizer.json says it.
QWEN_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
# Qwen's added tokens, in its order (ids after the BPE vocabulary); the think tags are not special in Qwen3.
QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_THINK = ("<think>", "</think>")
CORPUS = (
    "a photo of a cat sitting on a red mat under the big old tree",
    "a painting of dogs running in the city at night, with blue and yellow lights",
    "user assistant system think the an of on in with and",
    "A bird flying over the river at sunset; mountains, houses and streets!",
    "Hello world: 123 456 789 0",
    "<think>\n\n</think>\n\nuser\nassistant\n",
)

# Qwen/Qwen3-4B's chat_template (tokenizer_config.json), verbatim.
QWEN3_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for forward_message in messages %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- set message = messages[index] %}
    {%- set tool_start = '<tool_response>' %}
    {%- set tool_start_length = tool_start|length %}
    {%- set start_of_message = message.content[:tool_start_length] %}
    {%- set tool_end = '</tool_response>' %}
    {%- set tool_end_length = tool_end|length %}
    {%- set start_pos = (message.content|length) - tool_end_length %}
    {%- if start_pos < 0 %}
        {%- set start_pos = 0 %}
    {%- endif %}
    {%- set end_of_message = message.content[start_pos:] %}
    {%- if ns.multi_step_tool and message.role == "user" and not(start_of_message == tool_start and end_of_message == tool_end) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = (message.content.split('</think>')|last).lstrip('\\n') %}
                {%- set reasoning_content = (message.content.split('</think>')|first).rstrip('\\n') %}
                {%- set reasoning_content = (reasoning_content.split('<think>')|last).lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# Tiny text encoders in Qwen3Config's names: "zimage" reads hidden_states[-2] of 3 layers; "klein" has the 28 that
# FLUX.2 [klein]'s layers (9, 18, 27) need; "plain" has as many heads as key/value heads and another RoPE base.
QWEN3_LAYOUTS = {
    "zimage": dict(
        hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rope_theta=1_000_000.0,
    ),
    "klein": dict(
        hidden_size=16, intermediate_size=24, num_hidden_layers=28, num_attention_heads=2, num_key_value_heads=1,
        head_dim=8, rope_theta=1_000_000.0,
    ),
    "plain": dict(
        hidden_size=24, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        head_dim=12, rope_theta=10_000.0, rms_norm_eps=1e-5,
    ),
}  # fmt: skip
# One layer of Qwen3-4B (Z-Image's and FLUX.2 [klein] 4B's text encoder), of its 36.
QWEN3_4B_LAYER = dict(
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=1,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rope_theta=1_000_000.0,
)
# Qwen/Qwen3-4B's config.json (its architecture's fields), for what the whole encoder weighs.
QWEN3_4B = dict(QWEN3_4B_LAYER, num_hidden_layers=36, vocab_size=151936, tie_word_embeddings=True)
# Qwen/Qwen3-8B's (FLUX.2 [klein] 9B's text encoder; its lm_head is not tied, and not read).
QWEN3_8B = dict(QWEN3_4B, hidden_size=4096, intermediate_size=12288, tie_word_embeddings=False)


def save_tiny_qwen_tokenizer(folder: str | Path, template_file: bool = False) -> int:
    """Saves a byte-level BPE Qwen tokenizer with Qwen3's chat template in `folder`; returns its vocabulary size."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    inner = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix=""))
    inner.normalizer = normalizers.NFC()
    inner.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, min_frequency=1, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    inner.train_from_iterator(CORPUS, trainer)
    inner.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIAL])
    inner.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN_THINK])
    inner.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": 131072,
    }
    if template_file:
        (folder / "chat_template.jinja").write_text(QWEN3_CHAT_TEMPLATE)
    else:
        config["chat_template"] = QWEN3_CHAT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return inner.get_vocab_size()


def randomize_qwen3(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter redrawn: linears N(0, 1/fan_in), norms 1 + N(0, 0.1), the embedding N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
    return model.eval()


def tiny_qwen3(vocab_size: int, seed: int = 0, causal_lm: bool = False, **layout) -> Qwen3Model | Qwen3ForCausalLM:
    """A random `Qwen3Model` (or `Qwen3ForCausalLM`) of `layout` (Qwen3Config's names) with `vocab_size` tokens."""
    config = Qwen3Config(vocab_size=vocab_size, attention_dropout=0.0, **layout)
    config._attn_implementation = "eager"  # f32 reference: the plain softmax, not a fused kernel
    with no_init_weights():  # every parameter is redrawn below: transformers' own init would be drawn for nothing
        model = (Qwen3ForCausalLM if causal_lm else Qwen3Model)(config)
    return randomize_qwen3(model, seed)


def save_tiny_qwen3(
    folder: str | Path, vocab_size: int, seed: int = 0, causal_lm: bool = False, **layout
) -> Qwen3Model | Qwen3ForCausalLM:
    """`tiny_qwen3`, saved in `folder` (config.json, model.safetensors) as a pipeline's text_encoder/ is."""
    model = tiny_qwen3(vocab_size, seed, causal_lm, **(layout or QWEN3_LAYOUTS["zimage"]))
    model.save_pretrained(str(folder))
    return model


def save_tiny_qwen_components(
    folder: str | Path, layout: str = "zimage", seed: int = 0
) -> tuple[Qwen3Model | Qwen3ForCausalLM, int]:
    """`folder`/tokenizer and `folder`/text_encoder as a pipeline folder holds them: Z-Image's `Qwen3Model` for
    the "zimage" and "plain" layouts, FLUX.2 [klein]'s `Qwen3ForCausalLM` for "klein". Returns the model and the
    vocabulary size (the model's `vocab_size`)."""
    folder = Path(folder)
    vocab = save_tiny_qwen_tokenizer(folder / "tokenizer")
    model = save_tiny_qwen3(folder / "text_encoder", vocab, seed, layout == "klein", **QWEN3_LAYOUTS[layout])
    return model, vocab
