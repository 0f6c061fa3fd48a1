"""`--quantize int8`'s Qwen3 text encoder widens its int8 kernels one layer at a time, not all at once.

Widened all at once (the whole tree through `dequantize` before the encoder ran, as the prompt-encoding program and
the host encoder once did), XLA held every layer's f32 kernels as temporaries: 9.6 GB for FLUX.2 [klein]'s 27
Qwen3-4B layers at 512 tokens, 12.7 GB for Z-Image's 36, where the f32 model needs 0.1 GB. Now the programs leave the
encoder's layers int8 (`dequantize(keep=widened_blocks(...))`) and the model widens each layer's after that
layer's input exists (`nn.int8_weights.widened`: an optimization barrier).

What is proven, on 12 layers of 256 wide (intermediate 1024), whose f32 kernels are 3.9 MB a layer: XLA's
temporaries of the encoding program, on the devices (as `admit` runs it) and on the host (`host_qwen3(int8=True)`),
stay within two layers' widened kernels, where widening all at once needs at least ten; and the hidden states are
exactly those of the widened-all-at-once program.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from qwen_reference import tiny_qwen3

from engine.families.base import Models
from engine.loading.host_encoder import host_qwen3
from engine.loading.quantize import dequantize, quantize_module, quantize_params
from engine.loading.weights import convert
from engine.models.qwen3 import Qwen3Config, Qwen3Model, encoder_tensors
from engine.nn.int8_weights import widened_blocks

LAYERS = 12
LAYOUT = dict(
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)
VOCAB, TOKENS = 64, 16
# One layer's f32 kernels: q and o 256x256, k and v 256x128, gate and up 256x1024, down 1024x256.
LAYER_BYTES = 4 * (2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 1024)


@pytest.fixture(scope="module")
def encoder():
    """The torch model's tensors (as a folder's text_encoder/ holds them), our config, ids and mask."""
    torch_model = tiny_qwen3(VOCAB, seed=5, **LAYOUT)
    tensors = {name: t.detach().numpy() for name, t in torch_model.state_dict().items()}
    config = Qwen3Config(vocab_size=VOCAB, **LAYOUT)
    ids = np.random.default_rng(0).integers(0, VOCAB, (1, TOKENS)).astype(np.int32)
    return tensors, config, ids, np.ones((1, TOKENS), np.int32)


def temporaries(run, *args) -> int:
    return run.lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_the_prompt_encoding_widens_one_layer_at_a_time(encoder):
    """The programs' keep (`widened_blocks` of the models: Qwen3's layers) against the whole tree widened before the
    encoder."""
    tensors, config, ids, mask = encoder
    graphdef, params = convert(
        lambda: Models(text_encoder=Qwen3Model(config, nnx.Rngs(0))),
        {f"text_encoder.{k}": v for k, v in encoder_tensors(tensors, config, LAYERS).items()},
        "float32",
    )
    params = quantize_params(params, "text_encoder")
    keep = widened_blocks(nnx.merge(graphdef, params))
    assert keep == (("text_encoder", "layers"),)
    at_once = jax.jit(lambda p, i, m: nnx.merge(graphdef, dequantize(p)).text_encoder(i, m))
    by_layer = jax.jit(lambda p, i, m: nnx.merge(graphdef, dequantize(p, keep=keep)).text_encoder(i, m))
    before, after = temporaries(at_once, params, ids, mask), temporaries(by_layer, params, ids, mask)
    print(f"encoding temporaries: {before} bytes widened at once, {after} by layer (a layer: {LAYER_BYTES})")
    assert before >= 10 * LAYER_BYTES  # what the bound below is measured against: every layer wide at once
    assert after <= 2 * LAYER_BYTES
    for got, want in zip(by_layer(params, ids, mask), at_once(params, ids, mask), strict=True):
        np.testing.assert_array_equal(got, want)


def test_the_host_encoder_widens_one_layer_at_a_time(encoder):
    """`host_qwen3(int8=True)` (`--t5 host` with `--quantize int8`) against its tree widened before the model."""
    tensors, config, ids, mask = encoder
    host = host_qwen3("text_encoder", config, tensors, "float32", "tiny", hidden_layers=(-1,), int8=True)
    assert host.params == quantize_module(host.params)  # every large kernel int8 already
    graphdef, _ = nnx.split(Qwen3Model(config, nnx.Rngs(0)))
    at_once = jax.jit(lambda p, i, m: nnx.merge(graphdef, dequantize(p))(i, m)[-1])
    before, after = temporaries(at_once, host.params, ids, mask), temporaries(host._run, host.params, ids, mask)
    print(f"host encoder temporaries: {before} bytes widened at once, {after} by layer (a layer: {LAYER_BYTES})")
    assert before >= 10 * LAYER_BYTES
    assert after <= 2 * LAYER_BYTES
    np.testing.assert_array_equal(host(ids, mask), at_once(host.params, ids, mask))
