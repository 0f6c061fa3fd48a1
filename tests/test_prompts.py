"""Long prompts and emphasis read as AUTOMATIC1111 reads them, and the conditioning they give.

The parser on A1111's own examples (the docstring of `parse_prompt_attention` and the wiki's emphasis
section); chunking on a tiny tokenizer whose words are one token each; the conditioning of every chunk
against transformers' `CLIPTextModel` on the same ids with A1111's emphasis written out in torch
(rel. error < 1e-4, f32), for SD 1.x (with and without clip skip), an SD 2.x-style tokenizer that pads
with "!" and SDXL's two encoders; a plain prompt gives today's ids and conditioning bit for bit; and
diffusers' `StableDiffusionPipeline` given that reference conditioning as `prompt_embeds` draws what our
UNet and VAE draw from ours (max abs pixel difference < 1e-2 on 0..1).
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_pipeline
import torch
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    EulerDiscreteScheduler,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from flax import nnx
from reference import CLIP_LAYOUTS, UNET_LAYOUTS, VAE_LAYOUT, randomize, rel_error
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from engine import schedulers
from engine.families import ENCODERS
from engine.families.loader import load_model_folder
from engine.loading.tokenizer import Tokenizer
from engine.sampling.pipeline import Plan, decode, encode_prompts
from engine.sampling.prompts import (
    BREAK,
    align,
    apply_emphasis,
    parse_prompt_attention,
    stack,
    tokenize_chunks,
    tokenize_prompt,
)
from engine.serving.engine import Engine
from tools.tiny_tokenizer import write_tokenizer

TOL = 1e-4
WORDS = tiny_pipeline.WORDS  # one token each in the tiny tokenizer

# A1111's docstring of `parse_prompt_attention`, then its wiki (Features, "Attention/emphasis").
A1111_EXAMPLES = [
    ("normal text", [("normal text", 1.0)]),
    ("an (important) word", [("an ", 1.0), ("important", 1.1), (" word", 1.0)]),
    ("(unbalanced", [("unbalanced", 1.1)]),
    ("\\(literal\\]", [("(literal]", 1.0)]),
    ("(unnecessary)(parens)", [("unnecessaryparens", 1.1)]),
    (
        "a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).",
        [
            ("a ", 1.0),
            ("house", 1.5730000000000004),
            (" ", 1.1),
            ("on", 1.0),
            (" a ", 1.1),
            ("hill", 0.55),
            (", sun, ", 1.1),
            ("sky", 1.4641000000000006),
            (".", 1.1),
        ],
    ),
    ("a (word)", [("a ", 1.0), ("word", 1.1)]),
    ("a ((word))", [("a ", 1.0), ("word", 1.21)]),
    ("a [word]", [("a ", 1.0), ("word", 1 / 1.1)]),
    ("a (word:1.5)", [("a ", 1.0), ("word", 1.5)]),
    ("a (word:0.25)", [("a ", 1.0), ("word", 0.25)]),
    ("a \\(word\\)", [("a (word)", 1.0)]),
]
# What follows from the same rules: spaces around a weight, escapes, unmatched closers, nesting, BREAK.
MORE_EXAMPLES = [
    ("", [("", 1.0)]),
    ("(a cat : 1.5 )", [("a cat ", 1.5)]),
    ("[[a cat]]", [("a cat", 1 / 1.21)]),
    ("((a) b)", [("a", 1.21), (" b", 1.1)]),
    ("[(a:2) b]", [("a", 2 / 1.1), (" b", 1 / 1.1)]),
    ("a) b] c", [("a) b] c", 1.0)]),  # closers without openers are text
    ("a \\\\ b", [("a \\ b", 1.0)]),  # \\ is a backslash
    ("a \\b", [("a b", 1.0)]),  # a lone backslash escapes nothing and vanishes
    ("a: b", [("a: b", 1.0)]),
    ("[cat:dog:0.5]", [("cat:dog:0.5", 1 / 1.1)]),  # no prompt editing here: text in square brackets
    ("(a:1.2.3)", [("a:1.2.3)", 1.1)]),  # not a weight: text, and the bracket is left open
    ("a BREAK b", [("a", 1.0), BREAK, ("b", 1.0)]),
    ("BREAK a", [("", 1.0), BREAK, ("a", 1.0)]),
    ("a\nBREAK\nb", [("a", 1.0), BREAK, ("b", 1.0)]),
    ("aBREAK b", [("aBREAK b", 1.0)]),  # only the word
    ("(a BREAK b)", [("a", 1.1), ("BREAK", -1.1), ("b", 1.1)]),  # in brackets it is weighed, hence a word
]


@pytest.mark.parametrize(("text", "want"), A1111_EXAMPLES + MORE_EXAMPLES, ids=lambda x: repr(x)[:40])
def test_parser_reads_a1111_examples(text, want):
    got = parse_prompt_attention(text)
    assert [t for t, _ in got] == [t for t, _ in want]
    assert [w for _, w in got] == pytest.approx([w for _, w in want], rel=1e-12)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """The tiny tokenizer padding with the end token (SD 1.x) and with "!" (SD 2.x, SDXL's second)."""
    folder = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(folder, WORDS)
    return {
        "end": CLIPTokenizer.from_pretrained(str(folder)),
        "!": CLIPTokenizer.from_pretrained(str(folder), pad_token="!"),
    }


def words(n: int, offset: int = 0) -> list[str]:
    return [WORDS[(offset + k) % len(WORDS)] for k in range(n)]


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, verbose=False).input_ids


@pytest.mark.parametrize("pad", ["end", "!"])
@pytest.mark.parametrize(
    "text", ["a red circle on a blue background", "", "photo: a cat, on blue", " ".join(words(75)), "zebra"]
)
def test_plain_prompts_give_todays_ids(tokenizers, pad, text, tmp_path):
    tokenizers[pad].save_pretrained(tmp_path)
    today, warnings = Tokenizer(tmp_path)(text)
    got = tokenize_chunks(tokenizers[pad], text)
    assert not warnings and got.chunks == 1
    np.testing.assert_array_equal(got.ids, today)
    np.testing.assert_array_equal(got.weights, np.ones((1, 77)))
    assert got.note() is None


def test_a_long_prompt_is_cut_every_75_tokens(tokenizers):
    tok = tokenizers["end"]
    text = " ".join(words(160))
    got = tokenize_chunks(tok, text)
    tokens = ids_of(tok, text)
    assert len(tokens) == 160 and got.chunks == 3 and got.token_count == 160
    start, end = tok.bos_token_id, tok.eos_token_id
    for k in range(3):
        part = tokens[75 * k : 75 * (k + 1)]
        np.testing.assert_array_equal(got.ids[k], [start, *part, *[end] * (76 - len(part))])
    assert got.note() == "prompt: 160 tokens, encoded in 3 chunks of 75"


@pytest.mark.parametrize(("comma_at", "moved"), [(70, 4), (55, 19), (54, 0), (74, 0)])
def test_a_chunk_breaks_at_a_comma_within_20_tokens_of_its_end(tokenizers, comma_at, moved):
    tok = tokenizers["end"]
    text = " ".join(words(comma_at)) + ", " + " ".join(words(30, comma_at))
    tokens = ids_of(tok, text)
    assert tokens[comma_at] == tok.get_vocab()[",</w>"]
    got = tokenize_chunks(tok, text)
    first = tokens[: 75 - moved]  # up to and with the comma when the words after it moved on
    end = tok.eos_token_id
    np.testing.assert_array_equal(got.ids[0], [tok.bos_token_id, *first, *[end] * (76 - len(first))])
    np.testing.assert_array_equal(got.ids[1][1 : 1 + len(tokens) - len(first)], tokens[len(first) :])
    assert got.token_count == 75 + len(tokens) - len(first)  # a full chunk counts 75, as A1111 counts
    assert tokenize_chunks(tok, text, comma_backtrack=0).ids[0].tolist()[1:76] == tokens[:75]


def test_break_starts_a_new_chunk(tokenizers):
    tok = tokenizers["!"]
    got = tokenize_chunks(tok, "a red circle BREAK on blue background")
    start, end = tok.bos_token_id, tok.eos_token_id
    assert got.chunks == 2
    for row, text in zip(got.ids, ["a red circle", "on blue background"], strict=True):
        np.testing.assert_array_equal(row, [start, *ids_of(tok, text), end, *[0] * 72])  # then "!" (id 0)
    assert tokenize_chunks(tok, "a red circle BREAK on blue", emphasis=False).chunks == 1


def test_weights_sit_on_their_tokens(tokenizers):
    tok = tokenizers["end"]
    got = tokenize_chunks(tok, "a (red:1.5) [circle] \\(on\\) blue")
    tokens = ids_of(tok, "a red circle ( on ) blue")
    np.testing.assert_array_equal(got.ids[0, 1:8], tokens)
    want = [1.0, 1.0, 1.5, 1 / 1.1, 1.0, 1.0, 1.0, 1.0, 1.0]
    np.testing.assert_allclose(got.weights[0, :9], want, rtol=1e-6)
    assert (got.weights[0, 9:] == 1).all()


@pytest.mark.parametrize("pad", ["end", "!"])
def test_the_shorter_prompt_is_padded_with_empty_chunks(tokenizers, pad, tmp_path):
    tok = tokenizers[pad]
    prompt, negative = tokenize_chunks(tok, " ".join(words(100))), tokenize_chunks(tok, "blurry")
    prompt, negative = align(prompt, negative)
    assert prompt.chunks == negative.chunks == 2
    tok.save_pretrained(tmp_path)
    np.testing.assert_array_equal(negative.ids[1], Tokenizer(tmp_path)("")[0][0])  # an empty chunk is ""
    ids, weights = stack([prompt, negative], chunks=3)
    assert ids.shape == weights.shape == (2, 3, 77) and ids.dtype == np.int32
    np.testing.assert_array_equal(ids[0, 2], ids[1, 1])


def test_several_tokenizers_stack_per_chunk(tokenizers):
    got = tokenize_prompt([tokenizers["end"], tokenizers["!"]], " ".join(words(90)) + " BREAK (cat)")
    assert got.ids.shape == got.weights.shape == (3, 2, 77)
    for k, tok in enumerate(tokenizers.values()):
        np.testing.assert_array_equal(got.ids[:, k], tokenize_chunks(tok, " ".join(words(90)) + " BREAK (cat)").ids)
    assert got.padded(4).ids.shape == (4, 2, 77)


# --- the conditioning --------------------------------------------------------------------------------


def a1111_emphasis(z: torch.Tensor, weights: np.ndarray) -> torch.Tensor:
    """A1111's "Original" emphasis on one chunk of one prompt, as sd_emphasis.py does it."""
    original_mean = z.mean()
    z = z * torch.from_numpy(weights)[..., None]
    return z * (original_mean / z.mean())


def reference_context(encoders, layers, tokenized, with_pooled=False):
    """transformers' encoders over each chunk, A1111's emphasis per encoder, chunks side by side."""
    ids = tokenized.ids if tokenized.ids.ndim == 3 else tokenized.ids[:, None]
    weights = tokenized.weights if tokenized.weights.ndim == 3 else tokenized.weights[:, None]
    chunks, pooled = [], None
    with torch.no_grad():
        for k in range(ids.shape[0]):
            parts = []
            for e, (encoder, layer) in enumerate(zip(encoders, layers, strict=True)):
                out = encoder(torch.from_numpy(ids[k, e][None].astype(np.int64)), output_hidden_states=True)
                z = layer(encoder, out)
                parts.append(a1111_emphasis(z[0], weights[k, e]))
                if k == 0 and with_pooled and e == len(encoders) - 1:
                    pooled = out.text_embeds[0].numpy()
            chunks.append(torch.cat(parts, dim=-1))
    return torch.cat(chunks).numpy(), pooled


LAST = lambda enc, out: out.last_hidden_state  # noqa: E731
SKIP_ONE = lambda enc, out: enc.final_layer_norm(out.hidden_states[-2])  # noqa: E731 (transformers 5: no .text_model)
PENULTIMATE = lambda enc, out: out.hidden_states[-2]  # noqa: E731

PROMPTS = {
    "long": " ".join(words(100)) + ", a blurry photo of a cat",
    "emphasis": "a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).",
    "nested and escaped": "((a red circle)) on [[a (blue:1.4) background]] \\(photo\\)",
    "break": "a red (circle:1.2) BREAK on a [blue] background",
    "long emphasis": "(" + " ".join(words(80)) + ":1.3), " + "[" + " ".join(words(40)) + "]",
}


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sd1")
    reference = tiny_pipeline.write("sd1", folder)
    loaded = load_model_folder(folder, "float32")
    return reference, loaded, nnx.merge(loaded.graphdef, loaded.params)


def sd_plan(family="sd", clip_skip=0, batch=1) -> Plan:
    return Plan(
        batch=batch,
        latent_height=8,
        latent_width=8,
        scheduler="euler",
        max_steps=4,
        guidance=True,
        family=family,
        clip_skip=clip_skip,
    )


SD_CASES = [(name, 0) for name in PROMPTS] + [("long emphasis", 1)]  # (prompt, clip_skip)


@pytest.mark.parametrize(("name", "clip_skip"), SD_CASES)
def test_sd_conditioning_matches_transformers(sd1, name, clip_skip):
    prompt = PROMPTS[name]
    reference, loaded, models = sd1
    tokenized = tokenize_prompt(loaded.tokenizers, prompt)
    assert tokenized.chunks > 1 or "(" in prompt
    ids, weights = stack([tokenized])
    got = jax.jit(encode_prompts, static_argnums=(4, 5))(models, ids, weights, {}, sd_plan(clip_skip=clip_skip), False)
    layer = SKIP_ONE if clip_skip else LAST
    want, _ = reference_context([reference.text_encoder], [layer], tokenized)
    exact, _ = reference_context([copy.deepcopy(reference.text_encoder).double()], [layer], tokenized)
    assert got.context.shape == (1, 77 * tokenized.chunks, 32) and got.text_embeds is None
    # Emphasis divides by the chunk's mean, which can lie near zero ("break": f32 costs the reference itself 8e-5 of
    # the exact answer there, 3e-7 elsewhere): ours is held to the exact (f64) answer, within TOL or within three
    # times what f32 rounding costs the reference, whichever is larger.
    assert rel_error(got.context[0], exact) < max(TOL, 3 * rel_error(want, exact))


def test_emphasis_keeps_the_mean_and_weighs_tokens(sd1):
    _, loaded, models = sd1
    plain, weighed = (tokenize_prompt(loaded.tokenizers, t) for t in ("a red circle", "a (red:1.5) circle"))
    np.testing.assert_array_equal(plain.ids, weighed.ids)
    z = jax.jit(lambda m, i: m.text_encoder(i).last_hidden_state)(models, plain.ids)[None]  # [1, 1, 77, 32]
    got = np.asarray(apply_emphasis(z, weighed.weights[None]))[0]
    z = np.asarray(z)[0, 0]
    # The mean lies near zero (4e-4 against values near 1): it is kept to f32's rounding of the values it averages,
    # not to a share of itself, which the order of the sums alone moves by 1e-5.
    assert abs(got.mean() - z.mean()) <= 4 * np.finfo(np.float32).eps * np.abs(z).mean()
    ratio = got / z
    np.testing.assert_allclose(ratio[2] / ratio[1], 1.5, rtol=1e-5)  # "red" against "a"
    np.testing.assert_allclose(
        ratio[[0, 1, 3, 4, 40]], np.broadcast_to(ratio[1], (5, 32)), rtol=1e-5
    )  # the rest: one common factor


@pytest.mark.parametrize("family", ["sd", "sdxl"])
def test_plain_prompt_conditioning_is_todays_bit_for_bit(sd1, sdxl, family):
    loaded, models = (sd1 if family == "sd" else sdxl)[1:]
    texts = ["a red circle on a blue background", "blurry"]
    today = np.concatenate([loaded.tokenize(t)[0] for t in texts])  # [2, 77] or [2, 2, 77]
    ids, weights = stack([tokenize_prompt(loaded.tokenizers, t) for t in texts])
    np.testing.assert_array_equal(ids[:, 0], today)
    plan = sd_plan(family, batch=2)
    extra = loaded.extra_inputs(plan, texts[0], "blurry")
    want = jax.jit(ENCODERS[family], static_argnums=(3, 4))(models, today, extra, plan, True)
    got = jax.jit(encode_prompts, static_argnums=(4, 5))(models, ids, weights, extra, plan, True)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


# --- SDXL ------------------------------------------------------------------------------------------


def tiny_sdxl(tmp_path_factory, words) -> tuple[StableDiffusionXLPipeline, object]:
    """A tiny SDXL pipeline (two CLIP encoders of widths 32 and 48, a tokenizer of `words`) and its saved folder."""
    tok_dir = tmp_path_factory.mktemp("sdxl-tokenizer")
    vocab = write_tokenizer(tok_dir, words)
    ids = dict(vocab_size=vocab, max_position_embeddings=77, bos_token_id=vocab - 2, eos_token_id=vocab - 1)
    first = CLIPTextConfig(**CLIP_LAYOUTS["sd1"], **ids, pad_token_id=vocab - 1)  # width 32, 3 layers
    second = CLIPTextConfig(**CLIP_LAYOUTS["sd2"], **ids, pad_token_id=0, projection_dim=24)  # width 48, 2 layers
    unet = dict(
        UNET_LAYOUTS["sdxl"],
        layers_per_block=1,
        cross_attention_dim=80,
        projection_class_embeddings_input_dim=24 + 6 * UNET_LAYOUTS["sdxl"]["addition_time_embed_dim"],
    )
    reference = StableDiffusionXLPipeline(
        vae=randomize(AutoencoderKL(**VAE_LAYOUT), 4, std=0.05),
        text_encoder=randomize(CLIPTextModel(first), 1),
        text_encoder_2=randomize(CLIPTextModelWithProjection(second), 2),
        tokenizer=CLIPTokenizer.from_pretrained(str(tok_dir)),
        tokenizer_2=CLIPTokenizer.from_pretrained(str(tok_dir), pad_token="!"),
        unet=randomize(UNet2DConditionModel(**unet), 3),
        scheduler=EulerDiscreteScheduler(),
        add_watermarker=False,
    )
    folder = tmp_path_factory.mktemp("sdxl")
    reference.save_pretrained(folder)
    return reference, folder


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    reference, folder = tiny_sdxl(tmp_path_factory, WORDS)
    loaded = load_model_folder(folder, "float32")
    return reference, loaded, nnx.merge(loaded.graphdef, loaded.params)


@pytest.mark.parametrize("prompt", PROMPTS.values(), ids=PROMPTS.keys())
def test_sdxl_conditioning_matches_transformers(sdxl, prompt):
    reference, loaded, models = sdxl
    tokenized = tokenize_prompt(loaded.tokenizers, prompt)
    negative = tokenize_prompt(loaded.tokenizers, "blurry photo")
    ids, weights = stack([tokenized, negative])
    plan = sd_plan("sdxl", batch=2)
    extra = loaded.extra_inputs(plan, "", "blurry photo")
    got = jax.jit(encode_prompts, static_argnums=(4, 5))(models, ids, weights, extra, plan, False)
    encoders = [reference.text_encoder, reference.text_encoder_2]
    want, pooled = reference_context(encoders, [PENULTIMATE] * 2, tokenized, with_pooled=True)
    assert got.context.shape == (2, 77 * tokenized.chunks, 80)
    assert rel_error(got.context[0], want) < TOL
    assert rel_error(got.text_embeds[0], pooled) < TOL  # the first chunk's
    np.testing.assert_array_equal(got.time_ids, extra["time_ids"])
    want_negative, _ = reference_context(encoders, [PENULTIMATE] * 2, negative.padded(tokenized.chunks))
    assert rel_error(got.context[1], want_negative) < TOL


def test_sdxl_no_negative_prompt_is_zeros_in_every_chunk(sdxl):
    _, loaded, models = sdxl
    prompt = tokenize_prompt(loaded.tokenizers, PROMPTS["long"])
    ids, weights = stack([prompt, tokenize_prompt(loaded.tokenizers, "")])
    plan = sd_plan("sdxl", batch=2)
    extra = loaded.extra_inputs(plan, "", None)  # no negative prompt: SDXL's zero embeddings
    got = jax.jit(encode_prompts, static_argnums=(4, 5))(models, ids, weights, extra, plan, True)
    assert np.all(np.asarray(got.context) == 0) and np.all(np.asarray(got.text_embeds) == 0)


# --- pictures ------------------------------------------------------------------------------------


def our_pictures(loaded, models, cond, uncond, latents: np.ndarray, steps: int, guidance: float) -> np.ndarray:
    """DDIM with guidance from public pieces (`schedulers`, the UNet, `decode`) on a given conditioning."""
    kind = "ddim"
    t = schedulers.tables(loaded.scheduler_config, kind, steps, steps)
    plan = Plan(batch=len(latents), latent_height=8, latent_width=8, scheduler=kind, max_steps=steps, guidance=True)
    context = jnp.concatenate([uncond.context, cond.context])  # [2 * batch, chunks * 77, width]

    @jax.jit
    def step(models, x, state, i):
        model_in = schedulers.scale_model_input(kind, t, i, x)
        timesteps = jnp.full((2 * x.shape[0],), schedulers.timestep(t, i))
        out = models.unet(jnp.concatenate([model_in, model_in]), timesteps, context)
        uncond_out, cond_out = jnp.split(out.astype(jnp.float32), 2)
        eps = uncond_out + guidance * (cond_out - uncond_out)
        return schedulers.step(kind, t, state, i, eps, x, jnp.zeros_like(x))  # DDIM at eta 0: no noise

    x = jnp.asarray(latents.transpose(0, 2, 3, 1)) * t.init_noise_sigma  # NHWC inside the engine
    state = schedulers.init_state(kind, x)
    for i in range(int(t.num_loop_steps)):
        x, state = step(models, x, state, i)
    return np.asarray(decode(plan, loaded.graphdef, loaded.params, x))


def test_pictures_from_a_long_emphasized_prompt_match_diffusers_given_the_reference_conditioning(sd1):
    """diffusers' pipeline on the transformers-and-A1111 conditioning (`prompt_embeds=`) draws what our UNet
    and VAE draw on ours: the chunks concatenated to 2 x 77 tokens are what the UNet attends to."""
    reference, loaded, models = sd1
    prompt = tokenize_prompt(loaded.tokenizers, PROMPTS["long emphasis"])
    negative = tokenize_prompt(loaded.tokenizers, "(blurry:1.3) photo")
    assert prompt.chunks == 2 and negative.chunks == 1
    plan = sd_plan()
    encode = jax.jit(encode_prompts, static_argnums=(4, 5))
    cond, uncond = (
        encode(models, *stack([p], chunks=2), {}, plan, neg) for p, neg in ((prompt, False), (negative, True))
    )
    latents = np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float32)
    got = our_pictures(loaded, models, cond, uncond, latents, steps=3, guidance=6.0)

    embeds = [reference_context([reference.text_encoder], [LAST], p.padded(2))[0] for p in (prompt, negative)]
    reference.scheduler = DDIMScheduler.from_config(reference.scheduler.config)
    with torch.no_grad():
        want = reference(
            prompt_embeds=torch.from_numpy(embeds[0])[None],
            negative_prompt_embeds=torch.from_numpy(embeds[1])[None],
            latents=torch.from_numpy(latents),
            num_inference_steps=3,
            guidance_scale=6.0,
            height=64,
            width=64,
            output_type="np",
        ).images
    assert got.shape == want.shape == (1, 64, 64, 3)
    assert np.abs(got - want).max() < 1e-2
    assert got.std() > 0.01  # a picture, not a constant that would match trivially

    # The engine, from the text: its batcher pads the negative prompt to the prompt's two chunks.
    engine = Engine(loaded, max_batch_size=1, previews=False)
    try:
        result = engine.generate(
            PROMPTS["long emphasis"],
            negative_prompt="(blurry:1.3) photo",
            scheduler="ddim",
            num_inference_steps=3,
            guidance_scale=6.0,
            height=64,
            width=64,
            latents=latents,
        )
        assert [p.chunks for p in engine.compiled_plans] == [2]
    finally:
        engine.close()
    assert np.abs(result.arrays - want).max() < 1e-2
    assert result.warnings == [f"prompt: {prompt.token_count} tokens, encoded in 2 chunks of 75"]
