"""OpenAI's Images API (/v1/images) beside the page, driven by the real `openai` client against uvicorn on
127.0.0.1: over a stand-in engine (fast: routing, parsing, errors, access), and over the embedded model (slow:
a seed draws the very pictures the engine draws for the same values)."""

from __future__ import annotations

import io

import openai
import pytest
import requests
from PIL import Image

import engine
import web
from engine.compat.pnginfo import png_info
from tests._api_server import (
    FakeEngine,
    ServedApp,
    decode_png,
    fake_app,
    max_pixel_difference,
    picture_colour,
    png,
    png_claiming,
    raw_http,
    shared_engine,
)

KEY = "sk-jaxsd-test-key"


def client_for(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def fake():
    pipe = FakeEngine()
    with ServedApp(fake_app(pipe)) as url:
        yield pipe, client_for(url), url


def masked(size=(64, 64)) -> Image.Image:
    """An OpenAI mask: its left half transparent (redraw), its right half opaque (keep)."""
    mask = Image.new("RGBA", size, (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (0, 0, size[0] // 2, size[1]))
    return mask


# ---- fast: the routes over a stand-in engine -------------------------------------------------------------


def test_generations_draw_n_pictures_with_consecutive_seeds_and_our_extra_fields(fake):
    pipe, client, _ = fake
    answer = client.images.generate(
        model="dall-e-3",  # accepted whatever it names
        prompt="a red circle",
        n=2,
        size="88x64",
        extra_body={
            "seed": 5,
            "negative_prompt": "blurry",
            "num_inference_steps": 3,
            "guidance_scale": 4.5,
            "scheduler": "euler_a",
            "eta": 0.3,
            "deep_cache": 2,
        },
    )
    images = [decode_png(item.b64_json) for item in answer.data]
    assert [image.size for image in images] == [(88, 64)] * 2 and answer.created > 0
    assert [image.getpixel((0, 0)) for image in images] == [picture_colour(5), picture_colour(6)]
    assert png_info(images[1]).seed == 6  # each PNG carries its recipe
    request = pipe.calls[-1]
    assert (request.negative_prompt, request.num_inference_steps, request.guidance_scale) == ("blurry", 3, 4.5)
    assert request.scheduler == "euler_a" and request.num_images == 2 and request.eta == 0.3
    assert request.deep_cache == 2
    client.images.generate(prompt="a red circle", size="auto", extra_body={"scheduler": "DPM++ 2M Karras"})
    assert pipe.calls[-1].scheduler == "dpm++2m_karras" and pipe.calls[-1].width == 64  # the model's own size


def test_url_answers_link_to_a_png_served_here(fake):
    _, client, _ = fake
    answer = client.images.generate(prompt="a red circle", response_format="url", extra_body={"seed": 9})
    picture = requests.get(answer.data[0].url, timeout=20)
    assert picture.status_code == 200 and picture.headers["content-type"] == "image/png"
    assert Image.open(io.BytesIO(picture.content)).getpixel((0, 0)) == picture_colour(9)
    assert requests.get(answer.data[0].url.replace(".png", "x.png"), timeout=20).status_code == 404


def test_edits_inpaint_with_a_mask_and_redraw_without_one(fake):
    pipe, client, _ = fake
    picture = Image.new("RGB", (64, 64), (10, 20, 30))
    answer = client.images.edit(image=("in.png", png(picture)), mask=("mask.png", png(masked())), prompt="a cat")
    assert len(answer.data) == 1
    request = pipe.calls[-1]
    assert request.image.getpixel((0, 0)) == (10, 20, 30)
    assert request.mask_image.getpixel((0, 0)) == 255 and request.mask_image.getpixel((63, 0)) == 0  # transparent
    client.images.edit(image=("in.png", png(picture)), prompt="a cat", n=2, extra_body={"strength": 0.5, "seed": 1})
    request = pipe.calls[-1]
    assert request.mask_image is None and request.strength == 0.5 and request.num_images == 2


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (dict(size="96x64"), "size 96x64 is not offered here; choose one of 64x64, 88x64"),
        (dict(size="big"), "size must be written WIDTHxHEIGHT"),
        (dict(n=0), "number of images must be from 1 to 8, got 0"),
        (dict(prompt="x" * 10_000), "prompt is too long (10000 characters; at most 2000)"),
        (dict(prompt=" "), "prompt must not be empty"),
        (dict(response_format="jpeg"), "response_format must be one of b64_json, url"),
        (dict(extra_body={"num_inference_steps": 0}), "steps must be a whole number from 1 to 50, got 0"),
        (dict(extra_body={"scheduler": "heun"}), "unknown sampler 'heun'"),
        (dict(extra_body={"eta": 2}), "eta must be a number from 0 (deterministic) to 1"),
    ],
)
def test_bad_values_are_a_bad_request_with_a_message_and_the_next_call_is_served(fake, call, message):
    pipe, client, _ = fake
    drawn = len(pipe.calls)
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.generate(**{"prompt": "a red circle", **call})
    assert message in refused.value.body["message"] and refused.value.status_code == 400
    assert refused.value.body["type"] == "invalid_request_error"
    assert len(pipe.calls) == drawn
    assert len(client.images.generate(prompt="a red circle").data) == 1


@pytest.mark.parametrize(
    ("image", "mask", "message"),
    [
        (png_claiming(20000, 20000), None, "image is too large to read"),
        (b"not a picture", None, "image could not be read as a picture"),
        (png(Image.new("RGB", (64, 64))), png(masked((32, 32))), "mask_image is 32x32 but image is 64x64"),
        (png(Image.new("RGB", (64, 64))), png(Image.new("L", (64, 64))), "mask must be a PNG with an alpha channel"),
    ],
)
def test_bad_pictures_are_refused(fake, image, mask, message):
    _, client, _ = fake
    extra = {"mask": ("mask.png", mask)} if mask else {}
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.edit(image=("in.png", image), prompt="a cat", **extra)
    assert message in refused.value.body["message"]


def test_errors_come_in_openais_shape():
    with ServedApp(fake_app(FakeEngine(error=engine.Busy("the server is busy; try again in a moment")))) as url:
        answer = requests.post(f"{url}/v1/images/generations", json={"prompt": "a cat"}, timeout=20)
        assert answer.status_code == 503 and answer.headers["retry-after"]
        assert answer.json() == {
            "error": {
                "message": "the server is busy; try again in a moment",
                "type": "server_error",
                "param": None,
                "code": "server_busy",
            }
        }
        invalid = requests.post(f"{url}/v1/images/generations", json={"n": 1}, timeout=20).json()["error"]
        assert invalid["param"] == "prompt" and invalid["type"] == "invalid_request_error"
    with ServedApp(fake_app(FakeEngine(), max_body_mb=1)) as url:
        head = f"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Length: {50 * 2**20}\r\n\r\n"
        status, text = raw_http(int(url.rsplit(":", 1)[1]), head, [b"{"])
        assert status == 413 and '"code":"request_too_large"' in text


def test_api_keys_close_the_openai_routes():
    pipe = FakeEngine()
    with ServedApp(fake_app(pipe, api_keys=[KEY, "sk-jaxsd-other-key"])) as url:
        with pytest.raises(openai.AuthenticationError) as refused:
            client_for(url, "wrong-key").images.generate(prompt="a cat")
        assert refused.value.body["code"] == "invalid_api_key"
        anonymous = requests.post(f"{url}/v1/images/generations", json={"prompt": "a cat"}, timeout=20)
        assert anonymous.status_code == 401 and anonymous.json()["error"]["code"] == "invalid_api_key"
        assert pipe.calls == []  # nothing drawn
        assert len(client_for(url).images.generate(prompt="a cat").data) == 1
        assert len(client_for(url, "sk-jaxsd-other-key").images.generate(prompt="a cat").data) == 1
    with ServedApp(fake_app(FakeEngine(), auth=[("ann", "secret-a")])) as url:  # --auth alone: user:password
        with pytest.raises(openai.AuthenticationError):
            client_for(url).images.generate(prompt="a cat")
        assert len(client_for(url, "ann:secret-a").images.generate(prompt="a cat").data) == 1


# ---- slow: the embedded model --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(request, tmp_path_factory):
    pipe = shared_engine(request, tmp_path_factory)
    with ServedApp(web.build_app(pipe)) as url:
        yield pipe, client_for(url)


def direct(pipe, **values) -> list[Image.Image]:
    fields = dict(num_inference_steps=4, guidance_scale=7.0, width=64, height=64, scheduler="euler_a")
    return pipe.submit(engine.GenerationRequest(**{**fields, **values})).result(timeout=300).images


OURS = {"seed": 21, "num_inference_steps": 4, "guidance_scale": 7.0, "scheduler": "euler_a"}


@pytest.mark.slow
def test_a_seed_draws_through_the_openai_client_the_pictures_the_engine_draws(served):
    pipe, client = served
    answer = client.images.generate(prompt="a yellow star", n=2, size="64x64", extra_body=OURS)
    expected = direct(pipe, prompt="a yellow star", seed=21, num_images=2)
    drawn = [decode_png(item.b64_json) for item in answer.data]
    assert [max_pixel_difference(a, b) for a, b in zip(drawn, expected, strict=True)] == [0, 0]

    start = expected[0]
    edited = client.images.edit(
        image=("in.png", png(start)), mask=("mask.png", png(masked())), prompt="a purple star", extra_body=OURS
    )
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (0, 0, 32, 64))
    same = direct(pipe, prompt="a purple star", seed=21, image=start, mask_image=mask)[0]
    assert max_pixel_difference(decode_png(edited.data[0].b64_json), same) <= 1
    redrawn = client.images.edit(image=("in.png", png(start)), prompt="a purple star", extra_body=OURS)
    same = direct(pipe, prompt="a purple star", seed=21, image=start)[0]
    assert max_pixel_difference(decode_png(redrawn.data[0].b64_json), same) <= 1
