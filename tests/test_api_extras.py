"""A1111's Extras over the engine's upscalers, and its hires fix fields, through the A1111 door over a stand-in
engine (tests/_api_server.py) that carries a real upscaler folder: Lanczos, Nearest and one tiny SRVGGNetCompact
written as Real-ESRGAN names its tensors. The networks themselves equal PyTorch's in tests/test_upscalers.py; here
the door's arithmetic (sizes, crops, blends, the list A1111 clients read) and its refusals."""

from __future__ import annotations

import base64
import dataclasses
import io

import numpy as np
import pytest
import webuiapi
from fastapi.testclient import TestClient
from PIL import Image
from safetensors.numpy import save_file

import engine
from engine.loading.upscaler_folder import UpscalerFolder
from engine.sampling.hires import LATENT_UPSCALERS
from engine.sampling.upscale import upscale_to
from tests._api_server import FakeEngine, ServedApp, b64png, fake_app

BODY = {"prompt": "a red circle", "seed": 5, "steps": 4, "width": 64, "height": 64}


def tiny_compact(folder, name="2x-Tiny", features=4, convs=1, scale=2):
    """A random SRVGGNetCompact with Real-ESRGAN's tensor names."""
    rng = np.random.default_rng(0)
    tensors, index = {}, 0
    shapes = [(features, 3)] + [(features, features)] * convs
    for out, inp in shapes:
        tensors[f"body.{index}.weight"] = rng.normal(0, 0.1, (out, inp, 3, 3)).astype(np.float32)
        tensors[f"body.{index}.bias"] = np.zeros(out, np.float32)
        tensors[f"body.{index + 1}.weight"] = np.full(out, 0.25, np.float32)
        index += 2
    tensors[f"body.{index}.weight"] = rng.normal(0, 0.1, (3 * scale**2, features, 3, 3)).astype(np.float32)
    tensors[f"body.{index}.bias"] = np.zeros(3 * scale**2, np.float32)
    save_file(tensors, str(folder / f"{name}.safetensors"))


class UpscalingEngine(FakeEngine):
    """The stand-in engine with a real upscaler folder and the engine's `upscale`; any size served."""

    limits = dataclasses.replace(
        FakeEngine.limits, sizes=None, upscalers=(*LATENT_UPSCALERS, "Lanczos", "Nearest", "2x-Tiny")
    )

    def __init__(self, folder, **kwargs):
        super().__init__(**kwargs)
        self.upscalers = UpscalerFolder([folder])

    def upscale(self, picture, width, height, upscaler):
        return upscale_to(picture, width, height, self.upscalers.get(upscaler))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("upscalers")
    tiny_compact(folder)
    pipe = UpscalingEngine(folder)
    with TestClient(fake_app(pipe)) as client:
        yield pipe, client


def picture(size=(24, 16)) -> Image.Image:
    pixels = np.random.default_rng(1).integers(0, 256, (size[1], size[0], 3), np.uint8)
    return Image.fromarray(pixels)


def decoded(text: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(text)))
    image.load()
    return image


def test_the_upscalers_are_listed_as_a1111_lists_them(served):
    _, client = served
    items = client.get("/sdapi/v1/upscalers").json()
    assert [item["name"] for item in items] == ["None", "Lanczos", "Nearest", "2x-Tiny"]
    assert items[3]["scale"] == 2 and items[3]["model_path"] == "2x-Tiny.safetensors"  # the file, not where it is


def test_extra_single_image_scales_resizes_crops_and_blends(served):
    pipe, client = served
    source = picture()
    body = {"image": b64png(source), "upscaler_1": "2x-Tiny", "upscaling_resize": 2}
    got = decoded(client.post("/sdapi/v1/extra-single-image", json=body).json()["image"])
    assert got.size == (48, 32)
    assert np.array_equal(np.asarray(got), np.asarray(pipe.upscale(source, 48, 32, "2x-Tiny")))
    lanczos = decoded(client.post("/sdapi/v1/extra-single-image", json={**body, "upscaler_1": "None"}).json()["image"])
    assert np.array_equal(np.asarray(lanczos), np.asarray(source.resize((48, 32), Image.Resampling.LANCZOS)))
    sized = {**body, "resize_mode": 1, "upscaling_resize_w": 40, "upscaling_resize_h": 40}
    cropped = decoded(client.post("/sdapi/v1/extra-single-image", json=sized).json()["image"])
    assert cropped.size == (40, 40)  # covered to 60x40, then its middle
    blend = {**body, "upscaler_2": "Nearest", "extras_upscaler_2_visibility": 0.5}
    blended = decoded(client.post("/sdapi/v1/extra-single-image", json=blend).json()["image"])
    want = Image.blend(pipe.upscale(source, 48, 32, "2x-Tiny"), source.resize((48, 32), Image.Resampling.NEAREST), 0.5)
    assert np.array_equal(np.asarray(blended), np.asarray(want))


def test_extra_batch_images_upscales_each(served):
    _, client = served
    body = {"imageList": [{"data": b64png(picture()), "name": "a"}] * 2, "upscaler_1": "Nearest"}
    images = client.post("/sdapi/v1/extra-batch-images", json=body).json()["images"]
    assert [decoded(image).size for image in images] == [(48, 32), (48, 32)]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"upscaler_1": "4x-Magic"},
            "unknown upscaler '4x-Magic'; this server offers: None, Lanczos, Nearest, 2x-Tiny",
        ),
        ({"upscaling_resize": 20}, "upscaling_resize must be above 0 and at most 8"),
        (
            {"upscaling_resize": 8, "image": b64png(picture((4000, 400)))},
            "over this server's limit of 8192 pixels a side",
        ),
        ({"gfpgan_visibility": 1}, "face restoration (GFPGAN, CodeFormer) is not offered here"),
        ({"image": "%%%"}, "image is not valid base64"),
    ],
)
def test_bad_extras_are_refused_by_name_and_the_next_is_served(served, change, message):
    _, client = served
    body = {"image": b64png(picture()), "upscaler_1": "Lanczos", **change}
    answer = client.post("/sdapi/v1/extra-single-image", json=body)
    assert answer.status_code == 422 and message in answer.json()["detail"], answer.text
    assert client.post("/sdapi/v1/extra-single-image", json={"image": b64png(picture())}).status_code == 200


def test_a1111s_hires_fields_reach_the_request_only_with_enable_hr(served):
    pipe, client = served
    hires = {"hr_scale": 1.5, "hr_upscaler": "Lanczos", "hr_second_pass_steps": 3, "denoising_strength": 0.4}
    client.post("/sdapi/v1/txt2img", json={**BODY, **hires})
    assert not pipe.calls[-1].hires and pipe.calls[-1].strength is None  # enable_hr off: A1111 ignores them
    client.post("/sdapi/v1/txt2img", json={**BODY, **hires, "enable_hr": True, "hr_resize_x": 0})
    r = pipe.calls[-1]
    assert (r.hires_scale, r.hires_upscaler, r.hires_steps, r.strength, r.hires_width) == (1.5, "Lanczos", 3, 0.4, None)
    client.post("/sdapi/v1/txt2img", json={**BODY, "enable_hr": True})
    assert (pipe.calls[-1].hires_scale, pipe.calls[-1].hires_upscaler) == (2.0, "Latent")  # A1111's defaults


def test_webuiapi_lists_upscalers_and_latent_modes(tmp_path):
    tiny_compact(tmp_path)
    with ServedApp(fake_app(UpscalingEngine(tmp_path))) as url:
        host, port = url.removeprefix("http://").split(":")
        api = webuiapi.WebUIApi(host=host, port=int(port))
        assert [u["name"] for u in api.get_upscalers()] == ["None", "Lanczos", "Nearest", "2x-Tiny"]
        assert [m["name"] for m in api.get_latent_upscale_modes()][:2] == ["Latent", "Latent (antialiased)"]
        result = api.extra_single_image(picture(), upscaler_1="Nearest", upscaling_resize=2)
        assert result.image.size == (48, 32)


def test_the_page_names_the_embeddings_a_prompt_may_call():
    from types import SimpleNamespace

    from web import handlers

    class WithEmbeddings(FakeEngine):
        embeddings = SimpleNamespace(loaded=(SimpleNamespace(name="mystyle"), SimpleNamespace(name="bad-hands")))

    assert "embeddings: mystyle, bad-hands" in handlers.model_summary(WithEmbeddings())
    assert "embeddings" not in handlers.model_summary(FakeEngine())


def test_the_pages_upscale_uses_the_servers_upscalers_and_shows_only_where_there_are_some(tmp_path):
    from web import handlers, page

    tiny_compact(tmp_path)
    pipe = UpscalingEngine(tmp_path)
    source = picture()
    got = handlers.upscale_picture(pipe, source, "2", "2x-Tiny")
    assert np.array_equal(np.asarray(got), np.asarray(pipe.upscale(source, 48, 32, "2x-Tiny")))
    for scale, message in (("9", "Upscale by must be from 1 to 4"), ("big", "Upscale by must be a number")):
        with pytest.raises(engine.InvalidRequest, match=message):
            handlers.upscale_picture(pipe, source, scale, "Lanczos")
    with pytest.raises(engine.InvalidRequest, match="Upload a picture to upscale first"):
        handlers.upscale_picture(pipe, None, 2, "Lanczos")

    def shown(engine_face) -> bool:
        props = {c["props"].get("label"): c["props"] for c in page.create_demo(engine_face).config["components"]}
        return props["Upscale a picture"]["visible"]

    assert shown(pipe) and not shown(FakeEngine())
    dropdown = [
        c["props"]
        for c in page.create_demo(pipe).config["components"]
        if c["props"].get("label") == "Upscaler" and c["props"].get("elem_id") is None
    ]
    assert [choice[0] for choice in dropdown[-1]["choices"]] == ["Lanczos", "Nearest", "2x-Tiny"]


def test_the_extras_doors_refuse_strangers_huge_pictures_and_paths_they_may_not_open(tmp_path):
    import asyncio

    import gradio as gr

    from tests._api_server import png_claiming
    from web import page
    from web.pictures import ClientFiles

    tiny_compact(tmp_path)
    pipe = UpscalingEngine(tmp_path)
    body = {"image": b64png(picture()), "upscaler_1": "Lanczos"}
    with TestClient(fake_app(pipe, api_keys=["sk-extras"])) as client:
        for path in ("/sdapi/v1/extra-single-image", "/sdapi/v1/png-info"):
            assert client.post(path, json=body).status_code == 401  # credentials set: no anonymous call
        assert client.get("/sdapi/v1/upscalers").status_code == 401
        signed = {"Authorization": "Bearer sk-extras"}
        huge = {**body, "image": base64.b64encode(png_claiming(20000, 20000)).decode()}
        answer = client.post("/sdapi/v1/extra-single-image", json=huge, headers=signed)
        assert answer.status_code == 422 and "image is too large" in answer.json()["detail"]
        assert client.post("/sdapi/v1/extra-single-image", json=body, headers=signed).status_code == 200
    # The page's Upscale opens only an upload or a picture this server wrote: a path a client names is refused.
    secret = tmp_path / "secret.png"
    picture().save(secret)
    demo = page.create_demo(pipe, files=ClientFiles(10**6, upload_folder=tmp_path / "uploads"))
    (upscale,) = [fn.fn for fn in demo.fns.values() if getattr(fn.fn, "__name__", "") == "upscale"]
    with pytest.raises(gr.Error, match="The picture to upscale is not a picture uploaded to this server"):
        asyncio.run(upscale({"path": str(secret)}, 2, "Lanczos"))
