"""A new request field is one record in `engine.request_fields` (and its field on the request): with nothing else
changed, it shows on the page, in `/generate`'s parameters and MCP's schema, in the A1111 and OpenAI body schemas,
reaches the request from every door, and is written to PNG parameters and read back."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from fastapi.testclient import TestClient
from PIL import Image

import engine
import web
from engine import request_fields
from engine.compat.pnginfo import GenerationParameters, format_parameters, parse_parameters
from engine.request_fields import OnPage, RequestField
from tests._doors import doors
from tests.test_app_api import FakeEngine
from web import page
from web.requests import LAST_INPUTS

SHARPNESS = RequestField(
    "sharpness",
    float,
    0.0,
    "how much the picture's edges are sharpened after decoding; 0: not at all.",
    range=(0.0, 2.0),
    title="Sharpness",
    page=OnPage("advanced", "slider", "Sharpness (0: off)", step=0.1),
    a1111="sharpness",
    a1111_setting="sharpness_amount",
    png="Sharpness",
    openai="sharpness",
)


@dataclasses.dataclass(frozen=True)
class SharpRequest(engine.GenerationRequest):
    sharpness: float = 0.0


@pytest.fixture
def with_sharpness(monkeypatch):
    monkeypatch.setattr(request_fields, "FIELDS", (*request_fields.FIELDS, SHARPNESS))
    monkeypatch.setattr(engine, "GenerationRequest", SharpRequest)


def test_a_new_field_shows_at_every_door_with_its_range_and_names(with_sharpness):
    shown = doors(web.build_app(FakeEngine(), mcp=True))
    (slider,) = [c for c in shown["page"] if c.get("label") == "Sharpness (0: off)"]
    assert (slider["type"], slider["minimum"], slider["maximum"], slider["step"], slider["value"]) == (
        "slider",
        0.0,
        2.0,
        0.1,
        0.0,
    )
    assert slider["visible"] is True
    # the last field, before the page's own inputs that came after callers had learnt the positions
    last = shown["generate"][-1 - len(LAST_INPUTS)]
    assert (last["parameter_name"], last["parameter_default"], last["label"]) == (
        "sharpness",
        0.0,
        "Sharpness (0: off)",
    )
    (tool,) = shown["mcp"]
    assert tool["inputSchema"]["properties"]["sharpness"]["description"] == SHARPNESS.meaning
    for body in ("GenerationsBody", "EditsBody", "Txt2ImgRequest", "Img2ImgRequest"):
        assert shown["bodies"][body]["properties"]["sharpness"]["anyOf"] == [{"type": "number"}, {"type": "null"}]


def test_a_new_field_reaches_the_request_from_every_door(with_sharpness):
    pipe = FakeEngine()
    site = web.build_app(pipe, mcp=True)
    with TestClient(site) as client:
        answer = client.post("/v1/images/generations", json={"prompt": "a cat", "sharpness": 1.5})
        assert answer.status_code == 200, answer.text
        body = {"prompt": "a cat", "sharpness": 0.25}
        assert client.post("/sdapi/v1/txt2img", json=body).status_code == 200
        body["override_settings"] = {"sharpness_amount": 0.5}  # A1111's settings win over the body's field
        answer = client.post("/sdapi/v1/txt2img", json=body)
        assert answer.status_code == 200, answer.text
    values = dict(prompt="a cat", negative_prompt="", seed=1, random_seed=False, steps=2, guidance_scale=7.5)
    values.update(scheduler="ddim", size="64x64", images_per_device=1, sharpness="0.8")

    async def drawn():
        return [update async for update in page.run_generation(pipe, values, None)]

    asyncio.run(drawn())
    assert [r.sharpness for r in pipe.calls] == [1.5, 0.25, 0.5, 0.8]


def test_a_new_field_is_written_to_png_parameters_and_read_back(with_sharpness):
    request = SharpRequest("a cat", seed=3, num_inference_steps=2, guidance_scale=7.5, width=64, height=64)
    request = dataclasses.replace(request, scheduler="ddim", sharpness=1.25)
    params = GenerationParameters.from_request(request, seed=3, model="tiny")
    text = format_parameters(params)
    assert text.endswith("Model: tiny, Sharpness: 1.25")
    again = parse_parameters(text)
    assert again.sharpness == 1.25 and again == params
    off = GenerationParameters.from_request(dataclasses.replace(request, sharpness=0.0), seed=3, model="tiny")
    assert "Sharpness" not in format_parameters(off)  # written only when not its default, as A1111 writes its own


def test_the_description_names_every_field_of_the_request_once():
    described = [f.name for f in request_fields.FIELDS]
    assert sorted(described) == sorted(f.name for f in dataclasses.fields(engine.GenerationRequest))
    assert len(set(described)) == len(described)
    for f in request_fields.FIELDS:
        assert f.page is None or f.page.section in request_fields.SECTIONS
    png_keys = [key for f in request_fields.FIELDS for key in (f.png_keys() if f.png else ())]
    assert len(set(png_keys)) == len(png_keys)


def test_a_picture_field_is_written_only_with_a_picture():
    request = engine.GenerationRequest("a cat", num_inference_steps=4, guidance_scale=1.0, width=64, height=64)
    request = dataclasses.replace(request, scheduler="ddim", strength=0.5)
    assert "Denoising strength" not in format_parameters(GenerationParameters.from_request(request, 0, "m"))
    with_picture = dataclasses.replace(request, image=Image.new("RGB", (64, 64)))
    assert "Denoising strength: 0.5" in format_parameters(GenerationParameters.from_request(with_picture, 0, "m"))
