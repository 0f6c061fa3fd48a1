"""The T5 encoder and tokenizer of SD3 and FLUX.1 equal transformers': folders saved by transformers, loaded as a
model folder is (read_safetensors + convert), f32, rel. error < 1e-4; half precision as transformers runs it."""

from __future__ import annotations

import threading
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from reference import rel_error, state_dict_numpy
from safetensors.numpy import load_file, save_file
from t5_reference import (
    T5_LAYOUTS,
    T5_XXL_BLOCK,
    save_tiny_t5_encoder,
    save_tiny_t5_tokenizer,
    tiny_t5_encoder,
)
from transformers import T5EncoderModel as TorchT5
from transformers import T5TokenizerFast
from transformers.models.t5.modeling_t5 import T5Attention as TorchT5Attention

from engine.errors import ConfigError, WeightsError
from engine.loading.t5_tokenizer import T5Tokenizer
from engine.loading.weights import convert, load_model, read_safetensors
from engine.models.t5 import T5Config, T5EncoderModel, relative_position_buckets

TOL = 1e-4  # as the UNet's and CLIP's parity (test_models.py)
PROMPTS = (
    "a photo of a cat sitting on a red mat under the big old tree",
    "a zebra, 3 dogs and 42 birds flying over the city at sunset!",  # spelt out, and an <unk>-free tail
)


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory) -> tuple[Path, int]:
    folder = tmp_path_factory.mktemp("t5_tokenizer")
    return folder, save_tiny_t5_tokenizer(folder)


def load_ours(folder: Path, dtype=np.float32) -> T5EncoderModel:
    cfg = T5Config.from_json(folder / "config.json")
    tensors = read_safetensors(sorted(folder.glob("*.safetensors")))
    return load_model(lambda: T5EncoderModel(cfg, nnx.Rngs(0)), tensors, dtype, where=str(folder))


def encode(ref: TorchT5, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():  # no attention mask, as diffusers' SD3 and FLUX pipelines call it
        return ref(torch.from_numpy(ids.astype(np.int64))).last_hidden_state.float().numpy()


@pytest.mark.parametrize("layout", sorted(T5_LAYOUTS))
@pytest.mark.parametrize("max_length", [12, 77])  # 77 is past every layout's relative_attention_max_distance
def test_t5_matches_transformers(layout, max_length, tokenizer_folder, tmp_path):
    folder, vocab = tokenizer_folder
    ref = save_tiny_t5_encoder(tmp_path, vocab, **T5_LAYOUTS[layout])
    ours = load_ours(tmp_path)
    tokenizer = T5Tokenizer(folder, max_length)
    ids = np.concatenate([tokenizer(prompt)[0] for prompt in PROMPTS])  # [2, max_length]: padding attends too
    got = ours(ids)
    assert got.shape == (2, max_length, T5_LAYOUTS[layout]["d_model"]) and got.dtype == np.float32
    assert rel_error(got, encode(ref, ids)) < TOL


@pytest.mark.parametrize("buckets, max_distance", [(32, 128), (8, 16), (32, 20), (16, 300)])
def test_relative_position_buckets_match_transformers(buckets, max_distance):
    distances = np.arange(-1023, 1024)  # every distance within FLUX's 512 tokens and beyond
    want = TorchT5Attention._relative_position_bucket(torch.from_numpy(distances), True, buckets, max_distance)
    np.testing.assert_array_equal(relative_position_buckets(distances, buckets, max_distance), want.numpy())


def test_t5_xxl_block_matches_transformers():
    """One block at T5-XXL's shapes (d_model 4096, 64 heads of 64, d_ff 10240), over 32 tokens."""
    ref = tiny_t5_encoder(vocab_size=64, seed=3, **T5_XXL_BLOCK)
    cfg = T5Config.from_dict(ref.config.to_dict())
    ours = load_model(lambda: T5EncoderModel(cfg, nnx.Rngs(0)), state_dict_numpy(ref))
    ids = np.random.default_rng(4).integers(0, 64, (1, 32)).astype(np.int32)
    ids[0, 20] = 1  # `</s>`, then padding
    ids[0, 21:] = 0
    assert rel_error(ours(ids), encode(ref, ids)) < TOL


def test_t5_tokenizer_gives_transformers_ids(tokenizer_folder):
    folder, _ = tokenizer_folder
    theirs = T5TokenizerFast.from_pretrained(str(folder))
    for max_length in (8, 32, 256):
        tokenizer = T5Tokenizer(folder, max_length)
        for prompt in (*PROMPTS, ""):
            ids, _ = tokenizer(prompt)
            # diffusers' `_get_t5_prompt_embeds` (SD3, FLUX.1).
            want = theirs(prompt, padding="max_length", max_length=max_length, truncation=True, add_special_tokens=True)
            assert ids.dtype == np.int32 and ids.shape == (1, max_length)
            assert ids[0].tolist() == want.input_ids
            assert 1 in ids[0] and set(ids[0, ids[0].tolist().index(1) + 1 :]) <= {0}  # `</s>`, then `<pad>` only


def test_a_long_prompt_is_cut_with_a_warning_naming_what_was_dropped(tokenizer_folder):
    folder, _ = tokenizer_folder
    words = "a photo of a cat on a red mat under the big old tree at night".split()  # one token each
    tokenizer = T5Tokenizer(folder, 8)
    ids, warnings = tokenizer(" ".join(words))
    assert ids[0, -1] == 1  # the end token survives the cut
    assert len(warnings) == 1 and "truncated to 8" in warnings[0]
    assert warnings[0].endswith(f"dropped: {' '.join(words[7:])!r}")
    assert tokenizer(" ".join(words[:7]))[1] == []  # 7 tokens and `</s>` fit exactly


def test_the_tokenizer_serves_threads_at_once(tokenizer_folder):
    folder, _ = tokenizer_folder
    tokenizer = T5Tokenizer(folder, 16)
    want = {prompt: tokenizer(prompt)[0] for prompt in (*PROMPTS, "cat " * 40)}
    bad = []

    def work(prompt):
        for _ in range(50):
            if not np.array_equal(tokenizer(prompt)[0], want[prompt]):
                bad.append(prompt)

    threads = [threading.Thread(target=work, args=(prompt,)) for prompt in want]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not bad


@pytest.mark.parametrize("names", ["shared", "embed_tokens", "both"])
def test_either_name_of_the_tied_embedding_loads(names, tmp_path):
    ref = save_tiny_t5_encoder(tmp_path, vocab_size=40)
    tensors = load_file(tmp_path / "model.safetensors")
    shared = tensors.pop("shared.weight")
    if names != "embed_tokens":
        tensors["shared.weight"] = shared
    if names != "shared":
        tensors["encoder.embed_tokens.weight"] = shared.copy()
    save_file(tensors, tmp_path / "model.safetensors")
    ids = np.arange(3, 23, dtype=np.int32)[None]
    assert rel_error(load_ours(tmp_path)(ids), encode(ref, ids)) < TOL


def test_tied_names_holding_different_tensors_are_refused(tmp_path):
    # transformers 5 would untie them and embed with `encoder.embed_tokens`; which one the author meant is unknown.
    save_tiny_t5_encoder(tmp_path, vocab_size=40)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["encoder.embed_tokens.weight"] = np.zeros_like(tensors["shared.weight"])
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(WeightsError, match="encoder.embed_tokens.weight is tied to shared.weight, but"):
        load_ours(tmp_path)


def test_weights_that_do_not_fit_are_refused(tmp_path):
    save_tiny_t5_encoder(tmp_path, vocab_size=40)
    cfg = T5Config.from_json(tmp_path / "config.json")
    tensors = dict(read_safetensors([tmp_path / "model.safetensors"]))
    del tensors["encoder.block.1.layer.1.DenseReluDense.wi_1.weight"]
    tensors["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"] = np.zeros((32, 4), np.float32)
    tensors["encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight"] = np.zeros((8, 4), np.float32)
    with pytest.raises(WeightsError) as err:
        convert(lambda: T5EncoderModel(cfg, nnx.Rngs(0)), tensors, where="text_encoder_3")
    message = str(err.value)
    assert "missing (1): encoder.block.1.layer.1.DenseReluDense.wi_1.weight" in message
    assert "unexpected (1): encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight" in message
    assert "mis-shaped (1): encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight" in message


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_as_transformers_runs_it(dtype, tokenizer_folder, tmp_path):
    """Each against the f32 reference, ours no worse than transformers' own run in that dtype. The first block's
    `wo` is scaled so that its output overflows float16 (65504): transformers keeps `wo` in f32 there, as we do."""
    folder, vocab = tokenizer_folder
    ref = tiny_t5_encoder(vocab, **T5_LAYOUTS["v1.1"])
    with torch.no_grad():
        ref.encoder.block[0].layer[1].DenseReluDense.wo.weight.mul_(3e4)
    ref.save_pretrained(str(tmp_path))
    ids = T5Tokenizer(folder, 24)(PROMPTS[0])[0]
    want = encode(ref, ids)
    theirs = TorchT5.from_pretrained(str(tmp_path), dtype=getattr(torch, dtype)).eval()
    assert theirs.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == (
        torch.float32 if dtype == "float16" else torch.bfloat16
    )
    got = load_ours(tmp_path, dtype)(ids)
    assert got.dtype == (ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)
    assert np.isfinite(np.asarray(got, np.float32)).all()
    their_error = rel_error(encode(theirs, ids), want)
    assert rel_error(np.asarray(got, np.float32), want) < max(2 * their_error, 1e-2)


# google/t5-v1_1-xxl's config.json as SD3's text_encoder_3 carries it (transformers 4.x), decoder keys included.
T5_XXL_CONFIG = {
    "_name_or_path": "google/t5-v1_1-xxl",
    "architectures": ["T5EncoderModel"],
    "classifier_dropout": 0.0,
    "d_ff": 10240,
    "d_kv": 64,
    "d_model": 4096,
    "decoder_start_token_id": 0,
    "dense_act_fn": "gelu_new",
    "dropout_rate": 0.1,
    "eos_token_id": 1,
    "feed_forward_proj": "gated-gelu",
    "initializer_factor": 1.0,
    "is_encoder_decoder": True,
    "is_gated_act": True,
    "layer_norm_epsilon": 1e-06,
    "model_type": "t5",
    "num_decoder_layers": 24,
    "num_heads": 64,
    "num_layers": 24,
    "output_past": True,
    "pad_token_id": 0,
    "relative_attention_max_distance": 128,
    "relative_attention_num_buckets": 32,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "transformers_version": "4.41.2",
    "use_cache": True,
    "vocab_size": 32128,
}


def test_the_published_t5_xxl_config_loads():
    cfg = T5Config.from_dict(T5_XXL_CONFIG)
    assert (cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.activation, cfg.gated) == (4096, 24, 64, "gelu_new", True)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(model_type="umt5"), "model_type 'umt5' is not a T5 encoder"),
        (dict(dense_act_fn="relu"), "contradict feed_forward_proj 'gated-gelu'"),
        (dict(feed_forward_proj="gated-tanh", dense_act_fn=None), "activation 'tanh' is not supported"),
        (dict(feed_forward_proj="very-gated-gelu"), "is not 'act' or 'gated-act'"),
    ],
)
def test_a_config_we_would_misread_is_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        T5Config.from_dict({**T5_XXL_CONFIG, **change})
