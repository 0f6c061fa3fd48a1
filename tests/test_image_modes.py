"""Image-to-image and inpainting equal diffusers' PyTorch pipelines on the same tiny folders and the same noise.

`StableDiffusionImg2ImgPipeline`, `StableDiffusionXLImg2ImgPipeline` and `StableDiffusionInpaintPipeline`
(with a 9-channel inpainting UNet, and with an ordinary 4-channel UNet, which that pipeline blends) against
`load_pipeline(folder).generate(image=..., mask_image=..., strength=...)`: max abs pixel difference < 1e-2 on
0..1, in f32. Two changes make diffusers deterministic where it draws at random: its VAE encodes to the
posterior's mean (`retrieve_latents` patched to sample_mode="argmax", which our engine always uses), and its
`randn_tensor` returns the noise we pass as `latents=`.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import numpy as np
import pytest
import tiny_pipeline
import torch
from diffusers import (
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    PNDMScheduler,
    StableDiffusionImg2ImgPipeline,
    StableDiffusionInpaintPipeline,
    StableDiffusionXLImg2ImgPipeline,
    UNet2DConditionModel,
)
from PIL import Image, ImageDraw
from reference import UNET_LAYOUTS, randomize
from test_sdxl import build_reference as build_sdxl

from engine import InvalidRequest, load_pipeline

PROMPT, NEGATIVE = "a red circle on a blue background", "blurry photo"
TOLERANCE = 1e-2
TORCH_SCHEDULERS = {"pndm": PNDMScheduler, "euler": EulerDiscreteScheduler, "dpm++2m": DPMSolverMultistepScheduler}
MODULES = {
    StableDiffusionImg2ImgPipeline: "diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img",
    StableDiffusionInpaintPipeline: "diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_inpaint",
    StableDiffusionXLImg2ImgPipeline: "diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl_img2img",
}


def picture(side: int) -> Image.Image:
    """A smooth colour gradient with a disc and a bar: structure the VAE must carry through."""
    y, x = np.mgrid[0:side, 0:side] / side
    rgb = np.stack([x, y, 1 - x * y], axis=-1) * 255
    image = Image.fromarray(rgb.astype(np.uint8))
    draw = ImageDraw.Draw(image)
    draw.ellipse((side // 4, side // 4, side // 2, side // 2), fill=(230, 40, 40))
    draw.rectangle((0, 3 * side // 4, side, side - side // 8), fill=(20, 20, 20))
    return image


def mask(side: int) -> Image.Image:
    m = Image.new("L", (side, side), 0)
    ImageDraw.Draw(m).rectangle((side // 8, side // 4, 5 * side // 8, 7 * side // 8), fill=255)
    return m


def noise(n: int, side: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 4, side, side)).astype(np.float32)


def run_reference(reference, scheduler: str, start: np.ndarray, **kwargs) -> np.ndarray:
    """diffusers with our noise and the VAE's mean: see the module docstring."""
    reference.scheduler = TORCH_SCHEDULERS[scheduler].from_config(reference.scheduler.config)
    module = MODULES[type(reference)]
    mean = lambda out, generator=None, sample_mode="sample": out.latent_dist.mode()  # noqa: E731
    given = lambda shape, **_: torch.from_numpy(start).reshape(shape)  # noqa: E731
    with contextlib.ExitStack() as stack, torch.no_grad():
        stack.enter_context(mock.patch(f"{module}.retrieve_latents", side_effect=mean))
        stack.enter_context(mock.patch(f"{module}.randn_tensor", side_effect=given))
        return reference(num_images_per_prompt=len(start), output_type="np", **kwargs).images


def compare(ours, reference, scheduler: str, start: np.ndarray, **kwargs) -> float:
    want = run_reference(reference, scheduler, start, **kwargs)
    got = ours.generate(num_images=len(start), scheduler=scheduler, latents=start, **kwargs).arrays
    assert got.shape == want.shape
    assert got.std() > 0.01  # a picture, not a constant that would match trivially
    return float(np.abs(got - want).max())


# -- SD 1.x ---------------------------------------------------------------------------------------
SD_SIDE = 64  # factor-8 VAE: 8x8 latents


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    """The tiny SD 1.x folder, as diffusers' img2img and inpaint pipelines and as our engine."""
    folder = tmp_path_factory.mktemp("sd1")
    base = tiny_pipeline.write("sd1", folder)
    img2img = StableDiffusionImg2ImgPipeline(**base.components)
    inpaint = StableDiffusionInpaintPipeline(**base.components)
    return img2img, inpaint, load_pipeline(folder)


@pytest.fixture(scope="module")
def sd1_inpainting(sd1, tmp_path_factory):
    """The same folder with a 9-channel inpainting UNet, saved as an inpainting pipeline."""
    base = sd1[0]
    layout = dict(UNET_LAYOUTS["sd1"], cross_attention_dim=32, sample_size=8, in_channels=9)
    unet = randomize(UNet2DConditionModel(**layout), 5)
    reference = StableDiffusionInpaintPipeline(**{**base.components, "unet": unet})
    folder = tmp_path_factory.mktemp("sd1-inpainting")
    reference.save_pretrained(folder, safe_serialization=True)
    return reference, load_pipeline(folder)


SD_ARGS = dict(prompt=PROMPT, negative_prompt=NEGATIVE, guidance_scale=6.0, num_inference_steps=4)


def test_img2img_matches_diffusers_and_strength_never_compiles(sd1):
    reference, _, ours = sd1
    image = picture(SD_SIDE)
    errors = []
    for strength in (0.5, 0.8):
        before = ours.compile_count
        start = noise(2, SD_SIDE // 8, seed=len(errors))
        errors.append(compare(ours, reference, "dpm++2m", start, image=image, strength=strength, **SD_ARGS))
    assert ours.compile_count == before  # the second strength ran the first one's programs
    assert max(errors) < TOLERANCE, errors
    # No size given: the picture's own, rounded down to the VAE's multiple, as diffusers does.
    result = ours.generate(image=picture(SD_SIDE + 5), num_images=2, scheduler="dpm++2m", **SD_ARGS)
    assert result.images[0].size == (SD_SIDE, SD_SIDE)
    assert result.request.strength == 0.8  # StableDiffusionImg2ImgPipeline's default
    assert ours.compile_count == before


@pytest.mark.parametrize(
    ("fixture", "scheduler"),
    [("sd1_inpainting", "euler"), ("sd1", "pndm")],  # a 9-channel UNet; a 4-channel one, blended
)
def test_inpainting_matches_diffusers(fixture, scheduler, request):
    pair = request.getfixturevalue(fixture)
    reference, ours = (pair[1], pair[2]) if fixture == "sd1" else pair
    args = dict(SD_ARGS, image=picture(SD_SIDE), mask_image=mask(SD_SIDE), height=SD_SIDE, width=SD_SIDE)
    errors = []
    for strength in (1.0, 0.6):  # 1: pure noise to start, as diffusers' inpainting does; 0.6: the picture noised
        before = ours.compile_count
        errors.append(compare(ours, reference, scheduler, noise(2, SD_SIDE // 8, seed=3), strength=strength, **args))
    assert ours.compile_count == before
    assert max(errors) < TOLERANCE, errors


def test_bad_picture_inputs_are_refused(sd1, sd1_inpainting):
    _, _, ours = sd1
    image = picture(SD_SIDE)
    with pytest.raises(InvalidRequest, match="mask_image is 32x32 but image is 64x64"):
        ours.generate(PROMPT, image=image, mask_image=mask(32))
    for strength in (0.0, 1.5, float("nan")):
        with pytest.raises(InvalidRequest, match="strength must be a number above 0 and at most 1"):
            ours.generate(PROMPT, image=image, strength=strength)
    with pytest.raises(InvalidRequest, match="runs no step at all"):
        ours.generate(PROMPT, image=image, strength=0.2, num_inference_steps=4)
    with pytest.raises(InvalidRequest, match="image must be a picture"):
        ours.generate(PROMPT, image=np.zeros((64, 64, 3)))
    with pytest.raises(InvalidRequest, match="mask_image needs an image"):
        ours.generate(PROMPT, mask_image=mask(SD_SIDE))
    inpainting = sd1_inpainting[1]
    with pytest.raises(InvalidRequest, match="repaints part of a picture: give image and mask_image"):
        inpainting.generate(PROMPT)
    with pytest.raises(InvalidRequest, match="give mask_image"):
        inpainting.generate(PROMPT, image=image)


def test_inpainting_variant_is_read_from_the_unet(sd1, sd1_inpainting):
    assert (sd1[2].variant.task, sd1_inpainting[1].variant.task) == ("text-to-image", "inpainting")
    assert sd1_inpainting[1].label == "Stable Diffusion Inpainting"


# -- SDXL -----------------------------------------------------------------------------------------
XL_SIDE = 32  # factor-2 VAE: 16x16 latents


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory):
    base = build_sdxl(tmp_path_factory.mktemp("tokenizer"))
    folder = tmp_path_factory.mktemp("sdxl")
    base.save_pretrained(folder)
    return StableDiffusionXLImg2ImgPipeline(**base.components), load_pipeline(folder)


def test_sdxl_img2img_matches_diffusers(sdxl):
    reference, ours = sdxl
    image = picture(XL_SIDE)
    args = dict(prompt=PROMPT, negative_prompt=NEGATIVE, guidance_scale=5.0, num_inference_steps=4)
    errors = []
    for strength in (0.5, 1.0):
        before = ours.compile_count
        errors.append(
            compare(ours, reference, "euler", noise(2, XL_SIDE // 2, seed=5), image=image, strength=strength, **args)
        )
        if strength == 1.0:
            assert ours.compile_count == before
    assert max(errors) < TOLERANCE, errors
