"""Qwen3 as Z-Image's and FLUX.2 [klein]'s text encoder equals transformers': every hidden state of a folder saved by
transformers (`Qwen3Model` or `Qwen3ForCausalLM`), loaded as a model folder is, in f32 with padding in the batch;
one layer at Qwen3-4B's widths; the chat template and ids of `apply_chat_template`; each pipeline's prompt
embeddings as diffusers computes them; and int8 kernels and bf16 near f32."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import Flux2KleinPipeline, ZImagePipeline
from flax import nnx
from qwen_reference import (
    QWEN3_4B,
    QWEN3_4B_LAYER,
    QWEN3_8B,
    QWEN3_CHAT_TEMPLATE,
    QWEN3_LAYOUTS,
    save_tiny_qwen3,
    save_tiny_qwen_components,
    save_tiny_qwen_tokenizer,
    tiny_qwen3,
)
from reference import rel_error, state_dict_numpy
from safetensors.numpy import load_file, save_file
from transformers import AutoTokenizer

from engine.errors import ConfigError, WeightsError
from engine.families.base import Models
from engine.families.qwen_prompt import FLUX2_KLEIN, Z_IMAGE
from engine.loading.host_encoder import host_qwen3
from engine.loading.quantize import Int8Kernel, dequantize, param_bytes, quantize_params
from engine.loading.qwen_tokenizer import QwenTokenizer
from engine.loading.weights import load_model, read_safetensors
from engine.models.qwen3 import Qwen3Config, Qwen3Model, encoder_tensors, layers_needed
from engine.nn.layers import shapes_only

TOL = 1e-5
PROMPTS = (
    "a photo of a cat sitting on a red mat under the big old tree",
    "Dogs!",  # short: the batch's other row is mostly padding
    "a zebra — 3 birds, über the café;\n\tnew line",  # unknown words, non-ASCII, a newline and a tab: bytes
    "",
)


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory) -> tuple[Path, int]:
    folder = tmp_path_factory.mktemp("qwen_tokenizer")
    return folder, save_tiny_qwen_tokenizer(folder)


def load_ours(folder: Path, dtype=np.float32, num_layers: int | None = None) -> Qwen3Model:
    cfg = Qwen3Config.from_json(folder / "config.json")
    n = num_layers or cfg.num_hidden_layers
    tensors = encoder_tensors(read_safetensors(sorted(folder.glob("*.safetensors"))), cfg, n)
    return load_model(lambda: Qwen3Model(cfg, nnx.Rngs(0), num_layers=n), tensors, dtype, where=str(folder))


def run(model: Qwen3Model, ids: np.ndarray, mask: np.ndarray) -> tuple[jax.Array, ...]:
    """The model's hidden states, jitted as the engine runs it (its parameters as arguments, not constants)."""
    graphdef, params = nnx.split(model)
    return jax.jit(lambda p, i, m: nnx.merge(graphdef, p)(i, m))(params, ids, mask)


def theirs_states(ref, ids: np.ndarray, mask: np.ndarray) -> list[np.ndarray]:
    with torch.no_grad():
        out = ref(torch.from_numpy(ids.astype(np.int64)), attention_mask=torch.from_numpy(mask.astype(np.int64)),
                  output_hidden_states=True)  # fmt: skip
    return [h.float().numpy() for h in out.hidden_states]


def batch(tokenizer: QwenTokenizer, prompts, max_length: int, enable_thinking: bool = True):
    rows = [tokenizer.chat(p, max_length, enable_thinking=enable_thinking) for p in prompts]
    return np.concatenate([r[0] for r in rows]), np.concatenate([r[1] for r in rows])


@pytest.mark.parametrize("layout, causal_lm", [("zimage", False), ("zimage", True), ("plain", False)])
def test_every_hidden_state_matches_transformers(layout, causal_lm, tokenizer_folder, tmp_path):
    folder, vocab = tokenizer_folder
    ref = save_tiny_qwen3(tmp_path, vocab, seed=1, causal_lm=causal_lm, **QWEN3_LAYOUTS[layout])
    ours = load_ours(tmp_path)
    ids, mask = batch(QwenTokenizer(folder), PROMPTS[:3], 40)  # [3, 40], right-padded to the longest and beyond
    assert not mask.all() and mask.sum(1).min() < 20  # padding that every row but none of its real tokens sees
    got, want = run(ours, ids, mask), theirs_states(ref, ids, mask)
    layers = QWEN3_LAYOUTS[layout]["num_hidden_layers"]
    assert len(got) == len(want) == layers + 1
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape and g.dtype == jnp.float32
        assert rel_error(g, w) < TOL, f"hidden state {i}"  # the padding rows too: FLUX.2 [klein] reads them


def test_a_prompt_alone_equals_its_row_in_a_padded_batch(tokenizer_folder, tmp_path):
    """Padding changes no real token's states (causal, right-padded, masked), so Z-Image's reading, which keeps the
    real tokens only, may run fewer tokens than 512; FLUX.2 [klein]'s reads the padding's rows too."""
    folder, vocab = tokenizer_folder
    save_tiny_qwen3(tmp_path, vocab, seed=2)
    ours, tokenizer = load_ours(tmp_path), QwenTokenizer(folder)
    cfg = ours.config
    ids, mask = batch(tokenizer, PROMPTS[:2], 32)
    n = int(mask[1].sum())
    alone = Z_IMAGE.embeds(cfg, run(ours, ids[1:, :n], mask[1:, :n]))
    assert rel_error(alone[0], Z_IMAGE.embeds(cfg, run(ours, ids, mask))[1, :n]) < TOL
    assert not Z_IMAGE.reads_padding and FLUX2_KLEIN.reads_padding


@pytest.fixture(scope="module")
def qwen3_4b_layer():
    """One layer at Qwen3-4B's widths (2560 wide, 32 heads and 8 key/value heads of 128, SwiGLU 9728), 48 tokens
    of which the second row's last 20 are padding."""
    ref = tiny_qwen3(vocab_size=64, seed=3, **QWEN3_4B_LAYER)
    cfg = Qwen3Config.from_dict(ref.config.to_dict())
    ours = load_model(lambda: Qwen3Model(cfg, nnx.Rngs(0)), state_dict_numpy(ref))
    ids = np.random.default_rng(4).integers(0, 64, (2, 48)).astype(np.int32)
    mask = np.ones((2, 48), bool)
    mask[1, 28:] = False
    return ref, cfg, ours, ids, mask, theirs_states(ref, ids, mask)


def test_one_qwen3_4b_layer_matches_transformers(qwen3_4b_layer):
    _, _, ours, ids, mask, want = qwen3_4b_layer
    got = run(ours, ids, mask)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert rel_error(g, w) < TOL, f"hidden state {i}"


def test_int8_kernels_stay_near_f32(qwen3_4b_layer):
    """`quantize_params` on the text encoder's component (`--quantize int8`), run as the programs run it (dequantize
    inside jit): the layer's output within 2% of f32's largest value (measured 1.04%: one scale per output channel
    over Gaussian weights rounds each to about 1% of their spread)."""
    _, _, ours, ids, mask, want = qwen3_4b_layer
    graphdef, params = nnx.split(Models(text_encoder=ours))
    quantized = quantize_params(params, "text_encoder")
    kernels = [x for x in jax.tree.leaves(quantized, is_leaf=lambda x: isinstance(x, Int8Kernel))]
    assert sum(isinstance(k, Int8Kernel) for k in kernels) == 7  # q, k, v, o, gate, up, down
    assert param_bytes(quantized) / param_bytes(params) < 0.26  # f32 -> int8: a quarter, plus scales and norms
    run = jax.jit(lambda p, i, m: nnx.merge(graphdef, dequantize(p)).text_encoder(i, m)[-1])
    got = run(quantized, ids, mask)
    error = rel_error(got, want[-1])
    assert 1e-4 < error < 2e-2, error


def test_bfloat16_runs_near_f32(tokenizer_folder, tmp_path):
    """bf16 weights and activations (norms, RoPE angles and softmax in f32): as near f32 as transformers' bf16."""
    folder, vocab = tokenizer_folder
    ref = save_tiny_qwen3(tmp_path, vocab, seed=5)
    ids, mask = batch(QwenTokenizer(folder), PROMPTS[:2], 32)
    got = run(load_ours(tmp_path, dtype="bfloat16"), ids, mask)
    want = theirs_states(ref, ids, mask)
    theirs_bf16 = theirs_states(ref.to(torch.bfloat16), ids, mask)
    for g, w, t in zip(got, want, theirs_bf16, strict=True):
        assert g.dtype == jnp.bfloat16 and bool(jnp.isfinite(g).all())
        assert rel_error(g, w) < max(3 * rel_error(t, w), 2e-2)


@pytest.mark.parametrize("template_file", [False, True])
def test_the_chat_template_and_ids_equal_transformers(template_file, tmp_path):
    vocab_folder = tmp_path / "tokenizer"
    save_tiny_qwen_tokenizer(vocab_folder, template_file=template_file)
    assert (vocab_folder / "chat_template.jinja").exists() == template_file
    theirs, ours = AutoTokenizer.from_pretrained(str(vocab_folder)), QwenTokenizer(vocab_folder)
    for prompt in PROMPTS:
        for options in ({"enable_thinking": True}, {"enable_thinking": False}, {}):  # Z-Image, Klein, unset
            messages = [{"role": "user", "content": prompt}]
            want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **options)
            assert ours.render(messages, add_generation_prompt=True, **options) == want
            ids, mask, warnings = ours.chat(prompt, 64, **options)
            encoded = theirs(want, padding="max_length", max_length=64, truncation=True)
            assert ids.dtype == np.int32 and ids.shape == mask.shape == (1, 64) and warnings == []
            assert ids[0].tolist() == encoded.input_ids and mask[0].tolist() == [
                bool(m) for m in encoded.attention_mask
            ]
    # A conversation with a system message and an earlier answer whose reasoning the template drops.
    chat = [
        {"role": "system", "content": "You draw."},
        {"role": "user", "content": "a cat"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA cat."},
        {"role": "user", "content": "a dog"},
    ]
    assert ours.render(chat) == theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"chat_template": None}, "no chat template"),
        ({"pad_token": "<|nothing|>"}, "names no pad_token"),
        ({"padding_side": "left"}, "padding_side 'left'"),
    ],
)
def test_a_tokenizer_folder_it_cannot_follow_is_refused(change, message, tmp_path):
    save_tiny_qwen_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.update(change)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    with pytest.raises(ConfigError, match=message):
        QwenTokenizer(tmp_path)


def test_a_long_prompt_is_cut_with_a_warning(tokenizer_folder):
    folder, _ = tokenizer_folder
    tokenizer = QwenTokenizer(folder)
    ids, mask, warnings = tokenizer.chat(PROMPTS[0] * 4, 16, enable_thinking=False)
    assert mask.all() and ids.shape == (1, 16)
    assert len(warnings) == 1 and "truncated to 16 Qwen tokens" in warnings[0] and "</think>" in warnings[0]
    assert tokenizer.chat("cat", 64)[2] == []


@pytest.mark.parametrize("recipe", ["zimage", "klein"])
def test_each_pipelines_prompt_embeds_equal_diffusers(recipe, tmp_path):
    """Z-Image's `_encode_prompt` (hidden_states[-2] of the real tokens, from a `Qwen3Model`) and FLUX.2 [klein]'s
    `_get_qwen3_prompt_embeds` (layers 9, 18, 27 of a 28-layer `Qwen3ForCausalLM`, padding included), from a model
    that builds only the layers read, on the host (as T5 runs with --t5 host) and on the devices."""
    ref, _ = save_tiny_qwen_components(tmp_path, recipe, seed=6)
    causal, tokenizer_folder, encoder_folder = recipe == "klein", tmp_path / "tokenizer", tmp_path / "text_encoder"
    prompt = FLUX2_KLEIN if causal else Z_IMAGE
    cfg = Qwen3Config.from_json(encoder_folder / "config.json")
    n = prompt.layers(cfg)
    assert n == (27 if causal else 2)  # not the layers after: 28 and 3 in the folder
    prompts = list(PROMPTS[:3])
    ids, mask, warnings = prompt.tokenize(QwenTokenizer(tokenizer_folder), prompts, max_length=48)
    assert len(warnings) == int(causal)  # Klein's third prompt loses its empty think block, as diffusers cuts it
    tensors = read_safetensors(sorted(encoder_folder.glob("*.safetensors")))
    got = host_qwen3("text_encoder", cfg, tensors, "float32", "tiny", prompt.hidden_layers)(ids, mask)
    if not causal:  # one compile of 27 layers is enough for Klein
        device = prompt.embeds(cfg, run(load_ours(encoder_folder, num_layers=n), ids, mask))
        assert rel_error(device, got) < 1e-6
    theirs = AutoTokenizer.from_pretrained(str(tokenizer_folder))
    if causal:
        want = Flux2KleinPipeline._get_qwen3_prompt_embeds(ref, theirs, list(prompts), max_sequence_length=48)
        assert got.shape == (3, 48, 3 * cfg.hidden_size)
        assert rel_error(got, want.detach().numpy()) < TOL
    else:
        pipe = SimpleNamespace(tokenizer=theirs, text_encoder=ref, _execution_device=torch.device("cpu"))
        want = ZImagePipeline._encode_prompt(pipe, list(prompts), max_sequence_length=48)
        for row, (g, m, w) in enumerate(zip(got, mask, want, strict=True)):
            assert rel_error(g[m], w.detach().numpy()) < TOL, f"prompt {row}"


def test_layers_needed_counts_transformers_hidden_states():
    cfg = Qwen3Config(num_hidden_layers=36)
    assert layers_needed(cfg, (-2,)) == 35 and layers_needed(cfg, (9, 18, 27)) == 27
    assert layers_needed(cfg, (-1,)) == layers_needed(cfg, (36,)) == 36  # the last entry: every layer, normed
    with pytest.raises(ValueError, match="hidden state 37"):
        layers_needed(cfg, (37,))


@pytest.mark.parametrize(
    "model, reading, layers, count, bf16, int8",
    [
        ("4B", None, 36, 4.022, 8.04, 4.41),
        ("4B", "zimage", 35, 3.922, 7.84, 4.31),
        ("4B", "klein", 27, 3.114, 6.23, 3.50),
        ("8B", "klein", 27, 5.832, 11.66, 6.46),
    ],
)
def test_what_qwen3_weighs_in_bf16_and_int8(model, reading, layers, count, bf16, int8):
    """Qwen/Qwen3-4B's and -8B's shapes (no weights drawn): 4.02 B parameters, 0.39 B of them the embedding (tied to
    lm_head); 8.19 B with an lm_head of 0.62 B that no text encoder reads. int8 kernels take the layers to one byte a
    weight, the embedding stays bf16. Z-Image's reading needs 35 of the 36 layers, FLUX.2 [klein]'s 27 (4B and 9B,
    on Qwen3-8B). GB: 1e9 bytes."""
    cfg = Qwen3Config(**(QWEN3_4B if model == "4B" else QWEN3_8B))
    if reading is not None:
        assert (Z_IMAGE if reading == "zimage" else FLUX2_KLEIN).layers(cfg) == layers
    with shapes_only():
        _, params = nnx.split(Models(text_encoder=Qwen3Model(cfg, nnx.Rngs(0), num_layers=layers)))
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.bfloat16), params)
    quantized = quantize_params(params, "text_encoder")
    assert param_bytes(params) / 2e9 == pytest.approx(count, abs=0.001)
    assert (param_bytes(params) / 1e9, param_bytes(quantized) / 1e9) == pytest.approx((bf16, int8), abs=0.01)


def test_stray_tensors_and_unsupported_configs_are_refused(tokenizer_folder, tmp_path):
    _, vocab = tokenizer_folder
    save_tiny_qwen3(tmp_path, vocab, causal_lm=True)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary.weight"] = np.zeros(3, np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(WeightsError, match=r"unexpected \(1\): layers\.0\.self_attn\.rotary\.weight"):
        load_ours(tmp_path)
    raw = {"model_type": "qwen3", "num_attention_heads": 4, "num_key_value_heads": 2}
    for extra, message in (
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "only the default RoPE"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "only the default RoPE"),
        ({"use_sliding_window": True}, "sliding-window"),
        ({"num_key_value_heads": 3}, "not a multiple"),
        ({"model_type": "qwen2"}, "is not Qwen3"),
    ):
        with pytest.raises(ConfigError, match=message):
            Qwen3Config.from_dict({**raw, **extra})
    assert (
        Qwen3Config.from_dict({**raw, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}).rope_theta == 5e5
    )
    assert "enable_thinking is defined and enable_thinking is false" in QWEN3_CHAT_TEMPLATE
