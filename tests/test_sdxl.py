"""SDXL and the Turbo models end to end: our engine on tiny diffusers folders written with `save_pretrained`.

The same prompt, negative prompt and initial latents through diffusers' `StableDiffusionXLPipeline`
and through `load_pipeline(folder).generate`: max abs pixel difference < 1e-2 on 0..1, in f32.
The two text encoders differ in width, depth and activation, and the second tokenizer pads with
"!" as SDXL's does, so that a swapped encoder, a wrong layer or a wrong pooled token shows.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import tiny_pipeline
import torch
from diffusers import (
    AutoencoderKL,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from flax import nnx
from multidevice import start_with_devices
from reference import CLIP_LAYOUTS, UNET_LAYOUTS, VAE_LAYOUT, randomize, rel_error
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from engine import InvalidRequest, load_pipeline
from engine.families import sdxl as sdxl_parts
from engine.families.sdxl import encode as encode_sdxl
from engine.sampling.pipeline import Plan
from tools.tiny_tokenizer import write_tokenizer

WORDS = ["a", "red", "circle", "on", "blue", "background", "photo", "blurry"]
PROMPT, NEGATIVE = "a red circle on a blue background", "blurry photo"
SIZE = 32  # pixels; 16x16 latents with the factor-2 test VAE
STEPS = 3
TOLERANCE = 1e-2
# stabilityai/stable-diffusion-xl-base-1.0's scheduler; sdxl-turbo's is the ancestral one, "trailing".
SDXL_SCHEDULER = dict(
    beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1, timestep_spacing="leading"
)


def build_reference(tokenizer_dir) -> StableDiffusionXLPipeline:
    vocab = write_tokenizer(tokenizer_dir, WORDS)
    ids = dict(vocab_size=vocab, max_position_embeddings=77, bos_token_id=vocab - 2, eos_token_id=vocab - 1)
    first = CLIPTextConfig(**CLIP_LAYOUTS["sd1"], **ids, pad_token_id=vocab - 1)  # width 32, 3 layers, quick_gelu
    second = CLIPTextConfig(**CLIP_LAYOUTS["sd2"], **ids, pad_token_id=0, projection_dim=24)  # 48, 2 layers, gelu
    unet = dict(
        UNET_LAYOUTS["sdxl"],
        layers_per_block=1,  # the full tiny layout has its own parity test; this one keeps compiling quick
        cross_attention_dim=first.hidden_size + second.hidden_size,
        projection_class_embeddings_input_dim=second.projection_dim
        + 6 * UNET_LAYOUTS["sdxl"]["addition_time_embed_dim"],
    )
    return StableDiffusionXLPipeline(
        vae=randomize(AutoencoderKL(**VAE_LAYOUT, scaling_factor=0.13025, force_upcast=True), 4, std=0.05),
        text_encoder=randomize(CLIPTextModel(first), 1),
        text_encoder_2=randomize(CLIPTextModelWithProjection(second), 2),
        tokenizer=CLIPTokenizer.from_pretrained(str(tokenizer_dir)),
        tokenizer_2=CLIPTokenizer.from_pretrained(str(tokenizer_dir), pad_token="!"),  # id 0, as SDXL's
        unet=randomize(UNet2DConditionModel(**unet), 3),
        scheduler=EulerDiscreteScheduler(**SDXL_SCHEDULER),
        add_watermarker=False,
    )


EIGHT_DEVICE_ARGS = dict(
    negative_prompt=NEGATIVE, num_inference_steps=STEPS, guidance_scale=5.0, height=SIZE, width=SIZE
)


@pytest.fixture(scope="session")
def sdxl_folder(tmp_path_factory):
    reference = build_reference(tmp_path_factory.mktemp("tokenizer"))
    folder = tmp_path_factory.mktemp("sdxl")
    reference.save_pretrained(folder)
    return reference, folder


@pytest.fixture(scope="session")
def eight_devices(sdxl_folder, tmp_path_factory):
    """8 images from 8 simulated devices, computed in another process while the other tests run."""
    out = tmp_path_factory.mktemp("eight")
    code = f"""
        import jax, numpy as np
        from engine import load_pipeline
        assert jax.device_count() == 8
        pipe = load_pipeline({str(sdxl_folder[1])!r})
        result = pipe.generate({PROMPT!r}, seed=11, num_images=8, **{EIGHT_DEVICE_ARGS!r})
        assert len(set(result.devices)) == 8
        np.save(OUT / "images.npy", result.arrays)
    """
    wait = start_with_devices(8, code, out)

    def images() -> np.ndarray:
        wait()
        return np.load(out / "images.npy")

    return images


@pytest.fixture(scope="session")
def sdxl(sdxl_folder, eight_devices):  # eight_devices: start that run first, to overlap with ours
    reference, folder = sdxl_folder
    return reference, load_pipeline(folder)


@pytest.fixture(scope="session")
def distilled(sdxl, tmp_path_factory):
    """The same networks as a Turbo folder: ancestral Euler, "trailing" spacing (and no "turbo" in the name)."""
    base, _ = sdxl
    scheduler = EulerAncestralDiscreteScheduler(**dict(SDXL_SCHEDULER, timestep_spacing="trailing"))
    reference = StableDiffusionXLPipeline(**{**base.components, "scheduler": scheduler}, add_watermarker=False)
    folder = tmp_path_factory.mktemp("distilled")
    reference.save_pretrained(folder)
    return reference, load_pipeline(folder)


def latents(n: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 4, SIZE // 2, SIZE // 2)).astype(np.float32)


def run_reference(reference, start, **kwargs) -> np.ndarray:
    with torch.no_grad():
        return reference(
            latents=torch.from_numpy(start),
            num_images_per_prompt=len(start),
            height=SIZE,
            width=SIZE,
            output_type="np",
            **kwargs,
        ).images


def run_ours(ours, start, **kwargs) -> np.ndarray:
    return ours.generate(height=SIZE, width=SIZE, num_images=len(start), latents=start, **kwargs).arrays


def test_defaults_follow_the_family(sdxl, distilled):
    ours, turbo = sdxl[1], distilled[1]
    assert (ours.family, ours.label) == ("sdxl", "Stable Diffusion XL")
    side = 16 * 2  # the UNet's sample_size times the VAE factor, as for SDXL's 128 * 8 = 1024
    want = {"height": side, "width": side, "num_inference_steps": 25, "guidance_scale": 5.0, "scheduler": "euler"}
    assert ours.defaults == want
    assert (turbo.family, turbo.label) == ("sdxl", "Stable Diffusion XL Turbo")
    assert turbo.defaults == {**want, "num_inference_steps": 1, "guidance_scale": 0.0, "scheduler": "euler_a"}


def test_text_encoding_matches_diffusers(sdxl):
    reference, ours = sdxl
    with torch.no_grad():
        want, want_neg, want_pooled, want_neg_pooled = reference.encode_prompt(
            PROMPT, negative_prompt=NEGATIVE, device="cpu", do_classifier_free_guidance=True
        )
    models = nnx.merge(ours.model.graphdef, ours.params)
    plan = Plan(1, SIZE // 2, SIZE // 2, "euler", 4, True, "sdxl")
    extra = ours.model.extra_inputs(plan, PROMPT, NEGATIVE)
    np.testing.assert_array_equal(extra["time_ids"], [[SIZE, SIZE, 0, 0, SIZE, SIZE]])
    for text, ctx, pooled, negative in (
        (PROMPT, want, want_pooled, False),
        (NEGATIVE, want_neg, want_neg_pooled, True),
    ):
        got = encode_sdxl(models, ours.model.tokenize(text)[0], extra, plan, negative)
        assert got.context.shape == (1, 77, 32 + 48)
        assert rel_error(got.context, ctx) < 1e-4
        assert rel_error(got.text_embeds, pooled) < 1e-4


@pytest.mark.parametrize(("guidance", "negative"), [(0.0, None), (5.0, None), (5.0, ""), (5.0, NEGATIVE)])
def test_images_match_diffusers(sdxl, guidance, negative):
    reference, ours = sdxl
    start = latents()
    # As diffusers: no negative prompt (None) means zero embeddings (force_zeros_for_empty_prompt); "" is text.
    want = run_reference(
        reference,
        start,
        prompt=PROMPT,
        negative_prompt=negative,
        guidance_scale=guidance,
        num_inference_steps=STEPS,
    )
    got = run_ours(
        ours, start, prompt=PROMPT, negative_prompt=negative, guidance_scale=guidance, num_inference_steps=STEPS
    )
    assert got.shape == want.shape == (2, SIZE, SIZE, 3)
    assert np.abs(got - want).max() < TOLERANCE
    assert got.std() > 0.01  # a picture, not a constant that would match trivially


def test_empty_negative_prompt_is_encoded_when_the_folder_says_so(sdxl, monkeypatch):
    reference, ours = sdxl
    start = latents(seed=1)
    args = dict(prompt=PROMPT, guidance_scale=5.0, num_inference_steps=STEPS)
    zeroed = run_ours(ours, start, **args)
    force_zeros = functools.partial(sdxl_parts.extra_inputs, vae_scale_factor=2, force_zeros=False)
    monkeypatch.setattr(ours.model, "extra_inputs", force_zeros)  # a traced input: no recompilation
    got = run_ours(ours, start, **args)
    reference.register_to_config(force_zeros_for_empty_prompt=False)
    try:
        want = run_reference(reference, start, **args)
    finally:
        reference.register_to_config(force_zeros_for_empty_prompt=True)
    assert np.abs(got - want).max() < TOLERANCE
    assert np.abs(got - zeroed).max() > 10 * TOLERANCE  # the flag changes the picture


def test_clip_skip_matches_diffusers(sdxl):
    reference, ours = sdxl
    start = latents(seed=2)
    args = dict(prompt=PROMPT, guidance_scale=0.0, num_inference_steps=STEPS)
    got = run_ours(ours, start, clip_skip=1, **args)
    want = run_reference(reference, start, clip_skip=1, **args)
    assert np.abs(got - want).max() < TOLERANCE
    assert np.abs(got - run_reference(reference, start, **args)).max() > 10 * TOLERANCE
    with pytest.raises(InvalidRequest, match="clip_skip"):
        ours.generate(PROMPT, clip_skip=2)  # the second encoder has two layers


def test_turbo_runs_one_step_without_guidance(distilled):
    reference, ours = distilled
    start = latents(seed=3)
    got = ours.generate(PROMPT, num_images=2, latents=start).arrays  # the folder's defaults: 1 step, guidance 0
    want = run_reference(reference, start, prompt=PROMPT, num_inference_steps=1, guidance_scale=0.0)
    assert np.abs(got - want).max() < TOLERANCE
    assert [plan.guidance for plan in ours.compiled_plans] == [False]  # one UNet batch: no unconditional half


def test_sd_turbo_folder_gets_turbo_defaults(tmp_path):
    tiny_pipeline.write("turbo", tmp_path)  # SD 2.x layout, Euler with "trailing" spacing
    ours = load_pipeline(tmp_path)
    assert (ours.family, ours.label) == ("sd", "Stable Diffusion Turbo")
    assert ours.defaults == {
        **dict(height=64, width=64, scheduler="euler"),
        **dict(num_inference_steps=1, guidance_scale=0.0),
    }


def test_eight_devices_give_the_images_of_one(sdxl, eight_devices):
    reference, ours = sdxl
    # One device, two images at a time: image k of seed s is the image of seed s + k.
    one = [ours.generate(PROMPT, seed=11 + k, num_images=2, **EIGHT_DEVICE_ARGS).arrays for k in range(0, 8, 2)]
    one = np.concatenate(one)
    eight = eight_devices()
    assert eight.shape == one.shape == (8, SIZE, SIZE, 3)
    assert np.abs(eight - one).max() < 1e-4
