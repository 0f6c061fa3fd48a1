"""Tiny T5 tokenizers and encoders made offline, saved as transformers saves them (SD3's and FLUX.1's folders).

`save_tiny_t5_tokenizer` builds a Unigram vocabulary with the `tokenizers` package, laid out as T5's
(`<pad>` 0, `</s>` 1, `<unk>` 2, Metaspace pre-tokenizer, `</s>` appended), and saves it as a `T5TokenizerFast`
folder. `save_tiny_t5_encoder` saves a `transformers.T5EncoderModel` whose weights are redrawn from a seeded
normal (no zero or one init left to hide a wrong mapping), scaled by fan-in so that attention stays soft.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import T5Config, T5EncoderModel, T5TokenizerFast

torch.set_num_threads(1)  # JAX holds the other core

T5_SPECIAL = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2, as in every T5 vocabulary
T5_WORDS = tuple(
    "a an the photo painting picture of cat cats dog dogs bird on in under over with and red blue green yellow "
    "purple black white mat tree sky house street city night sunset river mountain sitting running flying big "
    "small old young happy , .".split()
)
T5_CHARS = tuple("abcdefghijklmnopqrstuvwxyz0123456789,.!?'-")  # any other word is spelt out (or is <unk>)

# Tiny encoders: the first T5 v1.1's (gated GELU); the second with other relative buckets, a longer reach and
# more blocks; the third T5 1.0's feed-forward (relu, wi and wo).
T5_LAYOUTS = {
    "v1.1": dict(
        d_model=32,
        d_kv=8,
        num_heads=4,
        d_ff=37,
        num_layers=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        feed_forward_proj="gated-gelu",
    ),
    "buckets": dict(
        d_model=48,
        d_kv=16,
        num_heads=2,
        d_ff=64,
        num_layers=3,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=20,
        feed_forward_proj="gated-gelu",
    ),
    "relu": dict(d_model=32, d_kv=8, num_heads=4, d_ff=40, num_layers=2, feed_forward_proj="relu"),
}
# T5-XXL's block (SD3's text_encoder_3, FLUX.1's text_encoder_2: google/t5-v1_1-xxl), one of its 24.
T5_XXL_BLOCK = dict(
    d_model=4096,
    d_kv=64,
    num_heads=64,
    d_ff=10240,
    num_layers=1,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
)


def save_tiny_t5_tokenizer(folder: str | Path, vocab_words: tuple[str, ...] = T5_WORDS) -> int:
    """Saves a T5 tokenizer of `vocab_words` (plus single characters) in `folder`; returns its vocabulary size."""
    vocab = [(token, 0.0) for token in T5_SPECIAL] + [("▁", -2.0)]
    vocab += [("▁" + word, -1.0 - 0.01 * i) for i, word in enumerate(vocab_words)]
    vocab += [(char, -5.0) for char in T5_CHARS if "▁" + char not in {token for token, _ in vocab}]
    inner = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    # transformers' T5Tokenizer's own pipeline (tokenization_t5.py), so that a reload rebuilds the same one.
    inner.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")]
    )
    inner.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    inner.post_processor = processors.TemplateProcessing(
        single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"], special_tokens=[("</s>", 1)]
    )
    tokenizer = T5TokenizerFast(
        tokenizer_object=inner, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", extra_ids=0
    )
    tokenizer.save_pretrained(str(folder))
    return len(tokenizer)


def randomize_t5(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter redrawn: linears N(0, 1/fan_in), norms 1 + N(0, 0.1), embeddings and the bias N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layer_norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 2 and ("shared" in name or "relative_attention_bias" in name):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
    return model.eval()


def tiny_t5_encoder(vocab_size: int, seed: int = 0, **layout) -> T5EncoderModel:
    """A random `T5EncoderModel` of `layout` (T5Config's names) with `vocab_size` embeddings."""
    config = T5Config(vocab_size=vocab_size, dropout_rate=0.0, **layout)
    return randomize_t5(T5EncoderModel(config), seed)


def save_tiny_t5_encoder(folder: str | Path, vocab_size: int, seed: int = 0, **layout) -> T5EncoderModel:
    """`tiny_t5_encoder`, saved in `folder` (config.json, model.safetensors) as SD3's text_encoder_3 is."""
    model = tiny_t5_encoder(vocab_size, seed, **layout or T5_LAYOUTS["v1.1"])
    model.save_pretrained(str(folder))
    return model
