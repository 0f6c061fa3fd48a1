"""Z-Image and FLUX.2 [klein] through every door: the page's `/generate`, MCP's tool, A1111 and OpenAI, the cluster.

tests/test_z_image.py and tests/test_flux2_klein.py hold each engine's pictures to diffusers'; here each door must
hand back the engine's own picture for the values it was sent (0 difference on 0..255). The tiny folders are theirs
(Z-Image-Turbo's scheduler; Klein saved distilled), each served once by the real app on a free 127.0.0.1 port, and
every text-to-image request is 32x32 in 2 steps, so each engine compiles one plan for all those doors.

Editing (Klein takes reference pictures, Z-Image none): OpenAI's edits, A1111's img2img and the page's Edit mode
send two 64x64 pictures and no size, so the three share one more plan; Z-Image's doors refuse them. A model that
only edits (FLUX.1 Kontext) is checked over the stand-in engine.

The cluster is Ray Serve's deployment code without Ray: an `EngineReplica` around the engine, its `describe` and
`generate` called as the cluster calls them (the request, the description and the events through Ray's
cloudpickle, as Ray sends them), and the page's `RemoteEngine` over them. Starting a local Ray cluster costs
minutes on this machine, and tests/test_cluster.py does it for the embedded model and Klein's edits.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import re
import urllib.request

import httpx
import numpy as np
import pytest
import test_flux2_klein as klein_case
import test_z_image as zimage_case
from fastapi.testclient import TestClient
from PIL import Image

import web
from engine import GenerationRequest, load_pipeline
from tests._api_server import FakeEngine, ServedApp, decode_png, max_pixel_difference

SIZE, STEPS = 32, 2
PROMPT = "a red circle on a blue background"
FAMILIES = ("z-image", "klein")


def build_zimage(tmp_path_factory):
    folder = tmp_path_factory.mktemp("z-image")
    zimage_case.build_reference(tmp_path_factory).save_pretrained(folder)
    return folder


def build_klein(tmp_path_factory):
    reference = klein_case.build_reference(tmp_path_factory.mktemp("klein-parts"))
    folder = tmp_path_factory.mktemp("klein")
    reference.save_pretrained(folder)  # distilled: 4 steps by default and no unconditional row
    return folder


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory):
    """(engine, the app's URL) for one family: the page, its MCP server and the REST APIs on one port."""
    build = {"z-image": build_zimage, "klein": build_klein}[request.param]
    engine = load_pipeline(build(tmp_path_factory), safety_checker=False, max_batch_size=1)
    try:
        with ServedApp(web.build_app(engine, mcp=True)) as url:
            yield engine, url
    finally:
        engine.close()


def drawn(engine, seed: int, guidance_scale: float | None = None, **fields) -> Image.Image:
    """The engine's own picture for the values every door below sends."""
    values = {"prompt": PROMPT, "seed": seed, "num_inference_steps": STEPS, "width": SIZE, "height": SIZE, **fields}
    request = GenerationRequest(**values, guidance_scale=guidance_scale, scheduler="flow_euler")
    return engine.submit(request).result(300).images[0]


def page_values(engine, seed: int) -> dict:
    """`/generate`'s values as gradio_client users write them, at the model's own guidance scale."""
    return dict(
        prompt=PROMPT,
        negative_prompt="",
        seed=seed,
        random_seed=False,
        steps=STEPS,
        guidance_scale=engine.defaults["guidance_scale"],
        scheduler="flow_euler",
        size=f"{SIZE}x{SIZE}",
        images_per_device=1,
    )


def test_the_page_draws_the_engines_picture(served, tmp_path):
    from gradio_client import Client

    engine, url = served
    client = Client(url, verbose=False, download_files=str(tmp_path))
    gallery, seed, _ = client.predict(**page_values(engine, seed=3), api_name="/generate")
    assert seed == 3 and len(gallery) == 1
    with Image.open(gallery[0]["image"]) as got:
        assert max_pixel_difference(got.convert("RGB"), drawn(engine, seed=3)) == 0


def call_mcp_tool(url: str, arguments: dict) -> tuple[dict, list]:
    """MCP's `generate` tool as an MCP client sees it (streamable HTTP): its schema and what a call returns."""
    from mcp import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    async def call():
        async with streamable_http_client(url + "/gradio_api/mcp/") as (read, write, _):
            async with ClientSession(read, write) as session:
                await session.initialize()
                (tool,) = [t for t in (await session.list_tools()).tools if t.name.endswith("generate")]
                result = await session.call_tool(tool.name, arguments)
                assert not result.isError, result.content
                return tool.inputSchema, result.content

    return asyncio.run(call())


def test_mcp_lists_the_tool_and_its_call_draws_the_engines_picture(served):
    engine, url = served
    schema, content = call_mcp_tool(url, page_values(engine, seed=4))
    assert {"prompt", "guidance_scale", "size"} <= set(schema["properties"])
    # Gradio answers a queued tool's call with one text: its outputs (the gallery, the seed, the details) as a
    # Python list, each picture a URL on this server.
    (text,) = [c.text for c in content]
    (address,) = re.findall(r"'url': '([^']+)'", text)
    assert "seed 4" in text
    with urllib.request.urlopen(address, timeout=30) as answer:
        got = Image.open(io.BytesIO(answer.read())).convert("RGB")
    assert max_pixel_difference(got, drawn(engine, seed=4)) == 0


def test_a1111_and_openai_draw_the_engines_picture(served):
    """txt2img at CFG scale 1 and OpenAI's generations with its extra-body guidance_scale: the engine's pictures."""
    engine, url = served
    body = dict(prompt=PROMPT, seed=5, steps=STEPS, cfg_scale=1.0, width=SIZE, height=SIZE, sampler_name="Euler")
    answer = httpx.post(url + "/sdapi/v1/txt2img", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    assert max_pixel_difference(decode_png(answer.json()["images"][0]), drawn(engine, 5, 1.0)) == 0

    body = dict(prompt=PROMPT, size=f"{SIZE}x{SIZE}", seed=6, num_inference_steps=STEPS, guidance_scale=1.0)
    answer = httpx.post(url + "/v1/images/generations", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    assert max_pixel_difference(decode_png(answer.json()["data"][0]["b64_json"]), drawn(engine, 6, 1.0)) == 0


def test_the_cluster_serves_the_family(served):
    """A replica's description and events cross Ray's pickling; the page's `RemoteEngine` built from them draws
    the replica engine's picture, captioned with the replica's name."""
    from ray import cloudpickle

    from cluster import ClusterSettings, RemoteEngine
    from cluster.replica import EngineReplica

    engine, _ = served
    replica = object.__new__(EngineReplica.func_or_class)  # the deployment's class, without Serve starting it
    replica.settings, replica.engine, replica.name = ClusterSettings(), engine, "replica 0"
    replica._tickets, replica.stopped = [], 0

    class Handle:  # `handle.options(stream=True).generate.remote(...)` and `describe.remote().result()`, in-process
        def options(self, **_):
            return self

        @property
        def describe(self):
            return self

        @property
        def generate(self):
            return Call(replica.generate)

        def remote(self):
            return self

        def result(self):
            return cloudpickle.loads(cloudpickle.dumps(replica.describe()))

    class Call:
        def __init__(self, method):
            self.method = method

        def remote(self, request, model, caller=""):
            return self.sent(cloudpickle.loads(cloudpickle.dumps(request)), model, caller)

        async def sent(self, request, model, caller):
            async for event in self.method(request, model, caller):
                yield cloudpickle.loads(cloudpickle.dumps(event))

    remote = RemoteEngine.connect(Handle())
    try:
        assert (remote.family, remote.variant, remote.defaults, remote.guided) == (
            engine.family,
            engine.variant,
            engine.defaults,
            engine.family == "z-image",  # Klein saved distilled takes no guidance
        )
        request = GenerationRequest(PROMPT, seed=8, num_inference_steps=STEPS, width=SIZE, height=SIZE)
        result = remote.submit(request).result(300)
        assert result.devices[0].startswith("replica 0 · ")
        assert max_pixel_difference(result.images[0], drawn(engine, 8)) == 0
    finally:
        remote.close()
        replica.engine = None  # the replica closes its engine when collected; this one is the module's


# ---- editing from reference pictures: OpenAI's edits and A1111's img2img -----------------------------------------


def reference_picture(seed: int) -> Image.Image:
    """A 64x64 picture (a reference's smallest side) of smooth colours."""
    y, x = np.mgrid[0:64, 0:64] / 8.0
    rng = np.random.default_rng(seed)
    channels = [np.sin(x * rng.uniform(0.5, 2) + rng.uniform(0, 6)) * np.cos(y * rng.uniform(0.5, 2)) for _ in "rgb"]
    return Image.fromarray(np.uint8(np.stack(channels, -1) * 120 + 128))


REFERENCES = (reference_picture(1), reference_picture(2))


def png(picture: Image.Image) -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


def edit(url: str, pictures, **fields) -> httpx.Response:
    """OpenAI's `/v1/images/edits` as the openai client sends several pictures: one `image[]` part each; no size,
    so the picture takes the first one's (64x64)."""
    data = dict(prompt=PROMPT, num_inference_steps=str(STEPS), guidance_scale="1.0", **fields)
    files = [("image[]", (f"{k}.png", png(p), "image/png")) for k, p in enumerate(pictures)]
    return httpx.post(url + "/v1/images/edits", data=data, files=files, timeout=300)


def test_openai_edits_and_a1111_img2img_edit_from_every_picture_sent(served):
    """For Klein, which edits, each `image[]` part and each init image is a reference, in order (A1111's denoising
    strength ignored), and the picture takes the first one's size: the engine's picture from those references.
    Z-Image edits one picture, so two are refused."""
    engine, url = served
    answer = edit(url, REFERENCES, seed="9")
    body = dict(prompt=PROMPT, seed=10, steps=STEPS, cfg_scale=1.0, sampler_name="Euler")
    body.update(init_images=[base64.b64encode(png(p)).decode() for p in REFERENCES], denoising_strength=0.75)
    a1111 = httpx.post(url + "/sdapi/v1/img2img", json=body, timeout=300)
    if not engine.limits.max_references:
        assert answer.status_code == 400 and "exactly one picture" in answer.json()["error"]["message"]
        assert a1111.status_code == 422 and "one init image per request" in a1111.json()["detail"]
        return
    assert answer.status_code == 200, answer.text
    assert answer.json()["size"] == "64x64"
    want = drawn(engine, 9, 1.0, references=REFERENCES, width=None, height=None)
    assert max_pixel_difference(decode_png(answer.json()["data"][0]["b64_json"]), want) == 0
    assert a1111.status_code == 200, a1111.text
    want = drawn(engine, 10, 1.0, references=REFERENCES, width=None, height=None)
    assert max_pixel_difference(decode_png(a1111.json()["images"][0]), want) == 0


def test_the_pages_edit_mode_draws_from_its_reference_pictures(served, tmp_path):
    """Klein's page offers Edit, and `/generate` in that mode draws the engine's picture from the uploaded pictures,
    at the first one's size; Z-Image's offers no Edit, and `/generate` refuses references saying the model does not
    take them."""
    from gradio_client import Client, handle_file
    from gradio_client.exceptions import AppError

    engine, url = served
    paths = []
    for k, picture in enumerate(REFERENCES):
        paths.append(tmp_path / f"reference{k}.png")
        picture.save(paths[-1])
    uploads = [{"image": handle_file(str(path)), "caption": None} for path in paths]
    client = Client(url, verbose=False, download_files=str(tmp_path / "downloads"))
    values = dict(page_values(engine, seed=11), guidance_scale=1.0, mode="Edit", references=uploads)
    modes = [c for c in client.config["components"] if c["props"].get("elem_id") == "mode"][0]["props"]["choices"]
    if not engine.limits.max_references:
        assert "Edit" not in [label for label, _ in modes]
        with pytest.raises(AppError, match="does not take reference pictures"):
            client.predict(**values, api_name="/generate")
        return
    assert [label for label, _ in modes] == ["Text to image", "Edit", "Image to image", "Inpaint"]
    # Klein saved distilled takes no guidance: its slider says so and cannot be moved
    (guidance,) = [c["props"] for c in client.config["components"] if c["props"].get("label") == "Guidance scale"]
    assert guidance["interactive"] is False and "step-distilled" in guidance["info"]
    gallery, _, _ = client.predict(**values, api_name="/generate")
    want = drawn(engine, 11, 1.0, references=REFERENCES, width=None, height=None)
    with Image.open(gallery[0]["image"]) as got:
        assert got.size == (64, 64) and max_pixel_difference(got.convert("RGB"), want) == 0


def test_an_edit_is_refused_with_a_mask_strength_or_too_many_pictures(served):
    engine, url = served
    most = engine.limits.max_references
    if not most:
        pytest.skip("Z-Image edits one picture, as image to image or inpainting (tests/test_api_openai.py)")
    mask = ("mask", ("mask.png", png(Image.new("RGBA", (64, 64))), "image/png"))
    data = dict(prompt=PROMPT)
    files = [("image[]", ("0.png", png(REFERENCES[0]), "image/png")), mask]
    answer = httpx.post(url + "/v1/images/edits", data=data, files=files, timeout=60)
    assert answer.status_code == 400 and "takes no mask" in answer.json()["error"]["message"]
    answer = edit(url, REFERENCES, strength="0.5")
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "strength"
    answer = edit(url, [REFERENCES[0]] * (most + 1))
    assert answer.status_code == 400, answer.text
    assert f"too many: this model edits from at most {most}" in answer.json()["error"]["message"]
    body = dict(prompt=PROMPT, init_images=[base64.b64encode(png(REFERENCES[0])).decode()] * (most + 1))
    answer = httpx.post(url + "/sdapi/v1/img2img", json=body, timeout=60)
    assert answer.status_code == 422 and f"at most {most}" in answer.json()["detail"]


# ---- a model that only edits (FLUX.1 Kontext: Limits.min_references 1), over the stand-in engine ------------------


class OnlyEdits(FakeEngine):
    limits = dataclasses.replace(FakeEngine.limits, min_references=1, max_references=1)


def test_a_model_that_only_edits_is_sent_to_the_doors_that_edit():
    """Its text-to-image doors refuse, naming the door to use; its editing doors hand the picture over as its
    reference (A1111's denoising strength dropped); the page offers Edit alone."""
    pipe = OnlyEdits()
    site = web.build_app(pipe)
    sent = REFERENCES[0]
    with TestClient(site) as client:
        answer = client.post("/sdapi/v1/txt2img", json={"prompt": PROMPT})
        assert answer.status_code == 422 and "send it to img2img in init_images" in answer.json()["detail"]
        answer = client.post("/v1/images/generations", json={"prompt": PROMPT})
        assert answer.status_code == 400 and "/v1/images/edits" in answer.json()["error"]["message"]
        body = dict(prompt=PROMPT, init_images=[base64.b64encode(png(sent)).decode()], denoising_strength=0.5)
        assert client.post("/sdapi/v1/img2img", json=body).status_code == 200
        files = [("image", ("0.png", png(sent), "image/png"))]
        assert client.post("/v1/images/edits", data={"prompt": PROMPT}, files=files).status_code == 200
    for request in pipe.calls:
        assert request.image is None and request.strength is None and len(request.references) == 1
        assert np.array_equal(np.asarray(request.references[0]), np.asarray(sent))
    modes = [c for c in site.state.demo.config["components"] if c["props"].get("elem_id") == "mode"]
    assert [label for label, _ in modes[0]["props"]["choices"]] == ["Edit"]
