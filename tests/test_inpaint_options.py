"""A1111's image-to-image options: the picture and mask made ready as A1111's `StableDiffusionProcessingImg2Img.init`
makes them, and the drawing laid back over the picture as its `apply_overlay` does.

- The pixel work (engine/sampling/inpaint.py) equals A1111's code, transcribed below as `a1111_*` from
  modules/processing.py, modules/images.py and modules/masking.py (OpenCV's GaussianBlur and PIL's operations, as
  A1111 calls them): mask blur within two levels of 255, resize modes, the "only masked" box, the fill and the whole
  preparation and paste-back exactly.
- Through the tiny SD 1.x pipeline: "only masked" equals diffusers' `StableDiffusionInpaintPipeline` with
  `padding_mask_crop` (diffusers' own port of it, with its overlay), and latent noise / latent nothing equal diffusers'
  pipeline starting from the image latents A1111 makes (the picture filled, its `init_latent` with the masked part noise or zeros).
  diffusers' `VaeImageProcessor.blur` is PIL's box-approximated Gaussian, not A1111's, so the blur has no diffusers
  twin; A1111's code is its reference.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import cv2
import numpy as np
import pytest
import tiny_pipeline
import torch
from diffusers import EulerDiscreteScheduler, StableDiffusionInpaintPipeline
from PIL import Image, ImageDraw, ImageFilter, ImageOps

import engine
from engine import InvalidRequest, load_pipeline
from engine.sampling.inpaint import blur_mask, fill_masked, masked_area, prepare, resize_picture

INPAINT = "diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_inpaint"
ARGS = dict(
    prompt="a red circle on a blue background",
    negative_prompt="blurry photo",
    guidance_scale=6.0,
    num_inference_steps=4,
)
LANCZOS = Image.Resampling.LANCZOS


# ---- A1111's code, transcribed (the reference) ------------------------------------------------------------------


def a1111_blur(mask: Image.Image, blur: int) -> Image.Image:
    np_mask = np.array(mask)
    kernel_size = 2 * int(2.5 * blur + 0.5) + 1
    np_mask = cv2.GaussianBlur(np_mask, (kernel_size, 1), blur)
    np_mask = cv2.GaussianBlur(np_mask, (1, kernel_size), blur)
    return Image.fromarray(np_mask)


def a1111_resize_image(resize_mode: int, im: Image.Image, width: int, height: int) -> Image.Image:
    if resize_mode == 0:
        return im.resize((width, height), resample=LANCZOS)
    ratio, src_ratio = width / height, im.width / im.height
    if resize_mode == 1:
        src_w = width if ratio > src_ratio else im.width * height // im.height
        src_h = height if ratio <= src_ratio else im.height * width // im.width
        resized = im.resize((src_w, src_h), resample=LANCZOS)
        res = Image.new("RGB", (width, height))
        res.paste(resized, box=(width // 2 - src_w // 2, height // 2 - src_h // 2))
        return res
    src_w = width if ratio < src_ratio else im.width * height // im.height
    src_h = height if ratio >= src_ratio else im.height * width // im.width
    resized = im.resize((src_w, src_h), resample=LANCZOS)
    res = Image.new("RGB", (width, height))
    res.paste(resized, box=(width // 2 - src_w // 2, height // 2 - src_h // 2))
    if ratio < src_ratio:
        fill_height = height // 2 - src_h // 2
        if fill_height > 0:
            res.paste(resized.resize((width, fill_height), box=(0, 0, width, 0)), box=(0, 0))
            res.paste(
                resized.resize((width, fill_height), box=(0, resized.height, width, resized.height)),
                box=(0, fill_height + src_h),
            )
    elif ratio > src_ratio:
        fill_width = width // 2 - src_w // 2
        if fill_width > 0:
            res.paste(resized.resize((fill_width, height), box=(0, 0, 0, height)), box=(0, 0))
            res.paste(
                resized.resize((fill_width, height), box=(resized.width, 0, resized.width, height)),
                box=(fill_width + src_w, 0),
            )
    return res


def a1111_crop_region(mask: Image.Image, pad: int, processing_width: int, processing_height: int):
    """masking.get_crop_region_v2, then masking.expand_crop_region."""
    box = mask.getbbox()
    if not box:
        return None
    x1, y1, x2, y2 = box
    if pad:
        x1, y1, x2, y2 = max(x1 - pad, 0), max(y1 - pad, 0), min(x2 + pad, mask.size[0]), min(y2 + pad, mask.size[1])
    image_width, image_height = mask.size
    ratio_crop_region = (x2 - x1) / (y2 - y1)
    ratio_processing = processing_width / processing_height
    if ratio_crop_region > ratio_processing:
        desired_height = (x2 - x1) / ratio_processing
        desired_height_diff = int(desired_height - (y2 - y1))
        y1 -= desired_height_diff // 2
        y2 += desired_height_diff - desired_height_diff // 2
        if y2 >= image_height:
            diff = y2 - image_height
            y2 -= diff
            y1 -= diff
        if y1 < 0:
            y2 -= y1
            y1 -= y1
        if y2 >= image_height:
            y2 = image_height
    else:
        desired_width = (y2 - y1) * ratio_processing
        desired_width_diff = int(desired_width - (x2 - x1))
        x1 -= desired_width_diff // 2
        x2 += desired_width_diff - desired_width_diff // 2
        if x2 >= image_width:
            diff = x2 - image_width
            x2 -= diff
            x1 -= diff
        if x1 < 0:
            x2 -= x1
            x1 -= x1
        if x2 >= image_width:
            x2 = image_width
    return x1, y1, x2, y2


def a1111_fill(image: Image.Image, mask: Image.Image) -> Image.Image:
    image_mod = Image.new("RGBA", (image.width, image.height))
    image_masked = Image.new("RGBa", (image.width, image.height))
    image_masked.paste(image.convert("RGBA").convert("RGBa"), mask=ImageOps.invert(mask.convert("L")))
    image_masked = image_masked.convert("RGBa")
    for radius, repeats in [(256, 1), (64, 1), (16, 2), (4, 4), (2, 2), (0, 1)]:
        blurred = image_masked.filter(ImageFilter.GaussianBlur(radius)).convert("RGBA")
        for _ in range(repeats):
            image_mod.alpha_composite(blurred)
    return image_mod.convert("RGB")


def a1111_img2img(image, image_mask, width, height, resize_mode, mask_blur, inpaint_full_res, padding, fill, drawn):
    """`StableDiffusionProcessingImg2Img.init`'s picture work, then `apply_overlay` on the picture `drawn` (what the
    sampler would have made at width x height): (the picture encoded, its mask, result). The blur is ours, held to
    OpenCV's within 2 of 255 above, so that the rest can be held to A1111's exactly."""
    if mask_blur > 0:
        image_mask = blur_mask(image_mask, mask_blur)
    crop_region = paste_to = None
    if inpaint_full_res:
        mask_for_overlay = image_mask
        mask = image_mask.convert("L")
        crop_region = a1111_crop_region(mask, padding, width, height)
        x1, y1, x2, y2 = crop_region
        image_mask = a1111_resize_image(2, mask.crop(crop_region), width, height)
        paste_to = (x1, y1, x2 - x1, y2 - y1)
    else:
        image_mask = a1111_resize_image(resize_mode, image_mask, width, height)
        np_mask = np.clip(np.array(image_mask).astype(np.float32) * 2, 0, 255).astype(np.uint8)
        mask_for_overlay = Image.fromarray(np_mask)
    if crop_region is None:
        image = a1111_resize_image(resize_mode, image, width, height)
    image_masked = Image.new("RGBa", (image.width, image.height))
    image_masked.paste(image.convert("RGBA").convert("RGBa"), mask=ImageOps.invert(mask_for_overlay.convert("L")))
    overlay = image_masked.convert("RGBA")
    if crop_region is not None:
        image = a1111_resize_image(2, image.crop(crop_region), width, height)
    if fill != 1:
        image = a1111_fill(image, image_mask)
    result = drawn  # apply_overlay
    if paste_to is not None:
        x, y, w, h = paste_to
        base_image = Image.new("RGBA", (overlay.width, overlay.height))
        base_image.paste(a1111_resize_image(1, result, w, h), (x, y))
        result = base_image
    result = result.convert("RGBA")
    result.alpha_composite(overlay)
    return image, image_mask.convert("L"), result.convert("RGB")


# ---- pictures ---------------------------------------------------------------------------------------------------


def picture(width: int, height: int, seed: int = 0) -> Image.Image:
    """A gradient with a disc and noise: colours that differ everywhere, so every offset shows."""
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 / width, y * 255 / height, 255 - x * y * 255 / (width * height)], axis=-1)
    rgb += np.random.default_rng(seed).normal(0, 12, rgb.shape)
    image = Image.fromarray(rgb.clip(0, 255).astype(np.uint8))
    ImageDraw.Draw(image).ellipse((width // 4, height // 4, width // 2, height // 2), fill=(230, 40, 40))
    return image


def mask(width: int, height: int, box: tuple[int, int, int, int]) -> Image.Image:
    m = Image.new("L", (width, height), 0)
    ImageDraw.Draw(m).rectangle(box, fill=255)
    return m


MASKS = [  # (picture size, the masked rectangle): inside, at an edge, wide, tall, in a corner
    ((96, 80), (30, 20, 50, 44)),
    ((96, 80), (0, 10, 20, 70)),
    ((120, 64), (10, 20, 110, 30)),
    ((64, 112), (20, 0, 30, 100)),
    ((80, 80), (60, 60, 79, 79)),
]


@pytest.mark.parametrize("sigma", [1, 4, 16])
def test_mask_blur_equals_a1111s_opencv_gaussian(sigma):
    for size, box in MASKS:
        m = mask(*size, box)
        ours, want = np.asarray(blur_mask(m, sigma), np.int16), np.asarray(a1111_blur(m, sigma), np.int16)
        assert ours.shape == want.shape and ours.max() > 0
        # OpenCV's 8-bit path rounds its kernel to fixed point (its float path equals ours to 1e-5); 2 of 255 at most
        assert np.abs(ours - want).max() <= 2 and np.abs(ours - want).mean() < 0.5
    assert blur_mask(m, 0) is m  # 0: no blur


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_resize_modes_equal_a1111s_resize_image(mode):
    for (w, h), (tw, th) in (((96, 80), (64, 64)), ((120, 64), (64, 64)), ((64, 112), (64, 64)), ((64, 64), (96, 64))):
        image = picture(w, h)
        assert np.array_equal(
            np.asarray(resize_picture(image, tw, th, mode)), np.asarray(a1111_resize_image(mode, image, tw, th))
        )
        m = mask(w, h, (w // 3, h // 3, w // 2, h // 2))
        want = a1111_resize_image(mode, m, tw, th).convert("L")  # A1111 makes an RGB of a grey mask
        assert np.array_equal(np.asarray(resize_picture(m, tw, th, mode)), np.asarray(want))


def test_the_only_masked_box_equals_a1111s_crop_region():
    for (w, h), box in MASKS:
        m = mask(w, h, box)
        for pad in (0, 4, 32):
            for size in ((64, 64), (96, 64), (64, 96)):
                assert masked_area(m, pad, *size) == a1111_crop_region(m, pad, *size), (box, pad, size)
    assert masked_area(Image.new("L", (32, 32)), 8, 64, 64) is None  # an empty mask has no box


def test_fill_equals_a1111s_masking_fill():
    for (w, h), box in MASKS[:3]:
        image, m = picture(w, h), a1111_blur(mask(w, h, box), 4)
        assert np.array_equal(np.asarray(fill_masked(image, m)), np.asarray(a1111_fill(image, m)))


@pytest.mark.parametrize(
    ("resize_mode", "blur", "full_res", "padding", "fill"),
    [(0, 4, True, 0, 0), (0, 4, True, 16, 1), (1, 8, False, 0, 0), (2, 0, False, 0, 1), (0, 2, True, 8, 2)],
)
def test_preparation_and_paste_back_equal_a1111s(resize_mode, blur, full_res, padding, fill):
    for (w, h), box in MASKS:
        image, m = picture(w, h, 1), mask(w, h, box)
        drawn = picture(64, 64, 2)  # a stand-in for what the model draws
        ready = prepare(image, m, 64, 64, resize_mode, blur, full_res, padding, fill)
        want_image, want_mask, want_result = a1111_img2img(
            image, m, 64, 64, resize_mode, blur, full_res, padding, fill, drawn
        )
        assert np.array_equal(np.asarray(ready.image), np.asarray(want_image))
        assert np.array_equal(np.asarray(ready.mask), np.asarray(want_mask))
        result = ready.finish(drawn)
        assert result.size == ((w, h) if full_res else (64, 64))
        assert np.array_equal(np.asarray(result), np.asarray(want_result))


def test_without_mask_blur_or_only_masked_the_drawing_is_left_as_it_is():
    image, m = picture(96, 80), mask(96, 80, MASKS[0][1])
    drawn = picture(64, 64, 2)
    assert prepare(image, m, 64, 64).finish(drawn) is drawn  # diffusers' way: no overlay
    assert prepare(image, None, 64, 64, resize_mode=1).finish(drawn) is drawn


# ---- through the tiny pipeline ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sd1-inpaint-options")
    base = tiny_pipeline.write("sd1", folder)
    reference = StableDiffusionInpaintPipeline(**base.components)
    reference.scheduler = EulerDiscreteScheduler.from_config(base.scheduler.config)
    reference.set_progress_bar_config(disable=True)
    return reference, load_pipeline(folder, sizes=None)


def noise(side: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 4, side // 8, side // 8)).astype(np.float32)


def run_diffusers(reference, start: np.ndarray, start_latents=None, **kwargs):
    """diffusers with our noise and the VAE's mean; `start_latents(latents)`: the image latents it starts from."""
    calls = []

    def mean(out, generator=None, sample_mode="sample"):
        latents = out.latent_dist.mode()
        calls.append(1)
        return start_latents(latents) if start_latents is not None and len(calls) == 1 else latents

    given = lambda shape, **_: torch.from_numpy(start).reshape(shape)  # noqa: E731
    with contextlib.ExitStack() as stack, torch.no_grad():
        stack.enter_context(mock.patch(f"{INPAINT}.retrieve_latents", side_effect=mean))
        stack.enter_context(mock.patch(f"{INPAINT}.randn_tensor", side_effect=given))
        return reference(**ARGS, **kwargs)


def test_only_masked_equals_diffusers_padding_mask_crop(sd1):
    """diffusers' `padding_mask_crop` is A1111's "only masked" with a sharp mask (mask_blur 0), the original fill."""
    reference, ours = sd1
    image, m = picture(96, 80, 3), mask(96, 80, (50, 30, 70, 52))
    start = noise(64, 1)
    want = run_diffusers(
        reference,
        start,
        image=image,
        mask_image=m,
        height=64,
        width=64,
        strength=0.75,
        padding_mask_crop=8,
        output_type="pil",
    ).images[0]
    got = ours.generate(
        **ARGS,
        image=image,
        mask_image=m,
        width=64,
        height=64,
        strength=0.75,
        scheduler="euler",
        latents=start,
        mask_blur=0,
        inpaint_full_res=True,
        inpaint_full_res_padding=8,
        num_images=1,
    )
    assert got.images[0].size == want.size == (96, 80)
    ours_px, want_px = np.asarray(got.images[0], np.int16), np.asarray(want, np.int16)
    outside = np.asarray(m) == 0
    assert np.array_equal(ours_px[outside], np.asarray(image, np.int16)[outside])  # kept exactly
    assert np.abs(ours_px - want_px).max() <= 3  # the drawing, through Lanczos, within 3 of 255
    assert np.abs(ours_px[~outside] - np.asarray(image, np.int16)[~outside]).mean() > 5  # and it was redrawn
    assert got.arrays.shape == (1, 80, 96, 3) and got.request.inpaint_full_res


@pytest.mark.parametrize("fill", [2, 3])
def test_latent_noise_and_latent_nothing_equal_diffusers_from_a1111s_start(sd1, fill):
    reference, ours = sd1
    image, m = picture(64, 64, 4), mask(64, 64, (16, 8, 47, 39))
    start = noise(64, 2)
    holes = torch.from_numpy((np.asarray(m, np.float32)[::8, ::8] >= 128).astype(np.float32))[None, None]
    unscaled = torch.from_numpy(start) / reference.vae.config.scaling_factor  # the patch sees latents before scaling
    made = {2: lambda lat: lat * (1 - holes) + unscaled * holes, 3: lambda lat: lat * (1 - holes)}[fill]
    want = run_diffusers(
        reference,
        start,
        made,
        image=a1111_fill(image, m),
        mask_image=m,
        height=64,
        width=64,
        strength=0.6,
        output_type="np",
    ).images
    got = ours.generate(
        **ARGS,
        image=image,
        mask_image=m,
        width=64,
        height=64,
        strength=0.6,
        scheduler="euler",
        latents=start,
        inpainting_fill=fill,
        num_images=1,
    )
    plain = ours.generate(
        **ARGS,
        image=image,
        mask_image=m,
        width=64,
        height=64,
        strength=0.6,
        scheduler="euler",
        latents=start,
        num_images=1,
    )
    assert float(np.abs(got.arrays - want).max()) < 1e-2
    assert float(np.abs(got.arrays - plain.arrays).max()) > 0.05  # the start made a difference


def test_bad_options_are_refused_by_name(sd1):
    _, ours = sd1
    image, m = picture(64, 64), mask(64, 64, (8, 8, 30, 30))
    cases = [
        (dict(mask_blur=65), "mask_blur must be a whole number of pixels from 0 to 64, got 65"),
        (dict(mask_blur=2.5), "mask_blur must be a whole number of pixels from 0 to 64, got 2.5"),
        (dict(inpaint_full_res="yes"), "inpaint_full_res must be true or false, got 'yes'"),
        (dict(inpaint_full_res_padding=300), "inpaint_full_res_padding must be a whole number of pixels from 0 to 256"),
        (dict(inpainting_fill=4), "inpainting_fill must be one of 0 (fill), 1 (original), 2 (latent noise), 3"),
        (dict(resize_mode=-1), "resize_mode must be one of 0 (just resize), 1 (crop and resize), 2 (resize and"),
    ]
    for fields, message in cases:
        with pytest.raises(InvalidRequest) as refused:
            ours.submit(engine.GenerationRequest("a cat", image=image, mask_image=m, **fields))
        assert message in str(refused.value)
