"""SD3 and FLUX.1 through the rest of the engine: image modes, a tiny VAE, live previews, and the doors.

The tiny folders of tests/test_sd3.py and tests/test_flux.py (written with `save_pretrained`), as diffusers'
pipelines built from the same components and as our engine, in f32:
- image-to-image and inpainting against `StableDiffusion3Img2ImgPipeline`, `StableDiffusion3InpaintPipeline`,
  `FluxImg2ImgPipeline` and `FluxInpaintPipeline`, made deterministic as tests/test_image_modes.py makes the SD
  ones (the VAE's mean, our noise);
- a 16-channel `AutoencoderTiny` (TAESD3, TAEF1) in place of the KL VAE, against diffusers' pipeline with it
  swapped in, and its decoded pictures as the live previews;
- the fitted latent-to-RGB previews of the 16-channel KL VAE;
- AUTOMATIC1111's and OpenAI's doors over an SD3 and a FLUX.1-dev engine: "Euler" is the flow model's own Euler.
"""

from __future__ import annotations

import base64
import contextlib
import json
from unittest import mock

import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderTiny,
    FluxImg2ImgPipeline,
    FluxInpaintPipeline,
    FluxPipeline,
    StableDiffusion3Img2ImgPipeline,
    StableDiffusion3InpaintPipeline,
    StableDiffusion3Pipeline,
)
from fastapi.testclient import TestClient
from PIL import Image
from reference import randomize
from test_flux import build_reference as build_flux
from test_image_modes import mask, picture
from test_sd3 import build_reference as build_sd3

import web
from engine import Cancelled, Finished, GenerationRequest, Preview, Progress, load_pipeline
from engine.compat.pnginfo import png_info
from engine.sampling.preview import DecodedPreview, PreviewMap
from tests._api_server import b64png, decode_png, max_pixel_difference
from web.handlers import FORM_FIELDS, read_png_info
from web.pictures import ClientFiles

PROMPT, NEGATIVE = "a red circle on a blue background", "blurry photo"
SIZE = 32  # pixels: 16x16 latents with the factor-2 test VAEs, 8x8 tokens of 2x2 patches
LATENT = SIZE // 2
IMAGE_TOLERANCE = 1e-2  # as tests/test_image_modes.py: the VAE's encoder runs too
TOLERANCE = 1 / 255


def noise(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 16, LATENT, LATENT)).astype(np.float32)


def served(reference, name: str, tmp_path_factory):
    """diffusers' pipeline, our engine on the folder it writes, and the folder; the engine closed afterwards."""
    folder = tmp_path_factory.mktemp(name)
    reference.save_pretrained(folder)
    ours = load_pipeline(folder, safety_checker=False, preview_every_s=0.0)
    yield reference, ours, folder
    ours.close()


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    """The tiny SD3 folder (with T5) as diffusers' text-to-image pipeline, our engine, and the folder."""
    yield from served(build_sd3("sd3", tmp_path_factory), "sd3", tmp_path_factory)


# -- image-to-image and inpainting -------------------------------------------------------------------------

PIPELINES = {  # family -> (image-to-image, inpainting) pipelines of diffusers and the module each is defined in
    "sd3": (StableDiffusion3Img2ImgPipeline, StableDiffusion3InpaintPipeline),
    "flux": (FluxImg2ImgPipeline, FluxInpaintPipeline),
}
MODULES = {pipeline: pipeline.__module__ for pipelines in PIPELINES.values() for pipeline in pipelines}
IMAGE_ARGS = {  # SD3 guided by a second row, FLUX.1-dev by its embedded scale (it takes no negative prompt)
    "sd3": dict(prompt=PROMPT, negative_prompt=NEGATIVE, guidance_scale=5.0, num_inference_steps=10),
    "flux": dict(prompt=PROMPT, guidance_scale=3.5, num_inference_steps=10),
}


def run_image_mode(reference, start: np.ndarray, **kwargs) -> np.ndarray:
    """diffusers with the VAE's mean (KL) or its latents (tiny) for `retrieve_latents`, and our noise.

    `StableDiffusion3InpaintPipeline` (diffusers 0.42) decodes `latents / scaling_factor` without adding the VAE's
    `shift_factor` back, unlike every other SD3 pipeline and its own encoder (diffusers issue #13611, "Issue 1";
    PR #14671): we take its latents and decode them as `StableDiffusion3Pipeline` does, which our engine does too.
    """
    module = MODULES[type(reference)]
    unshifted = isinstance(reference, StableDiffusion3InpaintPipeline)

    def latents_of(out, generator=None, sample_mode="sample"):
        return out.latents if hasattr(out, "latents") else out.latent_dist.mode()

    given = lambda shape, **_: torch.from_numpy(start).reshape(shape)  # noqa: E731
    with contextlib.ExitStack() as stack, torch.no_grad():
        stack.enter_context(mock.patch(f"{module}.retrieve_latents", side_effect=latents_of))
        stack.enter_context(mock.patch(f"{module}.randn_tensor", side_effect=given))
        out = reference(
            num_images_per_prompt=len(start), height=SIZE, width=SIZE, output_type="latent" if unshifted else "np",
            **kwargs,
        ).images  # fmt: skip
        if not unshifted:
            return out
        vae = reference.vae
        image = vae.decode(out / vae.config.scaling_factor + vae.config.shift_factor, return_dict=False)[0]
        return reference.image_processor.postprocess(image, output_type="np")


def compare_image_mode(ours, reference, start: np.ndarray, **kwargs) -> float:
    want = run_image_mode(reference, start, **kwargs)
    got = ours.generate(num_images=len(start), latents=start, height=SIZE, width=SIZE, **kwargs).arrays
    assert got.shape == want.shape
    assert want.std() > 0.02  # a picture, not a flat field that any mistake would still match
    return float(np.abs(got - want).max())


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_img2img_matches_diffusers_and_strength_never_compiles(family, request):
    """10 steps: strength 0.6 starts at step int(10 - 6.000000000000001) = 3 (not 4), 0.9 at step 1, as
    `StableDiffusion3Img2ImgPipeline.get_timesteps` (and FLUX's) count them; `scale_noise` at that sigma. One
    difference stays: a strength under 1/steps is refused (`Limits` counts as the SD pipelines do), where these
    pipelines would still run the last step."""
    base, ours, _ = request.getfixturevalue(family)
    reference = PIPELINES[family][0](**base.components)
    errors = []
    for k, strength in enumerate((0.6, 0.9)):
        before = ours.compile_count
        start = noise(2, seed=k)
        args = dict(IMAGE_ARGS[family], image=picture(SIZE), strength=strength)
        errors.append(compare_image_mode(ours, reference, start, **args))
    assert ours.compile_count == before  # the second strength ran the first one's programs
    assert max(errors) < IMAGE_TOLERANCE, errors
    # Two pictures, the comparisons' batch: their programs draw it, where one picture compiled a plan of its own.
    result = ours.generate(image=picture(SIZE), num_images=2, **{**IMAGE_ARGS[family], "num_inference_steps": 2})
    assert result.request.strength == 0.6  # StableDiffusion3Img2ImgPipeline's and FluxImg2ImgPipeline's default


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_inpainting_matches_diffusers(family, request):
    """The inpainting pipelines with the 16-channel transformer blend the kept part after each step: the picture's
    latents noised to the next step's sigma (`scale_noise`), the clean latents after the last; the mask is binarised
    at 0.5 and resized to the latents' size by nearest neighbour, as ours."""
    base, ours, _ = request.getfixturevalue(family)
    reference = PIPELINES[family][1](**base.components)
    args = dict(IMAGE_ARGS[family], num_inference_steps=4, image=picture(SIZE), mask_image=mask(SIZE))
    errors = []
    for strength in (1.0, 0.6):  # 1: pure noise to start, as diffusers' inpainting does; 0.6: the picture noised
        before = ours.compile_count
        errors.append(compare_image_mode(ours, reference, noise(2, seed=3), strength=strength, **args))
    assert ours.compile_count == before
    assert max(errors) < IMAGE_TOLERANCE, errors


# -- a tiny VAE (TAESD3, TAEF1) in place of the KL VAE -----------------------------------------------------

# A factor-2 `AutoencoderTiny` (two levels) to match the test folders' KL VAE, 16 latent channels, SiLU.
TINY_VAE = dict(
    encoder_block_out_channels=(8, 8),
    decoder_block_out_channels=(8, 8),
    num_encoder_blocks=(1, 2),
    num_decoder_blocks=(2, 1),
    latent_channels=16,
    act_fn="silu",
)
TINY_SCALING = {  # the families' own latent scale and shift, which TAESD3 and TAEF1 decode from
    "sd3": dict(scaling_factor=1.5305, shift_factor=0.0609),  # madebyollin/taesd3's config.json
    "flux": dict(scaling_factor=0.3611, shift_factor=0.1159),
}
TXT2IMG_ARGS = {  # 3 steps each; SD3 guided by a second row, FLUX.1-dev by its embedded scale
    "sd3": dict(negative_prompt=NEGATIVE, guidance_scale=5.0, num_inference_steps=3),
    "flux": dict(guidance_scale=3.5, num_inference_steps=3),
}


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    """The tiny FLUX.1-dev folder as diffusers' `FluxPipeline`, our engine, and the folder."""
    yield from served(build_flux("dev", tmp_path_factory), "flux-dev", tmp_path_factory)


@pytest.fixture(scope="module")
def tiny(request, tmp_path_factory):
    """Per family: diffusers' pipeline with a tiny VAE swapped in, and our engine given that VAE's folder."""
    cache = {}

    def get(family: str):
        if family not in cache:
            base, _, folder = request.getfixturevalue(family)
            where = tmp_path_factory.mktemp(f"tae-{family}")
            randomize(AutoencoderTiny(**TINY_VAE, **TINY_SCALING[family]), 11).save_pretrained(where)
            pipeline = StableDiffusion3Pipeline if family == "sd3" else FluxPipeline
            reference = pipeline(**{**base.components, "vae": AutoencoderTiny.from_pretrained(where)})
            ours = load_pipeline(folder, vae=str(where), safety_checker=False, preview_every_s=0.0)
            cache[family] = reference, ours
        return cache[family]

    yield get
    for _, ours in cache.values():
        ours.close()


def run_reference(family: str, reference, start: np.ndarray, **kwargs) -> np.ndarray:
    """diffusers' text-to-image from our NCHW latents (FluxPipeline takes them packed in 2x2 patches)."""
    n, c, h, w = start.shape
    latents = torch.from_numpy(start)
    if family == "flux":
        latents = FluxPipeline._pack_latents(latents, n, c, h, w)
    else:
        kwargs["num_images_per_prompt"] = n
    with torch.no_grad():
        return reference(prompt=PROMPT, latents=latents, height=SIZE, width=SIZE, output_type="np", **kwargs).images


def step_latents(family: str, reference, start: np.ndarray, **kwargs) -> dict[int, torch.Tensor]:
    """The latents after each step (1-based), as diffusers' step callback sees them, NCHW and unpacked."""
    seen = {}

    def callback(pipe, i, t, values):
        latents = values["latents"]
        if family == "flux":
            latents = pipe._unpack_latents(latents, SIZE, SIZE, pipe.vae_scale_factor)
        seen[i + 1] = latents.clone()
        return {}

    run_reference(family, reference, start, callback_on_step_end=callback, **kwargs)
    return seen


def previews_by_step(ours, start: np.ndarray, **kwargs) -> tuple[dict[int, np.ndarray], list]:
    """Our request's previews, keyed by the step they follow, and all its events."""
    request = GenerationRequest(PROMPT, latents=start, num_images=len(start), height=SIZE, width=SIZE, **kwargs)
    events, previews, step = [], {}, 0
    for event in ours.submit(request).events(timeout=300):
        events.append(event)
        if isinstance(event, Progress):
            step = event.step
        elif isinstance(event, Preview):
            previews[step] = event.images[0]
    return previews, events


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_a_tiny_vae_draws_what_diffusers_draws_with_it(family, tiny):
    """`load_pipeline(folder, vae=<AutoencoderTiny folder>)` against diffusers' pipeline with `vae=AutoencoderTiny`:
    both decode `latents / scaling_factor + shift_factor`, and our previews are the tiny VAE's own pictures."""
    reference, ours = tiny(family)
    assert ours.model.tiny_vae and ours.model.vae_config.shift_factor == TINY_SCALING[family]["shift_factor"]
    start = noise(2, seed=4)
    want = run_reference(family, reference, start, **TXT2IMG_ARGS[family])
    got = ours.generate(PROMPT, num_images=2, latents=start, height=SIZE, width=SIZE, **TXT2IMG_ARGS[family]).arrays
    assert want.std() > 0.02  # a picture, not a flat field that any mistake would still match
    error = float(np.abs(got - want).max())
    assert error < TOLERANCE, error

    assert isinstance(ours.preview, DecodedPreview)
    one = start[:1]
    seen = step_latents(family, reference, one, **TXT2IMG_ARGS[family])
    previews, _ = previews_by_step(ours, one, **TXT2IMG_ARGS[family])
    steps = TXT2IMG_ARGS[family]["num_inference_steps"]
    assert sorted(previews) == list(range(1, steps))  # after every step but the last, which is the picture
    vae = reference.vae
    for i, got in previews.items():
        with torch.no_grad():
            image = vae.decode(seen[i] / vae.config.scaling_factor + vae.config.shift_factor).sample
        want = np.round(reference.image_processor.postprocess(image, output_type="np")[0] * 255)
        assert got.shape == (SIZE, SIZE, 3) and got.dtype == np.uint8  # full size, not latent size
        assert np.abs(got.astype(np.float32) - want).max() <= 1, f"step {i}"


# -- live previews with the KL VAE: the fitted latent-to-RGB map --------------------------------------------


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_kl_previews_are_the_fitted_map_of_each_steps_latents(family, request):
    reference, ours, _ = request.getfixturevalue(family)
    preview = ours.preview  # waits for the fit that started at load
    assert isinstance(preview, PreviewMap) and preview.weight.shape == (16, 3)
    assert np.isfinite(preview.fit_error) and preview.fit_error < 0.2  # RMS in 0..1: a rough picture, a preview
    args = dict(TXT2IMG_ARGS[family], num_inference_steps=4)
    start = noise(1, seed=5)
    previews, events = previews_by_step(ours, start, **args)
    assert isinstance(events[-1], Finished)
    assert sorted(previews) == [1, 2, 3]
    seen = step_latents(family, reference, start, **args)
    for i, got in previews.items():
        assert got.shape == (LATENT, LATENT, 3) and got.dtype == np.uint8  # latent size: one pixel per latent
        want = preview(seen[i][0].numpy().transpose(1, 2, 0)).astype(np.int16)
        assert np.abs(got.astype(np.int16) - want).max() <= 1, f"step {i}"


# -- the doors: AUTOMATIC1111's /sdapi/v1 and OpenAI's /v1/images over a flow model -------------------------


@pytest.fixture(scope="module")
def door(request):
    """Per family: our engine and a TestClient of the whole web app over it."""
    cache, stack = {}, contextlib.ExitStack()

    def get(family: str):
        if family not in cache:
            _, ours, _ = request.getfixturevalue(family)
            cache[family] = ours, stack.enter_context(TestClient(web.build_app(ours)))
        return cache[family]

    with stack:
        yield get


def drawn(ours, **values) -> Image.Image:
    """The engine's own picture for the values a door was sent."""
    fields = dict(prompt=PROMPT, width=SIZE, height=SIZE, scheduler="flow_euler")
    return ours.submit(GenerationRequest(**{**fields, **values})).result(timeout=300).images[0]


@pytest.mark.parametrize(("family", "cfg"), [("sd3", 5.0), ("flux", 3.5)])
def test_a1111_euler_is_the_flow_models_own_euler(family, cfg, door, tmp_path):
    ours, client = door(family)
    samplers = client.get("/sdapi/v1/samplers").json()
    assert [s["name"] for s in samplers] == ["Euler"]
    body = dict(prompt=PROMPT, seed=5, steps=2, cfg_scale=cfg, width=SIZE, height=SIZE, sampler_name="Euler")
    answer = client.post("/sdapi/v1/txt2img", json=body)
    assert answer.status_code == 200, answer.text
    image = decode_png(answer.json()["images"][0])
    want = drawn(ours, seed=5, num_inference_steps=2, guidance_scale=cfg, negative_prompt="")
    assert max_pixel_difference(image, want) == 0
    info = json.loads(answer.json()["info"])
    assert (info["sampler_name"], info["scheduler"]) == ("Euler", "Uniform")

    params = png_info(image)  # the picture's own recipe reads back, as A1111 wrote it
    assert "Sampler: Euler," in image.info["parameters"] and params.sampler == "Euler"
    assert (params.seed, params.width, params.guidance_scale) == (5, SIZE, cfg)
    path = tmp_path / "dropped.png"
    path.write_bytes(base64.b64decode(answer.json()["images"][0]))
    dropped = read_png_info(ours, str(path), ClientFiles(SIZE * SIZE, upload_folder=tmp_path))  # the page's drop
    form = dict(zip(FORM_FIELDS, dropped, strict=False))
    assert form["scheduler"] == "flow_euler" and form["seed"] == 5 and form["steps"] == 2

    refused = client.post("/sdapi/v1/txt2img", json={**body, "sampler_name": "DPM++ 2M"})
    assert refused.status_code == 422
    assert "unknown sampler 'DPM++ 2M'; this server offers: Euler" in refused.json()["detail"]


@pytest.mark.parametrize(("family", "cfg"), [("sd3", 5.0), ("flux", 3.5)])
def test_openai_generations_draw_the_engines_picture(family, cfg, door):
    ours, client = door(family)
    body = dict(prompt=PROMPT, size=f"{SIZE}x{SIZE}", seed=7, num_inference_steps=2, guidance_scale=cfg)
    answer = client.post("/v1/images/generations", json=body)
    assert answer.status_code == 200, answer.text
    image = decode_png(answer.json()["data"][0]["b64_json"])
    assert max_pixel_difference(image, drawn(ours, seed=7, num_inference_steps=2, guidance_scale=cfg)) == 0
    assert png_info(image).sampler == "Euler"
    assert client.post("/v1/images/generations", json={**body, "scheduler": "Euler"}).status_code == 200


def test_sd3_img2img_through_a1111_is_the_engines(door):
    ours, client = door("sd3")
    start = picture(SIZE)
    body = dict(prompt=PROMPT, seed=9, steps=5, cfg_scale=5.0, width=SIZE, height=SIZE, sampler_name="Euler")
    answer = client.post("/sdapi/v1/img2img", json={**body, "init_images": [b64png(start)], "denoising_strength": 0.6})
    assert answer.status_code == 200, answer.text
    want = drawn(ours, seed=9, num_inference_steps=5, guidance_scale=5.0, negative_prompt="", image=start, strength=0.6)
    assert max_pixel_difference(decode_png(answer.json()["images"][0]), want) == 0


def test_clip_skip_on_flux_is_refused_by_name(door):
    _, client = door("flux")
    body = dict(prompt=PROMPT, steps=1, width=SIZE, height=SIZE, sampler_name="Euler")
    for change in ({"clip_skip": 2}, {"override_settings": {"CLIP_stop_at_last_layers": 2}}):
        answer = client.post("/sdapi/v1/txt2img", json={**body, **change})
        assert answer.status_code == 422, answer.text
        assert "clip_skip must be 0: this model skips no text encoder layers" in answer.json()["detail"]
    answer = client.post("/v1/images/generations", json=dict(prompt=PROMPT, size=f"{SIZE}x{SIZE}", clip_skip=1))
    assert 400 <= answer.status_code < 500 and "clip_skip" in answer.text, answer.text


def test_stop_ends_an_sd3_request_early(sd3):
    _, ours, _ = sd3
    steps = ours.max_steps
    ticket = ours.submit(GenerationRequest(PROMPT, num_inference_steps=steps, height=SIZE, width=SIZE, seed=3))
    reached = 0
    for event in ticket.events(timeout=300):
        if isinstance(event, Progress):
            reached = event.step
            if reached >= 2:
                ticket.cancel()
    with pytest.raises(Cancelled):
        ticket.result(60)
    assert reached < steps, reached
    assert drawn(ours, seed=3, num_inference_steps=2).size == (SIZE, SIZE)  # and the engine serves on
