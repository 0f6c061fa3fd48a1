"""The "parameters" PNG chunk: written as AUTOMATIC1111 writes it, and read back from ours and from A1111's own.

The A1111 texts are real ones: the example in the docstring of its `parse_generation_parameters`
(modules/infotext_utils.py), and pictures written by its releases 1.9.3, 1.9.4 and 1.10.1 as published
with them, which carry the separate "Schedule type" of 1.9 and later.
"""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
from PIL import Image

from engine.compat.pnginfo import (
    SAMPLER_NAMES,
    GenerationParameters,
    format_parameters,
    parse_parameters,
    png_info,
    save_png,
)
from engine.request import GenerationRequest
from engine.schedulers import SCHEDULERS

FULL = GenerationParameters(
    prompt="a red circle on a blue background",
    negative_prompt="blurry",
    num_inference_steps=20,
    scheduler="euler_a",
    guidance_scale=7.0,
    seed=5,
    width=512,
    height=768,
    model="stable-diffusion-v1-5/stable-diffusion-v1-5",
    clip_skip=1,
    extra={"Model hash": "6ce0161689", "Version": "v1.10.1"},
)

# (text, what it reads as): the prompt, the negative prompt and the settings of each.
A1111_SAMPLES = [
    (
        # A1111's own example, from the docstring of `parse_generation_parameters`.
        "girl with an artist's beret, determined, blue eyes, desert scene, computer monitors, heavy makeup, by "
        "Alphonse Mucha and Charlie Bowater, ((eyeshadow)), (coquettish), detailed, intricate\n"
        "Negative prompt: ugly, fat, obese, chubby, (((deformed))), [blurry], bad anatomy, disfigured, poorly "
        "drawn face, mutation, mutated, (extra_limb), (ugly), (poorly drawn hands), messy drawing\n"
        "Steps: 20, Sampler: Euler a, CFG scale: 7, Seed: 965400086, Size: 512x512, Model hash: 45dee52b",
        dict(
            prompt_start="girl with an artist's beret",
            prompt_end="detailed, intricate",
            negative_start="ugly, fat",
            num_inference_steps=20,
            scheduler="euler_a",
            guidance_scale=7.0,
            seed=965400086,
            width=512,
            height=512,
            model=None,
            extra={"Model hash": "45dee52b"},
        ),
    ),
    (
        # v1.10.1, SDXL at 1216x832 with the 1.9+ "Schedule type" (the prompt ends in a comma and a space).
        "cat portrait, \n"
        "Negative prompt: lowres,bad anatomy,bad hands,text,error,missing fingers,extra digit,fewer digits,"
        "cropped,worst quality,low quality,jpeg artifacts,signature,watermark,username,blurry,nsfw,painting,"
        "drawing,illustration,cartoon,anime,sketch\n"
        "Steps: 13, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 4, Seed: 2535254266, Face restoration: "
        "CodeFormer, Size: 1216x832, Model hash: 31e35c80fc, Model: sd_xl_base_1.0, FP8 weight: Enable for SDXL, "
        "Cache FP16 weight for LoRA: True, Version: v1.10.1",
        dict(
            prompt_start="cat portrait,",
            prompt_end="cat portrait,",
            negative_start="lowres,bad anatomy",
            num_inference_steps=13,
            scheduler="dpm++2m_karras",
            guidance_scale=4.0,
            seed=2535254266,
            width=1216,
            height=832,
            model="sd_xl_base_1.0",
            extra={
                "Face restoration": "CodeFormer",
                "Model hash": "31e35c80fc",
                "FP8 weight": "Enable for SDXL",
                "Cache FP16 weight for LoRA": "True",
                "Version": "v1.10.1",
            },
        ),
    ),
    (
        # v1.9.4: "Automatic" is the sampler's own schedule, the model's uniform one for Euler a.
        "professional product photoshoot of perfume bottle in sand with beach elements, studio lighting, warm "
        "weather\nNegative prompt: incomplete figures\n"
        "Steps: 20, Sampler: Euler a, Schedule type: Automatic, CFG scale: 7, Seed: 3001968073, Size: 985x1266, "
        "Model hash: b513c6287d, Model: realism_engine, Denoising strength: 0.75, Mask blur: 2, Version: v1.9.4",
        dict(
            prompt_start="professional product photoshoot",
            prompt_end="warm weather",
            negative_start="incomplete figures",
            num_inference_steps=20,
            scheduler="euler_a",
            guidance_scale=7.0,
            seed=3001968073,
            width=985,
            height=1266,
            model="realism_engine",
            strength=0.75,  # "Denoising strength"
            mask_blur=2,  # "Mask blur": inpainting's
            extra={
                "Model hash": "b513c6287d",
                "Version": "v1.9.4",
            },
        ),
    ),
    (
        # v1.9.3, an image-to-image model: its extra settings are kept.
        "make it look like a golden statue\nNegative prompt: Disfigured, cartoon, blurry, nude\n"
        "Steps: 24, Sampler: DPM++ 2M, Schedule type: Karras, CFG scale: 8, Image CFG scale: 1.75, Seed: "
        "3207543649, Size: 512x512, Model hash: ffd280ddcf, Model: instruct-pix2pix-00-22000, Denoising "
        "strength: 1, Version: v1.9.3",
        dict(
            prompt_start="make it look like a golden statue",
            prompt_end="golden statue",
            negative_start="Disfigured, cartoon, blurry, nude",
            num_inference_steps=24,
            scheduler="dpm++2m_karras",
            guidance_scale=8.0,
            seed=3207543649,
            width=512,
            height=512,
            model="instruct-pix2pix-00-22000",
            strength=1.0,
            extra={
                "Image CFG scale": "1.75",
                "Model hash": "ffd280ddcf",
                "Version": "v1.9.3",
            },
        ),
    ),
]


@pytest.mark.parametrize(("text", "want"), A1111_SAMPLES, ids=["docstring", "v1.10.1", "v1.9.4", "v1.9.3"])
def test_a1111_samples_read_as_a1111_reads_them(text, want):
    got = parse_parameters(text)
    want = dict(want)
    assert got.prompt.startswith(want.pop("prompt_start"))
    assert got.prompt.endswith(want.pop("prompt_end"))
    assert got.negative_prompt.startswith(want.pop("negative_start"))
    assert "\n" not in got.negative_prompt and "Steps" not in got.negative_prompt
    for name, value in want.items():
        assert getattr(got, name) == value, name
    assert parse_parameters(format_parameters(got)) == got  # and written again, nothing is lost


def test_our_text_is_laid_out_as_a1111_writes_it():
    text = format_parameters(FULL)
    assert text == (
        "a red circle on a blue background\n"
        "Negative prompt: blurry\n"
        "Steps: 20, Sampler: Euler a, CFG scale: 7, Seed: 5, Size: 512x768, Model hash: 6ce0161689, "
        "Model: stable-diffusion-v1-5/stable-diffusion-v1-5, Version: v1.10.1, Clip skip: 2"
    )


def test_a1111_docstring_example_is_written_back_byte_for_byte():
    text = A1111_SAMPLES[0][0]
    assert format_parameters(parse_parameters(text)) == text


VARIANTS = {
    "full": FULL,
    "no negative prompt": dataclasses.replace(FULL, negative_prompt=""),
    "multi-line prompt": dataclasses.replace(FULL, prompt="a cat,\n(on a mat:1.2)\nBREAK at night"),
    "multi-line negative": dataclasses.replace(FULL, negative_prompt="blurry,\nlow quality"),
    "empty prompt": dataclasses.replace(FULL, prompt=""),
    "commas and colons": dataclasses.replace(FULL, model='C:\\models\\my, "best" model', extra={"Note": "a: b, c"}),
    "unicode": dataclasses.replace(FULL, prompt="un chat sur la tête, 猫", negative_prompt="flou"),
    "fractional guidance": dataclasses.replace(FULL, guidance_scale=7.25),
    "no guidance": dataclasses.replace(FULL, guidance_scale=0.0, clip_skip=0, extra={}),
    "large seed": dataclasses.replace(FULL, seed=2**32 - 1),
    "image to image": dataclasses.replace(FULL, strength=0.75),
    "three settings only": GenerationParameters(prompt="a cat", num_inference_steps=1, guidance_scale=0.0, seed=3),
}
# A1111 calls Euler on a flow model Euler too: "Sampler: Euler" reads back as `euler`, which a flow model's door
# takes as its own Euler (web/names.py).
READ_BACK = {"flow_euler": "euler"}
VARIANTS |= {
    f"scheduler {kind}": dataclasses.replace(FULL, scheduler=kind) for kind in SCHEDULERS if kind not in READ_BACK
}


@pytest.mark.parametrize("params", VARIANTS.values(), ids=VARIANTS.keys())
def test_every_field_reads_back(params):
    assert parse_parameters(format_parameters(params)) == params


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        ("Sampler: PLMS", "pndm"),
        ("Sampler: DDIM", "ddim"),
        ("Sampler: Euler", "euler"),
        ("Sampler: Euler a", "euler_a"),
        ("Sampler: DPM++ 2M", "dpm++2m"),  # before 1.9: no schedule in the name is the uniform one
        ("Sampler: DPM++ 2M Karras", "dpm++2m_karras"),  # before 1.9
        ("Sampler: DPM++ 2M, Schedule type: Karras", "dpm++2m_karras"),  # 1.9 and later
        ("Sampler: DPM++ 2M, Schedule type: Automatic", "dpm++2m_karras"),  # 1.9+: DPM++ 2M's own is Karras
        ("Sampler: DPM++ 2M, Schedule type: Uniform", "dpm++2m"),
        ("Sampler: Euler, Schedule type: Automatic", "euler"),
        ("Sampler: Euler a, Schedule type: Uniform", "euler_a"),
        ("Sampler: Euler, Schedule type: Karras", None),  # no Karras Euler here
        ("Sampler: DPM++ 2M SDE, Schedule type: Exponential", None),
        ("Sampler: UniPC", None),
    ],
)
def test_sampler_names_map_to_our_schedulers(line, kind):
    got = parse_parameters(f"a cat\nSteps: 20, {line}, CFG scale: 7, Seed: 1")
    assert got.scheduler == kind
    sampler = line.split(",")[0].removeprefix("Sampler: ")
    if kind is None:  # kept as written, and written again
        assert got.sampler == sampler == got.extra["Sampler"]
        assert line in format_parameters(got)
    else:
        assert "Sampler" not in got.extra and "Schedule type" not in got.extra


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_every_scheduler_has_an_a1111_name(kind):
    assert kind in SAMPLER_NAMES
    params = GenerationParameters("x", num_inference_steps=1, scheduler=kind, guidance_scale=1.0)
    assert parse_parameters(format_parameters(params)).scheduler == READ_BACK.get(kind, kind)


@pytest.mark.parametrize(
    ("text", "prompt", "extra"),
    [
        # Fewer than three settings: the last line is prompt, as A1111 reads it.
        ("a cat\nSteps: 20, Seed: 5", "a cat\nSteps: 20, Seed: 5", {}),
        ("just a prompt", "just a prompt", {}),
        # A value we cannot take stays as text; unknown keys are kept.
        ("a cat\nSteps: many, Seed: -1x, CFG scale: high, Size: big", "a cat", dict(Steps="many", Seed="-1x")),
        # Prompt and negative prompt over several lines, each line stripped.
        (
            "a cat,\n  (on a mat:1.2) \nNegative prompt: blurry,\nlow quality\nSteps: 2, Seed: 1, CFG scale: 3",
            "a cat,\n(on a mat:1.2)",
            {},
        ),
    ],
)
def test_odd_texts_read_as_a1111_reads_them(text, prompt, extra):
    got = parse_parameters(text)
    assert got.prompt == prompt
    assert got.negative_prompt in ("", "blurry,\nlow quality")
    for key, value in extra.items():
        assert got.extra[key] == value


def test_quoted_values_are_unquoted():
    got = parse_parameters(
        'a cat\nSteps: 2, Seed: 1, CFG scale: 3, Hires upscaler: "R-ESRGAN 4x+, Anime6B", Note: "a, b"'
    )
    assert got.hires_upscaler == "R-ESRGAN 4x+, Anime6B"  # hires fix's upscaler, a request field
    assert got.extra == {"Note": "a, b"}
    assert got.num_inference_steps == 2


def image() -> Image.Image:
    pixels = np.random.default_rng(0).integers(0, 256, (16, 24, 3), np.uint8)
    return Image.fromarray(pixels)


@pytest.mark.parametrize("where", ["path", "file"])
def test_saved_png_carries_the_chunk(where, tmp_path):
    picture = image()
    params = VARIANTS["unicode"]  # beyond Latin-1: an iTXt chunk
    if where == "path":
        save_png(picture, tmp_path / "a.png", params)
        data = (tmp_path / "a.png").read_bytes()
        sources = [tmp_path / "a.png", str(tmp_path / "a.png"), data, Image.open(tmp_path / "a.png")]
    else:
        buffer = io.BytesIO()
        save_png(picture, buffer, params)
        data = buffer.getvalue()
        sources = [io.BytesIO(data), data]
    assert data.startswith(b"\x89PNG") and b"parameters" in data
    for source in sources:
        assert png_info(source) == params
    with Image.open(io.BytesIO(data)) as reread:  # the picture itself is unchanged, and PIL sees the text
        np.testing.assert_array_equal(np.asarray(reread), np.asarray(picture))
        assert reread.text["parameters"] == format_parameters(params)


def test_latin1_text_is_a_plain_text_chunk():
    buffer = io.BytesIO()
    save_png(image(), buffer, FULL)
    assert b"tEXtparameters\x00a red circle" in buffer.getvalue()  # what A1111 and most readers expect


def test_a_picture_without_parameters_has_none(tmp_path):
    image().save(tmp_path / "plain.png")
    assert png_info(tmp_path / "plain.png") is None
    assert png_info(image()) is None


def test_an_a1111_png_fills_a_request():
    buffer = io.BytesIO()
    save_png(image(), buffer, parse_parameters(A1111_SAMPLES[1][0]))
    fields = png_info(buffer.getvalue()).request_fields()
    request = GenerationRequest(**fields)
    assert (request.prompt, request.seed, request.num_inference_steps) == ("cat portrait,", 2535254266, 13)
    assert (request.guidance_scale, request.scheduler, request.width, request.height) == (
        4.0,
        "dpm++2m_karras",
        1216,
        832,
    )


def test_recipe_of_a_request():
    request = GenerationRequest(
        "a cat",
        seed=40,
        num_inference_steps=20,
        guidance_scale=6.5,
        height=512,
        width=768,
        scheduler="ddim",
        clip_skip=1,
    )
    params = GenerationParameters.from_request(request, seed=41, model="tiny")  # the request's second picture
    assert params == GenerationParameters(
        "a cat", "", 20, "ddim", guidance_scale=6.5, seed=41, width=768, height=512, model="tiny", clip_skip=1
    )
    assert format_parameters(params) == (
        "a cat\nSteps: 20, Sampler: DDIM, CFG scale: 6.5, Seed: 41, Size: 768x512, Model: tiny, Clip skip: 2"
    )


def test_recipe_of_an_image_to_image_request():
    from PIL import Image

    request = GenerationRequest(
        "a cat",
        seed=3,
        num_inference_steps=20,
        guidance_scale=7.0,
        height=512,
        width=512,
        scheduler="euler",
        image=Image.new("RGB", (512, 512)),
        strength=0.6,
    )
    params = GenerationParameters.from_request(request, seed=3, model="tiny")
    assert params.strength == 0.6
    # A1111 writes the strength of img2img after the model and before Clip skip.
    assert format_parameters(dataclasses.replace(params, clip_skip=1)).endswith(
        "Model: tiny, Denoising strength: 0.6, Clip skip: 2"
    )
    assert GenerationParameters.from_request(dataclasses.replace(request, image=None), 3, "tiny").strength is None


def test_eta_is_written_when_not_zero_and_read_back_as_a1111_names_it():
    ddim = dataclasses.replace(FULL, scheduler="ddim", eta=0.3)
    text = format_parameters(ddim)
    assert "Eta DDIM: 0.3" in text and "Eta:" not in text  # A1111's DDIM field
    assert parse_parameters(text) == ddim
    tcd = dataclasses.replace(FULL, scheduler="tcd", eta=0.5)
    assert "Eta: 0.5" in format_parameters(tcd) and parse_parameters(format_parameters(tcd)) == tcd
    assert "Eta" not in format_parameters(FULL)  # 0, the default, is not written
    request = GenerationRequest("a cat", num_inference_steps=4, scheduler="ddim", eta=0.3)
    assert GenerationParameters.from_request(request, 0, "tiny").request_fields()["eta"] == 0.3
    assert parse_parameters("a cat\nSteps: 20, Sampler: DDIM, Seed: 1, Eta DDIM: oops").extra == {"Eta DDIM": "oops"}


def test_token_merging_is_written_as_a1111_names_it_and_read_back():
    merged = dataclasses.replace(FULL, token_merging=0.5)
    text = format_parameters(merged)
    assert "Token merging ratio: 0.5" in text and parse_parameters(text) == merged
    assert "Token merging" not in format_parameters(FULL)
    request = GenerationRequest("a cat", num_inference_steps=4, scheduler="euler", token_merging=0.3)
    assert GenerationParameters.from_request(request, 0, "tiny").request_fields()["token_merging"] == 0.3


def test_deep_cache_is_written_above_1_and_read_back():
    cached = dataclasses.replace(FULL, deep_cache=3)
    text = format_parameters(cached)
    assert "Deep cache: 3" in text and parse_parameters(text) == cached
    assert "Deep cache" not in format_parameters(FULL)  # off, the default, is not written
    request = GenerationRequest("a cat", num_inference_steps=4, scheduler="euler", deep_cache=2)
    assert GenerationParameters.from_request(request, 0, "tiny").request_fields()["deep_cache"] == 2
    assert GenerationParameters.from_request(dataclasses.replace(request, deep_cache=1), 0, "tiny").deep_cache == 0
