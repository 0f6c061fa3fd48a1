"""Textual inversion embeddings, read as A1111 reads them and used as diffusers' `load_textual_inversion` uses them.

A tiny SD 1.x model with an embeddings folder: A1111's `.pt` (written by torch.save in A1111's dict shape, 3 vectors),
a `.safetensors` with `emb_params` (2 vectors), one of the wrong width and an SDXL pair (both skipped, with their
reasons). The prompt's and negative prompt's conditioning equal diffusers' after `load_textual_inversion` of the same
files (the same token ids, f32 rounding), with emphasis, BREAK and long prompts around the embedding as A1111's
emphasis on the reference encoder gives them; the pictures equal diffusers' within 1/255, and a request without the
embedding runs the same compiled programs. A tiny SDXL with a `clip_l`/`clip_g` pair: both encoders' conditioning and
the pooled embedding equal diffusers' loading each half into its encoder. Wrong widths and unknown layouts are refused
by name.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import tiny_pipeline
import torch
from diffusers import (
    DDIMScheduler,
)
from flax import nnx
from reference import rel_error
from safetensors.numpy import save_file
from test_prompts import tiny_sdxl

from engine import load_pipeline
from engine.errors import SourceError
from engine.families import FAMILIES
from engine.families.loader import load_model_folder
from engine.loading.embeddings import read_embedding
from engine.loading.textual_inversion import attach_embeddings
from engine.request import GenerationRequest
from engine.sampling.pipeline import Plan, encode_prompts
from engine.sampling.prompts import stack, tokenize_chunks

WIDTH = 32  # the tiny SD 1.x text encoder's (CLIP_LAYOUTS["sd1"])
TOL = 1e-5  # f32: the same ids through the same weights, summed in another order
SIZE = 64
encode = jax.jit(encode_prompts, static_argnums=(4, 5))


def vectors(n: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)


def write_a1111_pt(file, array: np.ndarray) -> None:
    """An embedding as A1111's `Embedding.save` writes it."""
    torch.save(
        {
            "string_to_token": {"*": 265},
            "string_to_param": {"*": torch.from_numpy(array)},
            "name": file.stem,
            "step": 1500,
            "sd_checkpoint": "a9263745",
            "sd_checkpoint_name": "tiny-sd1",
        },
        file,
    )


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    """diffusers' pipeline with both embeddings loaded, our engine on the same folder and embeddings folder."""
    folder, embeddings = tmp_path_factory.mktemp("sd1"), tmp_path_factory.mktemp("embeddings")
    reference = tiny_pipeline.write("sd1", folder)
    write_a1111_pt(embeddings / "mystyle.pt", vectors(3, WIDTH, 1))
    save_file({"emb_params": vectors(2, WIDTH, 2)}, str(embeddings / "otherstyle.safetensors"))
    save_file({"emb_params": vectors(2, 48, 3)}, str(embeddings / "wide.safetensors"))  # another family's width
    save_file({"clip_l": vectors(1, WIDTH, 4), "clip_g": vectors(1, 48, 5)}, str(embeddings / "pair.safetensors"))
    reference.load_textual_inversion(str(embeddings / "mystyle.pt"), token="mystyle")
    reference.load_textual_inversion(str(embeddings / "otherstyle.safetensors"), token="otherstyle")
    reference.scheduler = DDIMScheduler.from_config(reference.scheduler.config)
    engine = load_pipeline(folder, embeddings=embeddings, max_batch_size=1, previews=False, safety_checker=False)
    yield reference, engine, folder, embeddings
    engine.close()


def reference_ids(reference, text: str) -> np.ndarray:
    """diffusers' ids: the name replaced by its added tokens (`maybe_convert_prompt`), then tokenized."""
    text = reference.maybe_convert_prompt(text, reference.tokenizer)
    return reference.tokenizer(text, padding="max_length", max_length=77, truncation=True).input_ids


def our_context(engine, prompt: str, negative: str = "") -> tuple[np.ndarray, np.ndarray, tuple]:
    tokenized = engine.prompts(GenerationRequest(prompt, negative_prompt=negative))
    models = nnx.merge(engine.model.graphdef, engine.model.params)
    plan = Plan(batch=1, latent_height=8, latent_width=8, scheduler="ddim", max_steps=4, guidance=True)
    cond, uncond = (encode(models, *stack([p]), {}, plan, neg) for p, neg in zip(tokenized, (False, True), strict=True))
    return np.asarray(cond.context[0]), np.asarray(uncond.context[0]), tokenized


def test_the_folder_loads_what_fits_and_says_why_it_skipped_the_rest(sd1):
    _, engine, _, _ = sd1
    loaded = {e.name: e for e in engine.embeddings.loaded}
    assert sorted(loaded) == ["mystyle", "otherstyle"]
    assert (loaded["mystyle"].vectors, loaded["otherstyle"].vectors) == (3, 2)
    assert loaded["mystyle"].encoders == ("text_encoder",)
    skipped = engine.embeddings.skipped
    assert sorted(skipped) == ["pair", "wide"]
    assert "48 wide" in skipped["wide"] and f"one tensor {WIDTH} wide" in skipped["wide"]
    assert "SDXL pair" in skipped["pair"]
    listing = engine.embeddings.a1111()
    assert listing["loaded"]["mystyle"] == dict(
        step=1500, sd_checkpoint="a9263745", sd_checkpoint_name="tiny-sd1", shape=WIDTH, vectors=3
    )
    assert listing["loaded"]["otherstyle"]["step"] is None and set(listing["skipped"]) == {"pair", "wide"}
    table = engine.model.params["text_encoder"]["text_model"]["embeddings"]["token_embedding"]["embedding"]
    assert table[...].shape[0] == engine.model.tokenizers[0].inner.vocab_size + 5  # 3 + 2 rows, appended once


@pytest.mark.parametrize(
    ("prompt", "negative"),
    [("a photo of mystyle", "otherstyle"), ("mystyle, a red circle on otherstyle", "blurry mystyle photo")],
)
def test_conditioning_equals_diffusers_load_textual_inversion(sd1, prompt, negative):
    reference, engine, _, _ = sd1
    cond, uncond, (tokenized, tokenized_negative) = our_context(engine, prompt, negative)
    # The placeholders are the rows diffusers appends, in the same order: the very ids diffusers gives the encoder.
    np.testing.assert_array_equal(tokenized.ids[0], reference_ids(reference, prompt))
    np.testing.assert_array_equal(tokenized_negative.ids[0], reference_ids(reference, negative))
    with torch.no_grad():
        want, want_negative = reference.encode_prompt(prompt, "cpu", 1, True, negative_prompt=negative)
    assert rel_error(cond, want[0].numpy()) < TOL
    assert rel_error(uncond, want_negative[0].numpy()) < TOL


def a1111_reference(reference, tokenized) -> np.ndarray:
    """diffusers' resized encoder on each chunk's ids, A1111's emphasis per chunk, chunks side by side."""
    chunks = []
    with torch.no_grad():
        for ids, weights in zip(tokenized.ids, tokenized.weights, strict=True):
            z = reference.text_encoder(torch.from_numpy(ids[None].astype(np.int64))).last_hidden_state[0]
            mean = z.mean()
            z = z * torch.from_numpy(weights)[:, None]
            chunks.append(z * (mean / z.mean()))
    return torch.cat(chunks).numpy()


WORDS = tiny_pipeline.WORDS


def test_emphasis_break_and_long_prompts_around_an_embedding(sd1):
    reference, engine, _, _ = sd1
    vocab = engine.model.tokenizers[0].inner.vocab_size
    mine = list(range(vocab, vocab + 3))
    long = " ".join(WORDS[k % len(WORDS)] for k in range(73))  # 73 tokens: mystyle's 3 do not fit after them
    prompt = f"(mystyle:1.2) on a [blue] background BREAK {long} mystyle"
    cond, _, (tokenized, _) = our_context(engine, prompt)
    assert tokenized.chunks == 3
    ids, weights = tokenized.ids, tokenized.weights
    np.testing.assert_array_equal(ids[0, 1:4], mine)
    np.testing.assert_allclose(weights[0, 1:4], 1.2)
    np.testing.assert_array_equal(ids[1, 74:], [vocab - 1] * 3)  # the chunk closed with 73 tokens: end tokens
    np.testing.assert_array_equal(ids[2, :5], [vocab - 2, *mine, vocab - 1])  # moved whole to the next chunk
    assert rel_error(cond, a1111_reference(reference, tokenized)) < 1e-4
    # A1111 matches the name's tokens as a word: "mystyles" is another word, "MyStyle" the same one.
    tok = engine.model.tokenizers[0]
    placeholders = engine.embeddings.placeholders[0]
    assert not set(tokenize_chunks(tok, "mystyles", embeddings=placeholders).ids[0]) & set(mine)
    assert tokenize_chunks(tok, "MyStyle", embeddings=placeholders).ids[0, 1:4].tolist() == mine


def test_pictures_equal_diffusers_and_need_no_new_compile(sd1):
    reference, engine, _, _ = sd1
    latents = np.random.default_rng(0).standard_normal((1, 4, SIZE // 8, SIZE // 8)).astype(np.float32)
    args = dict(num_inference_steps=2, guidance_scale=6.0, height=SIZE, width=SIZE, output_type="np")
    with torch.no_grad():
        want = reference("a photo of mystyle", negative_prompt="otherstyle", latents=torch.from_numpy(latents), **args)
    args = dict(args, scheduler="ddim", latents=latents)
    del args["output_type"]
    got = engine.generate("a photo of mystyle", negative_prompt="otherstyle", **args)
    assert np.abs(got.arrays - want.images).max() < 1 / 255
    assert got.arrays.std() > 0.01
    compiled = engine.compile_count
    plain = engine.generate("a photo of a cat", negative_prompt="blurry", **args)
    swapped = engine.generate("a (photo:1.1) of otherstyle", negative_prompt="[mystyle]", **args)
    assert engine.compile_count == compiled  # the embeddings' rows are data: the same programs
    assert np.abs(plain.arrays - got.arrays).max() > 0.01 and np.abs(swapped.arrays - got.arrays).max() > 0.01


def test_a_file_that_does_not_fit_is_refused_by_name(sd1, tmp_path):
    _, _, folder, embeddings = sd1
    model = load_model_folder(folder, "float32")
    with pytest.raises(SourceError, match=r"embedding 'wide' \(wide.safetensors: 2 vectors 48 wide\) does not fit"):
        attach_embeddings(model, embeddings / "wide.safetensors", FAMILIES["sd"])
    odd = tmp_path / "odd.safetensors"
    save_file({"weights": vectors(2, WIDTH, 6), "bias": vectors(1, WIDTH, 7)}, str(odd))
    with pytest.raises(SourceError, match=r"odd.safetensors: of no known layout; it holds bias \[1, 32\], weights"):
        read_embedding(odd)
    one = attach_embeddings(model, embeddings / "otherstyle.safetensors", FAMILIES["sd"])
    assert one.embeddings.names == ("otherstyle",) and not one.embeddings.skipped
    with pytest.raises(SourceError, match="models take no embeddings"):
        attach_embeddings(model, embeddings, FAMILIES["sd3"])


# --- SDXL: one embedding, a pair of tensors for the two encoders ---------------------------------------------------


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    reference, folder = tiny_sdxl(tmp_path_factory, WORDS)
    pair = {"clip_l": vectors(2, 32, 8), "clip_g": vectors(2, 48, 9)}
    file = tmp_path_factory.mktemp("sdxl-embeddings") / "pairstyle.safetensors"
    save_file(pair, str(file))
    for name, encoder, tokenizer in (
        ("clip_l", "text_encoder", "tokenizer"),
        ("clip_g", "text_encoder_2", "tokenizer_2"),
    ):
        reference.load_textual_inversion(
            torch.from_numpy(pair[name]),
            token="pairstyle",
            text_encoder=getattr(reference, encoder),
            tokenizer=getattr(reference, tokenizer),
        )
    loaded = attach_embeddings(load_model_folder(folder, "float32"), file, FAMILIES["sdxl"])
    return reference, loaded, file


def test_sdxl_pair_conditioning_equals_diffusers(sdxl):
    reference, loaded, _ = sdxl
    assert [(e.name, e.vectors, e.encoders, e.shape) for e in loaded.embeddings.loaded] == [
        ("pairstyle", 2, ("text_encoder", "text_encoder_2"), 80)
    ]
    prompt, negative = "a photo of pairstyle", "blurry pairstyle"
    from engine.sampling.prompts import tokenize_prompt

    tokenized = [
        tokenize_prompt(loaded.tokenizers, t, embeddings=loaded.embeddings.placeholders) for t in (prompt, negative)
    ]
    ids, weights = stack(tokenized)
    plan = Plan(batch=2, latent_height=8, latent_width=8, scheduler="euler", max_steps=4, guidance=True, family="sdxl")
    got = encode(
        nnx.merge(loaded.graphdef, loaded.params),
        ids,
        weights,
        loaded.extra_inputs(plan, prompt, negative),
        plan,
        False,
    )
    with torch.no_grad():
        want, want_negative, pooled, pooled_negative = reference.encode_prompt(
            prompt, negative_prompt=negative, device="cpu", num_images_per_prompt=1, do_classifier_free_guidance=True
        )
    assert rel_error(got.context[0], want[0].numpy()) < TOL
    assert rel_error(got.context[1], want_negative[0].numpy()) < TOL
    assert rel_error(got.text_embeds[0], pooled[0].numpy()) < TOL
    assert rel_error(got.text_embeds[1], pooled_negative[0].numpy()) < TOL


def test_sdxl_refuses_a_one_tensor_embedding(sdxl, tmp_path):
    _, loaded, _ = sdxl
    file = tmp_path / "flat.safetensors"
    save_file({"emb_params": vectors(2, 32, 10)}, str(file))
    with pytest.raises(SourceError, match=r"'flat' .* is one tensor, but .* takes clip_l 32 wide and clip_g 48 wide"):
        attach_embeddings(loaded, file, FAMILIES["sdxl"])
