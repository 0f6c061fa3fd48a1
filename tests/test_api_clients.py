"""What image clients send beyond the basics, at A1111's and OpenAI's doors: A1111's `/png-info`, `/skip`, `eta`,
img2img's `resize_mode` and inpainting options, the hires fix's second pass's own (webuiapi's calls); OpenAI's
`/v1/models`, `output_format`, `quality`, `style` and `background`; and a size not offered, however large, refused
with the sizes that are. Over a stand-in engine (tests/_api_server.py)."""

from __future__ import annotations

import base64
import dataclasses
import io
import json

import openai
import pytest
import webuiapi
from fastapi.testclient import TestClient
from PIL import Image

from engine.compat.pnginfo import png_info
from engine.sampling.inpaint import resize_picture
from tests._api_server import FakeEngine, ServedApp, b64png, decode_png, fake_app

BODY = {"prompt": "a red circle", "seed": 5, "steps": 3, "width": 64, "height": 64}
OFFERED = "64x64, 88x64"


@pytest.fixture(scope="module")
def fake():
    pipe = FakeEngine()
    with TestClient(fake_app(pipe)) as client:
        yield pipe, client


def test_png_info_reads_a_pictures_recipe_as_a1111_does(fake):
    _, client = fake
    drawn = client.post("/sdapi/v1/txt2img", json={**BODY, "negative_prompt": "blurry"}).json()["images"][0]
    info = client.post("/sdapi/v1/png-info", json={"image": "data:image/png;base64," + drawn}).json()
    assert info["info"].startswith("a red circle\nNegative prompt: blurry\nSteps: 3, Sampler: DDIM, CFG scale: 7.5")
    params = info["parameters"]
    assert (params["Prompt"], params["Negative prompt"], params["Steps"], params["Seed"]) == (
        "a red circle",
        "blurry",
        "3",
        "5",
    )
    assert params["Sampler"] == "DDIM" and params["Size"] == "64x64" and info["items"] == {}
    plain = client.post("/sdapi/v1/png-info", json={"image": b64png(Image.new("RGB", (8, 8)))}).json()
    assert plain == {"info": "", "items": {}, "parameters": {}}
    bad = client.post("/sdapi/v1/png-info", json={"image": "%%% not base64"})
    assert bad.status_code == 422 and "image is not valid base64" in bad.json()["detail"]


def test_skip_answers_as_interrupt_does_and_eta_reaches_the_request(fake):
    pipe, client = fake
    assert client.post("/sdapi/v1/skip").json() == {}
    assert client.post("/sdapi/v1/txt2img", json={**BODY, "eta": 0.5}).status_code == 200
    assert pipe.calls[-1].eta == 0.5
    text = json.loads(client.post("/sdapi/v1/txt2img", json={**BODY, "eta": 0.5}).json()["info"])["infotexts"][0]
    assert "Eta DDIM: 0.5" in text  # DDIM's own key, as A1111 writes it


def halves(size=(128, 64)) -> Image.Image:
    """A picture whose left quarter is black and the rest white."""
    picture = Image.new("RGB", size, (255, 255, 255))
    picture.paste((0, 0, 0), (0, 0, size[0] // 4, size[1]))
    return picture


def test_resize_mode_just_resizes_crops_or_fills_as_a1111_does():
    picture = halves()
    squashed, cropped, filled = (resize_picture(picture, 64, 64, mode) for mode in (0, 1, 2))
    assert squashed.size == cropped.size == filled.size == (64, 64)
    assert squashed.getpixel((2, 32)) == (0, 0, 0)  # the black quarter, squashed to 16 columns
    assert cropped.getpixel((2, 32)) == (255, 255, 255)  # the middle 64 columns: white
    assert filled.getpixel((2, 32)) == (0, 0, 0) and filled.getpixel((40, 2)) == (255, 255, 255)  # bands stretched


def test_img2img_hands_its_picture_resize_mode_and_inpainting_options_to_the_engine(fake):
    """The engine resizes and prepares (engine/sampling/inpaint.py); a body without the inpainting options gets
    A1111's own defaults (mask blur 4, only masked, no padding, fill), not the engine's."""
    pipe, client = fake
    mask = Image.new("L", (128, 64), 0)
    mask.paste(255, (0, 0, 32, 64))
    body = {**BODY, "init_images": [b64png(halves())], "mask": b64png(mask), "resize_mode": 1}
    assert client.post("/sdapi/v1/img2img", json=body).status_code == 200
    request = pipe.calls[-1]
    assert request.image.size == request.mask_image.size == (128, 64) and request.resize_mode == 1
    assert (request.mask_blur, request.inpaint_full_res, request.inpaint_full_res_padding) == (4, True, 0)
    assert request.inpainting_fill == 0
    given = {"mask_blur": 9, "inpaint_full_res": False, "inpaint_full_res_padding": 40, "inpainting_fill": 2}
    assert client.post("/sdapi/v1/img2img", json={**body, **given}).status_code == 200
    request = pipe.calls[-1]
    assert (request.mask_blur, request.inpaint_full_res, request.inpaint_full_res_padding) == (9, False, 40)
    assert request.inpainting_fill == 2
    assert client.post("/sdapi/v1/txt2img", json=BODY).status_code == 200
    assert pipe.calls[-1].mask_blur is None  # txt2img's body has no such field: the engine's own default
    for change, message in (
        ({"resize_mode": 7}, "resize_mode must be one of 0 (just resize)"),
        ({"mask_blur": 65}, "mask_blur must be a whole number of pixels from 0 to 64"),
        ({"inpaint_full_res_padding": -1}, "inpaint_full_res_padding must be a whole number of pixels from 0 to 256"),
        ({"inpainting_fill": 4}, "inpainting_fill must be one of 0 (fill), 1 (original), 2 (latent noise)"),
    ):
        answer = client.post("/sdapi/v1/img2img", json={**body, **change})
        assert answer.status_code == 422 and message in answer.json()["detail"]


def test_webuiapi_img2img_and_hires_txt2img_bring_their_options_to_the_request():
    """webuiapi sends A1111's inpainting options and the hires fix's second pass's own on every call."""
    pipe = FakeEngine()
    pipe.limits = dataclasses.replace(pipe.limits, upscalers=("Latent", "Lanczos"))
    mask = Image.new("L", (128, 64), 0)
    mask.paste(255, (8, 8, 40, 40))
    with ServedApp(fake_app(pipe)) as url:
        host, port = url.removeprefix("http://").split(":")
        api = webuiapi.WebUIApi(host=host, port=int(port))
        api.img2img(images=[halves()], mask_image=mask, width=64, height=64, steps=4, resize_mode=2, mask_blur=7)
        r = pipe.calls[-1]
        assert (r.resize_mode, r.mask_blur, r.inpaint_full_res, r.inpaint_full_res_padding) == (2, 7, True, 0)
        assert r.inpainting_fill == 0 and r.mask_image.size == r.image.size == (128, 64)  # webuiapi's defaults
        api.img2img(
            images=[halves()], mask_image=mask, width=64, height=64, steps=4, inpaint_full_res=False, inpainting_fill=3
        )
        assert (pipe.calls[-1].inpaint_full_res, pipe.calls[-1].inpainting_fill) == (False, 3)
        api.txt2img(
            prompt="a red circle",
            width=64,
            height=64,
            steps=4,
            enable_hr=True,
            hr_resize_x=88,
            hr_resize_y=64,
            hr_sampler_name="Euler a",
            hr_prompt="a blue square",
            denoising_strength=0.4,
        )
        r = pipe.calls[-1]
        assert (r.hires_width, r.hires_height, r.hires_scheduler, r.hires_prompt) == (
            88,
            64,
            "euler_a",
            "a blue square",
        )
        assert r.hires_negative_prompt is None and r.strength == 0.4  # "": the first pass's, as A1111 reads it


def test_a_size_not_offered_however_large_is_refused_with_the_offered_sizes(fake):
    _, client = fake
    answer = client.post("/sdapi/v1/txt2img", json={**BODY, "width": 1792, "height": 1024})
    assert answer.status_code == 422 and f"choose one of the sizes offered here: {OFFERED}" in answer.json()["detail"]


@pytest.fixture(scope="module")
def openai_fake():
    pipe = FakeEngine()
    with ServedApp(fake_app(pipe)) as url:
        yield pipe, openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def test_openai_lists_its_model_and_writes_the_format_asked_for(openai_fake):
    pipe, client = openai_fake
    assert [model.id for model in client.models.list()] == ["fake/model"]
    for output_format, kind in (("jpeg", "JPEG"), ("webp", "WEBP"), ("png", "PNG")):
        answer = client.images.generate(
            model="gpt-image-1", prompt="a cat", size="64x64", output_format=output_format, quality="high"
        )
        picture = Image.open(io.BytesIO(base64.b64decode(answer.data[0].b64_json)))
        assert picture.format == kind and picture.size == (64, 64) and answer.output_format == output_format
    assert png_info(decode_png(answer.data[0].b64_json)).seed is not None  # a PNG keeps its recipe
    linked = client.images.generate(prompt="a cat", size="64x64", output_format="webp", response_format="url")
    assert linked.data[0].url.endswith(".webp")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(size="1792x1024"), f"choose one of the sizes offered here: {OFFERED}"),
        (dict(background="transparent"), "background must be auto or opaque"),
        (dict(output_format="gif"), "output_format must be one of png, jpeg, webp"),
        (dict(extra_body={"output_compression": 101}), "output_compression must be from 0 to 100"),
    ],
)
def test_openai_refuses_what_it_cannot_draw_by_name(openai_fake, change, message):
    _, client = openai_fake
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.generate(prompt="a cat", **change)
    assert message in refused.value.message
    assert client.images.generate(prompt="a cat", size="64x64", style="vivid").data
