"""Hires fix equals diffusers doing A1111's two passes on the same tiny SD 1.x folder and the same noise.

The first pass is `StableDiffusionPipeline(output_type="latent")`; a latent upscaler resizes its latents with torch's
`interpolate` in the mode A1111 names (`Latent`: bilinear), a picture upscaler resizes its decoded picture (Lanczos);
the second pass is `StableDiffusionImg2ImgPipeline` from those latents (4 channels: taken as they are) or that
picture, at `strength`, with the fresh noise our engine draws from each picture's seed at the larger size. Max abs
pixel difference < 1e-2 on 0..1, in f32, as tests/test_image_modes.py holds image to image.
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import jax
import numpy as np
import pytest
import tiny_pipeline
import torch
from diffusers import EulerDiscreteScheduler, StableDiffusionImg2ImgPipeline
from PIL import Image

import engine
from engine import InvalidRequest, load_pipeline
from engine.compat.pnginfo import GenerationParameters, format_parameters, parse_parameters
from engine.sampling.hires import LATENT_UPSCALERS, upscale_latents
from engine.sampling.pipeline import initial_latents
from engine.serving.hires import first_pass, second_passes

PROMPT, NEGATIVE = "a red circle on a blue background", "blurry photo"
ARGS = dict(prompt=PROMPT, negative_prompt=NEGATIVE, guidance_scale=6.0, num_inference_steps=4, scheduler="euler")
SIDE, TOLERANCE = 64, 1e-2
IMG2IMG = "diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img"


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sd1-hires")
    base = tiny_pipeline.write("sd1", folder)
    base.scheduler = EulerDiscreteScheduler.from_config(base.scheduler.config)
    return base, StableDiffusionImg2ImgPipeline(**base.components), load_pipeline(folder, sizes=None)


def our_noise(seeds: list[int], side: int) -> np.ndarray:
    """The noise the engine draws for these seeds at this size, NCHW as diffusers takes it."""
    noise = initial_latents(jax.numpy.asarray(seeds, jax.numpy.uint32), (side // 8, side // 8, 4))
    return np.asarray(noise).transpose(0, 3, 1, 2)


def reference(sd1, start: np.ndarray, seeds: list[int], upscaler: str, strength: float) -> np.ndarray:
    """diffusers' two passes, as A1111's hires fix runs them."""
    base, img2img, _ = sd1
    mean = lambda out, generator=None, sample_mode="sample": out.latent_dist.mode()  # noqa: E731
    with torch.no_grad():
        first = base(num_images_per_prompt=len(start), latents=torch.from_numpy(start), output_type="latent", **ARGS)
        if upscaler in LATENT_UPSCALERS:
            mode, antialias = LATENT_UPSCALERS[upscaler]
            images = torch.nn.functional.interpolate(first.images, scale_factor=2, mode=mode, antialias=antialias)
        else:
            decoded = base.vae.decode(first.images / base.vae.config.scaling_factor).sample
            pictures = base.image_processor.postprocess(decoded, output_type="pil")
            images = [picture.resize((2 * SIDE, 2 * SIDE), resample=3) for picture in pictures]  # Lanczos
    out = []
    for k, seed in enumerate(seeds):
        given = lambda shape, seed=seed, **_: torch.from_numpy(our_noise([seed], 2 * SIDE)).reshape(shape)  # noqa: E731
        with contextlib.ExitStack() as stack, torch.no_grad():
            stack.enter_context(mock.patch(f"{IMG2IMG}.retrieve_latents", side_effect=mean))
            stack.enter_context(mock.patch(f"{IMG2IMG}.randn_tensor", side_effect=given))
            image = images[k : k + 1] if torch.is_tensor(images) else images[k]
            out.append(img2img(image=image, strength=strength, output_type="np", **ARGS).images[0])
    return np.stack(out)


@pytest.mark.parametrize(("upscaler", "strength"), [("Latent", 0.6), ("Lanczos", 0.5)])
def test_hires_fix_equals_diffusers_two_passes(sd1, upscaler, strength):
    ours = sd1[2]
    start = np.random.default_rng(3).standard_normal((2, 4, SIDE // 8, SIDE // 8)).astype(np.float32)
    seeds = [11, 12]
    steps = []
    result = ours.generate(
        num_images=2,
        seed=11,
        latents=start,
        width=SIDE,
        height=SIDE,
        hires_scale=2.0,
        hires_upscaler=upscaler,
        strength=strength,
        progress=lambda step, total: steps.append((step, total)),
        **ARGS,
    )
    want = reference(sd1, start, seeds, upscaler, strength)
    assert result.arrays.shape == want.shape == (2, 2 * SIDE, 2 * SIDE, 3)
    assert result.arrays.std() > 0.01 and result.seeds == seeds
    assert float(np.abs(result.arrays - want).max()) < TOLERANCE
    second = int(ARGS["num_inference_steps"] * strength)
    assert steps[-1] == (4 + second, 4 + second) and [s for s, _ in steps] == sorted(s for s, _ in steps)
    assert result.request.hires_scale == 2.0 and result.request.strength == strength


@pytest.mark.parametrize("name", list(LATENT_UPSCALERS))
def test_latent_upscalers_equal_torchs_interpolate(name):
    mode, antialias = LATENT_UPSCALERS[name]
    latents = np.random.default_rng(0).standard_normal((2, 8, 12, 4)).astype(np.float32)
    for height, width in ((16, 24), (13, 17), (20, 30)):
        ours = upscale_latents(latents, height, width, name)
        options = {} if mode.startswith("nearest") else {"align_corners": False}
        nchw = torch.from_numpy(latents).permute(0, 3, 1, 2)
        want = torch.nn.functional.interpolate(nchw, size=(height, width), mode=mode, antialias=antialias, **options)
        np.testing.assert_allclose(ours, want.permute(0, 2, 3, 1).numpy(), atol=1e-5)


def test_hires_fix_is_refused_by_name_where_it_cannot_run(sd1):
    ours = sd1[2]
    cases = [
        (dict(hires_scale=9.0), "hires_scale must be 0 (off) or a number from 1 to 4"),
        (dict(hires_scale=2.0, hires_upscaler="4x-Magic"), "unknown upscaler '4x-Magic'; this server offers: Latent"),
        (dict(hires_scale=2.0, width=64, height=64, hires_width=4096), "the hires pass's height must be a multiple"),
    ]
    for fields, message in cases:
        with pytest.raises(InvalidRequest, match=message.replace("(", r"\(").replace(")", r"\)")):
            ours.submit(engine.GenerationRequest(PROMPT, **fields))
    limits = dataclasses.replace(ours.limits, sizes=((64, 64),))
    with pytest.raises(InvalidRequest, match="the hires pass's size 128x128 is not offered here; choose one of 64x64"):
        limits.resolve(engine.GenerationRequest(PROMPT, hires_scale=2.0, width=64, height=64), ours.defaults)
    with pytest.raises(InvalidRequest, match="hires fix follows text to image only"):
        ours.submit(engine.GenerationRequest(PROMPT, hires_scale=2.0, image_latents=np.zeros((1, 8, 8, 4))))


def a1111_cut(latents: torch.Tensor, width: int, height: int, target_w: int, target_h: int) -> torch.Tensor:
    """A1111's hires fix with hr_resize_x and hr_resize_y both given (`calculate_target_resolution`, then the cut
    in `sample_hr_pass`), on NCHW latents of a width x height first pass, with the `Latent` upscaler."""
    if width / height < target_w / target_h:
        upscale_to_x, upscale_to_y = target_w, target_w * height // width
    else:
        upscale_to_x, upscale_to_y = target_h * width // height, target_h
    truncate_x, truncate_y = (upscale_to_x - target_w) // 8, (upscale_to_y - target_h) // 8
    samples = torch.nn.functional.interpolate(latents, size=(upscale_to_y // 8, upscale_to_x // 8), mode="bilinear")
    return samples[
        :,
        :,
        truncate_y // 2 : samples.shape[2] - (truncate_y + 1) // 2,
        truncate_x // 2 : samples.shape[3] - (truncate_x + 1) // 2,
    ]


def first_result(width: int, height: int, seeds: list[int]) -> engine.GenerationResult:
    latents = np.random.default_rng(5).standard_normal((len(seeds), height // 8, width // 8, 4)).astype(np.float32)
    pictures = [Image.fromarray(np.full((height, width, 3), 40 * k, np.uint8)) for k in range(len(seeds))]
    timings = dict.fromkeys(("queue_s", "compile_s", "run_s", "total_s"), 0.0)
    return engine.GenerationResult(pictures, seeds, ["cpu:0"] * len(seeds), timings, False, latents=latents)


@pytest.mark.parametrize(("size", "target"), [((64, 48), (96, 96)), ((64, 40), (72, 64)), ((48, 64), (88, 72))])
def test_both_hires_sides_cover_then_cut_as_a1111(size, target):
    width, height = size
    r = engine.GenerationRequest(
        **ARGS,
        width=width,
        height=height,
        num_images=2,
        seed=3,
        strength=0.5,
        hires_width=target[0],
        hires_height=target[1],
    )
    first = first_result(width, height, [3, 4])
    passes = second_passes(r, first, upscale=None)
    want = a1111_cut(torch.from_numpy(first.latents).permute(0, 3, 1, 2), width, height, *target)
    got = np.concatenate([p.image_latents for p in passes])
    assert got.shape == (2, target[1] // 8, target[0] // 8, 4)
    np.testing.assert_allclose(got, want.permute(0, 2, 3, 1).numpy(), atol=1e-5)
    assert [(p.width, p.height, p.seed) for p in passes] == [(*target, 3), (*target, 4)]


def test_a_picture_upscaler_covers_then_cuts_on_a1111s_latent_cells():
    r = engine.GenerationRequest(
        **ARGS,
        width=64,
        height=40,
        num_images=1,
        seed=3,
        strength=0.5,
        hires_width=72,
        hires_height=64,
        hires_upscaler="Lanczos",
    )
    asked = []

    def upscale(image, width, height, name):
        asked.append((width, height, name))
        ramp = np.tile(np.arange(width, dtype=np.uint8)[None, :, None], (height, 1, 3))
        return Image.fromarray(ramp)

    (second,) = second_passes(r, first_result(64, 40, [3]), upscale)
    assert asked == [(102, 64, "Lanczos")]  # 64 * 64 // 40 wide: it covers 72x64
    assert second.image.size == (72, 64)
    assert np.asarray(second.image)[0, 0, 0] == 8  # A1111 cuts (102 - 72) // 8 = 3 cells: 1 on the left


def test_the_second_pass_draws_with_its_own_sampler_prompts_and_strength():
    r = engine.GenerationRequest(
        **ARGS,
        width=64,
        height=64,
        num_images=1,
        seed=3,
        strength=0.5,
        hires_scale=2.0,
        hires_scheduler="ddim",
        hires_prompt="a blue square",
        hires_negative_prompt="",
    )
    (second,) = second_passes(r, first_result(64, 64, [3]), upscale=None)
    assert (second.scheduler, second.prompt, second.negative_prompt) == ("ddim", "a blue square", "")
    assert (first_pass(r).scheduler, first_pass(r).prompt) == ("euler", PROMPT)
    (plain,) = second_passes(
        dataclasses.replace(r, hires_scheduler=None, hires_prompt=None, hires_negative_prompt=None),
        first_result(64, 64, [3]),
        upscale=None,
    )
    assert (plain.scheduler, plain.prompt, plain.negative_prompt) == ("euler", PROMPT, NEGATIVE)  # the first pass's
    limits = engine.Limits(
        schedulers=("euler", "ddim"), side_multiple=8, max_side=256, max_clip_skip=0, devices=1, upscalers=("Latent",)
    )
    defaults = dict(num_inference_steps=4, guidance_scale=6.0, width=64, height=64, scheduler="euler")
    resolved = limits.resolve(engine.GenerationRequest(PROMPT, hires_scale=2.0, hires_strength=0.3), defaults)
    assert resolved.strength == 0.3  # the hires section's strength is the second pass's
    assert limits.resolve(engine.GenerationRequest(PROMPT, hires_scale=2.0), defaults).strength == 0.7
    for fields, message in (
        (dict(hires_scheduler="heun"), "unknown hires_scheduler 'heun'; choose one of euler, ddim"),
        (dict(hires_strength=0.0), "hires_strength must be a number above 0 and at most 1, got 0.0"),
        (dict(hires_prompt=7), "hires_prompt must be text"),
        (dict(hires_negative_prompt="x" * 3000), "hires_negative_prompt is too long (3000 characters"),
    ):
        with pytest.raises(InvalidRequest) as refused:
            limits.resolve(engine.GenerationRequest(PROMPT, hires_scale=2.0, **fields), defaults)
        assert message in str(refused.value)


def test_png_parameters_carry_the_second_pass_as_a1111_writes_it():
    r = engine.GenerationRequest(
        **ARGS,
        width=64,
        height=64,
        num_images=1,
        seed=3,
        strength=0.5,
        hires_scale=2.0,
        hires_upscaler="Latent",
        hires_scheduler="euler_a",
        hires_prompt="a blue square",
    )
    text = format_parameters(GenerationParameters.from_request(r, 3, "tiny"))
    assert "Hires sampler: Euler a, Hires prompt: a blue square" in text and "Hires upscale: 2" in text
    back = parse_parameters(text)
    assert (back.hires_scheduler, back.hires_prompt, back.hires_scale) == ("euler_a", "a blue square", 2.0)
    heun = parse_parameters(text.replace("Hires sampler: Euler a", "Hires sampler: Heun"))
    assert heun.hires_scheduler is None and heun.extra["Hires sampler"] == "Heun"  # one we lack: kept as written
