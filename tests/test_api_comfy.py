"""ComfyUI's API (/prompt, /history, /view, /ws, ...) beside A1111's, as the clients that ship ComfyUI workflows call it.

Open WebUI's and SillyTavern's default workflows, taken from their sources, are filled in the way each fills them and
sent over HTTP to the app served by uvicorn over a stand-in engine (tests/_api_server.py); Open WebUI waits on the
socket for `executing` with node null, SillyTavern polls /history; both fetch the picture with /view. Each must be
the very request, and so the very picture, that A1111's txt2img gives for the same values. Then what must be refused:
graphs that are not one drawing, sizes not offered, paths outside the pictures, callers without a key.
"""

from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
import requests
from fastapi.testclient import TestClient
from PIL import Image

from tests._api_server import FakeEngine, ServedApp, b64png, decode_png, fake_app, max_pixel_difference, png

# Open WebUI's COMFYUI_DEFAULT_WORKFLOW (backend/open_webui/config.py), as it ships.
OPEN_WEBUI_WORKFLOW = """
{
  "3": {"inputs": {"seed": 0, "steps": 20, "cfg": 8, "sampler_name": "euler", "scheduler": "normal", "denoise": 1,
        "model": ["4", 0], "positive": ["6", 0], "negative": ["7", 0], "latent_image": ["5", 0]},
        "class_type": "KSampler", "_meta": {"title": "KSampler"}},
  "4": {"inputs": {"ckpt_name": "model.safetensors"}, "class_type": "CheckpointLoaderSimple",
        "_meta": {"title": "Load Checkpoint"}},
  "5": {"inputs": {"width": 512, "height": 512, "batch_size": 1}, "class_type": "EmptyLatentImage",
        "_meta": {"title": "Empty Latent Image"}},
  "6": {"inputs": {"text": "Prompt", "clip": ["4", 1]}, "class_type": "CLIPTextEncode",
        "_meta": {"title": "CLIP Text Encode (Prompt)"}},
  "7": {"inputs": {"text": "", "clip": ["4", 1]}, "class_type": "CLIPTextEncode",
        "_meta": {"title": "CLIP Text Encode (Prompt)"}},
  "8": {"inputs": {"samples": ["3", 0], "vae": ["4", 2]}, "class_type": "VAEDecode", "_meta": {"title": "VAE Decode"}},
  "9": {"inputs": {"filename_prefix": "ComfyUI", "images": ["8", 0]}, "class_type": "SaveImage",
        "_meta": {"title": "Save Image"}}
}
"""
# Its Images settings' nodes (src/lib/components/admin/Settings/Images.svelte), with the default workflow's ids.
OPEN_WEBUI_NODES = [
    {"type": "prompt", "key": "text", "node_ids": ["6"]},
    {"type": "model", "key": "ckpt_name", "node_ids": ["4"]},
    {"type": "width", "key": "width", "node_ids": ["5"]},
    {"type": "height", "key": "height", "node_ids": ["5"]},
    {"type": "steps", "key": "steps", "node_ids": ["3"]},
    {"type": "seed", "key": "seed", "node_ids": ["3"]},
]
# SillyTavern's default/content/Default_Comfy_Workflow.json, as it ships.
SILLYTAVERN_WORKFLOW = """{
    "3": {"class_type": "KSampler", "inputs": {"cfg": "%scale%", "denoise": 1, "latent_image": ["5", 0],
          "model": ["4", 0], "negative": ["7", 0], "positive": ["6", 0], "sampler_name": "%sampler%",
          "scheduler": "%scheduler%", "seed": "%seed%", "steps": "%steps%"}},
    "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "%model%"}},
    "5": {"class_type": "EmptyLatentImage", "inputs": {"batch_size": 1, "height": "%height%", "width": "%width%"}},
    "6": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["4", 1], "text": "%prompt%"}},
    "7": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["4", 1], "text": "%negative_prompt%"}},
    "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
    "9": {"class_type": "SaveImage", "inputs": {"filename_prefix": "Dechat", "images": ["8", 0]}}
}"""


def open_webui_fill(model: str, prompt: str, width: int, height: int, steps: int, seed: int) -> dict:
    """Open WebUI's `_apply_workflow_nodes` (backend/open_webui/utils/images/comfyui.py) over its default workflow."""
    workflow = json.loads(OPEN_WEBUI_WORKFLOW)
    values = {"model": model, "prompt": prompt, "width": width, "height": height, "steps": steps, "seed": seed}
    for node in OPEN_WEBUI_NODES:
        for node_id in node["node_ids"]:
            workflow[node_id]["inputs"][node["key"]] = values[node["type"]]
    return workflow


def sillytavern_body(settings: dict, prompt: str, negative: str, seed: int) -> str:
    """SillyTavern's `generateComfyImage` (public/scripts/extensions/stable-diffusion/index.js): each "%name%" string
    replaced by the setting's JSON, then `{"prompt": WORKFLOW}` as text, which its server posts to /prompt as is."""
    workflow = SILLYTAVERN_WORKFLOW.replace('"%prompt%"', json.dumps(prompt))
    workflow = workflow.replace('"%negative_prompt%"', json.dumps(negative)).replace('"%seed%"', json.dumps(seed))
    for name in ("model", "vae", "sampler", "scheduler", "steps", "scale", "width", "height"):
        workflow = workflow.replace(f'"%{name}%"', json.dumps(settings.get(name)))
    return f'{{"prompt": {workflow}}}'


class Tiny4x:
    """A stand-in folder of upscalers: one 4x network (nearest neighbour here, so its pixels are known)."""

    entries = {"4x-Tiny": SimpleNamespace(architecture="RRDBNet", path=Path("4x-Tiny.safetensors"), scale=4)}

    def names(self) -> list[str]:
        return ["Lanczos", "Nearest", "4x-Tiny"]


class UpscalingEngine(FakeEngine):
    upscalers = Tiny4x()

    def upscale(self, picture: Image.Image, width: int, height: int, upscaler: str) -> Image.Image:
        return picture.resize((width, height), Image.Resampling.NEAREST)


@pytest.fixture(scope="module")
def served():
    pipe = UpscalingEngine()
    pipe.dtype, pipe.compute_path = "float32", "float32, XLA (avx2)"
    with ServedApp(fake_app(pipe)) as url:
        yield pipe, url


def a1111_picture(url: str, **body) -> Image.Image:
    """A1111's txt2img of the same values, the picture it answers."""
    answer = requests.post(f"{url}/sdapi/v1/txt2img", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return decode_png(answer.json()["images"][0])


async def open_webui_draws(url: str, workflow: dict, client_id: str, key: str = "") -> tuple[list[str], bytes]:
    """Open WebUI's `comfyui_create_image`: the socket first, then /prompt, messages until `executing` null for its
    prompt, /history/ID's SaveImage outputs, each fetched with /view. Returns the message types heard and the PNG."""
    headers = {"Authorization": f"Bearer {key}"}
    heard = []
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{url.replace('http', 'ws')}/ws?clientId={client_id}", headers=headers) as ws:
            body = {"prompt": workflow, "client_id": client_id}
            async with session.post(f"{url}/prompt", json=body, headers=headers) as answer:
                assert answer.status == 200, await answer.text()
                prompt_id = (await answer.json())["prompt_id"]
            async for message in ws:
                if message.type == aiohttp.WSMsgType.BINARY:  # previews: Open WebUI skips them
                    heard.append({"type": "preview", "data": message.data})
                    continue
                data = json.loads(message.data)
                heard.append(data)
                if data["type"] == "executing" and data["data"]["node"] is None:
                    assert data["data"]["prompt_id"] == prompt_id
                    break
        async with session.get(f"{url}/history/{prompt_id}", headers=headers) as answer:
            history = (await answer.json())[prompt_id]
        images = [image for nid, out in history["outputs"].items() if nid == "9" for image in out["images"]]
        query = {"filename": images[0]["filename"], "subfolder": images[0]["subfolder"], "type": images[0]["type"]}
        async with session.get(f"{url}/view", params=query, headers=headers) as answer:
            assert answer.status == 200
            return heard, await answer.read()


def open_webui_models(url: str) -> list[str]:
    """Open WebUI's model list for ComfyUI (backend/open_webui/routers/images.py): the first `..._name` input of the
    model node's class in /object_info."""
    info = requests.get(f"{url}/object_info", timeout=10).json()
    required = info[json.loads(OPEN_WEBUI_WORKFLOW)["4"]["class_type"]]["input"]["required"]
    return required[next(key for key in required if "_name" in key)][0]


def test_open_webuis_default_workflow_draws_a1111s_picture_and_tells_its_progress_on_the_socket(served):
    pipe, url = served
    models = open_webui_models(url)
    assert models == ["fake/model"]
    workflow = open_webui_fill(models[0], "a red circle", 64, 64, 3, 5)
    heard, picture = asyncio.run(open_webui_draws(url, workflow, "owui-1"))
    comfy_request = pipe.calls[-1]
    a1111 = a1111_picture(url, prompt="a red circle", seed=5, steps=3, cfg_scale=8, width=64, height=64,
                             sampler_name="Euler", scheduler="normal")  # fmt: skip
    assert pipe.calls[-1] == comfy_request  # the same request, field by field
    assert max_pixel_difference(Image.open(io.BytesIO(picture)), a1111) == 0
    kinds = [m["type"] for m in heard]
    assert kinds[0] == "status" and heard[0]["data"]["sid"] == "owui-1"
    order = ["execution_start", "progress", "executed", "execution_success"]
    assert [kinds.index(kind) for kind in order] == sorted(kinds.index(kind) for kind in order)
    progress = next(m["data"] for m in heard if m["type"] == "progress")
    assert (progress["value"], progress["max"], progress["node"]) == (1, 3, "3")
    preview = next(m["data"] for m in heard if m["type"] == "preview")  # ComfyUI's PREVIEW_IMAGE frame, a PNG
    assert preview[:8] == bytes([0, 0, 0, 1, 0, 0, 0, 2]) and Image.open(io.BytesIO(preview[8:])).size == (64, 64)
    executed = next(m["data"] for m in heard if m["type"] == "executed")
    assert executed["node"] == "9" and executed["output"]["images"][0]["type"] == "output"


def test_sillytaverns_default_workflow_polled_through_history_draws_a1111s_picture(served):
    pipe, url = served
    info = requests.get(f"{url}/object_info", timeout=10).json()  # SillyTavern's /api/sd/comfy/models, /samplers, ...
    models = info["CheckpointLoaderSimple"]["input"]["required"]["ckpt_name"][0]
    assert models == ["fake/model"] and info["UNETLoader"]["input"]["required"]["unet_name"][0] == models
    samplers = info["KSampler"]["input"]["required"]["sampler_name"][0]
    assert set(samplers) == {"euler", "euler_ancestral", "dpmpp_2m", "ddim", "lcm"}  # the stand-in's kinds
    assert "karras" in info["KSampler"]["input"]["required"]["scheduler"][0]
    assert info["VAELoader"]["input"]["required"]["vae_name"][0]
    settings = {"model": models[0], "sampler": "euler_ancestral", "scheduler": "normal", "steps": 4, "scale": 6.5}
    settings |= {"width": 88, "height": 64, "vae": ""}
    seed = 2**40 + 9  # SillyTavern draws seeds up to 2**53; ours are taken modulo 2**32
    answer = requests.post(
        f"{url}/prompt", data=sillytavern_body(settings, "a blue square", "blurry", seed), timeout=10
    )
    assert answer.status_code == 200, answer.text
    prompt_id = answer.json()["prompt_id"]
    deadline = time.monotonic() + 30
    while (item := requests.get(f"{url}/history", timeout=10).json().get(prompt_id)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert item["status"]["status_str"] == "success"
    image = [image for out in item["outputs"].values() for image in out["images"]][0]
    view = requests.get(f"{url}/view", params=image, timeout=10)
    assert view.status_code == 200 and image["filename"].startswith("Dechat_")
    comfy_request = pipe.calls[-1]
    a1111 = a1111_picture(url, prompt="a blue square", negative_prompt="blurry", seed=9, steps=4, cfg_scale=6.5,
                             width=88, height=64, sampler_name="Euler a")  # fmt: skip
    assert pipe.calls[-1] == comfy_request
    assert max_pixel_difference(Image.open(io.BytesIO(view.content)), a1111) == 0


def drawing(**change) -> dict:
    graph = open_webui_fill("fake/model", "a cat", 64, 64, 3, 1)
    for key, value in change.items():
        node, _, name = key.partition("__")
        if name:
            graph[node]["inputs"][name] = value
        else:
            graph[node] = value
    return graph


@pytest.mark.parametrize(
    ("graph", "node", "kind", "says"),
    [
        (drawing(**{"10": {"class_type": "ControlNetLoader", "inputs": {"control_net_name": "canny"}}}), "10",
         "invalid_prompt", "node 'ControlNetLoader' is not offered here"),
        (drawing(**{"8__samples": ["10", 0], "10": {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0]}}}),
         "8", "dependency_cycle", "Dependency cycle detected"),
        (drawing(**{"3__positive": ["12", 0]}), "3", "prompt_outputs_failed_validation", "node '12' is not in the prompt"),
        (drawing(**{"3": {"class_type": "KSampler", "inputs": {"seed": 1}}}), "3",
         "prompt_outputs_failed_validation", "Required input is missing"),
        (drawing(**{"5__width": 1792, "5__height": 1024}), "5", "prompt_outputs_failed_validation",
         "choose one of the sizes offered here: 64x64, 88x64"),
        (drawing(**{"4__ckpt_name": "sd_xl_base_1.0.safetensors"}), "4", "prompt_outputs_failed_validation",
         "this server serves only 'fake/model'"),
        (drawing(**{"3__denoise": 0.5}), "3", "prompt_outputs_failed_validation", "denoise below 1 redraws part"),
    ],
    ids=["unknown node", "cycle", "link to a missing node", "missing input", "size not offered", "another model",
         "denoise without a picture"],
)  # fmt: skip
def test_a_graph_that_is_not_one_drawing_is_refused_by_name_in_comfyuis_shape(served, graph, node, kind, says):
    pipe, url = served
    calls = len(pipe.calls)
    answer = requests.post(f"{url}/prompt", json={"prompt": graph}, timeout=10)
    assert answer.status_code == 400
    body = answer.json()
    assert body["error"]["type"] == kind and node in body["node_errors"]
    assert body["node_errors"][node]["class_type"] == graph[node]["class_type"]
    assert says in json.dumps(body) and "Traceback" not in answer.text
    assert len(pipe.calls) == calls  # nothing reached the engine
    assert requests.post(f"{url}/prompt", json={"prompt": drawing()}, timeout=10).status_code == 200  # served on


@pytest.mark.parametrize(
    "query",
    [
        {"filename": "../../etc/passwd"},
        {"filename": "/etc/passwd", "type": "input"},
        {"filename": "passwd", "subfolder": "../../../etc"},
        {"filename": "hosts", "type": "../../etc"},
    ],
)
def test_view_serves_only_pictures_made_or_sent_here(served, query):
    _, url = served
    answer = requests.get(f"{url}/view", params=query, timeout=10)
    assert answer.status_code == 404 and "serves only the pictures this server drew or was sent" in answer.text
    assert "passwd" not in answer.text and "etc" not in answer.text
    graph = drawing(**{"10": {"class_type": "LoadImage", "inputs": {"image": query["filename"]}}})
    graph["11"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["10", 0], "vae": ["4", 2]}}
    graph["3"]["inputs"]["latent_image"] = ["11", 0]
    refused = requests.post(f"{url}/prompt", json={"prompt": graph}, timeout=10)
    assert refused.status_code == 400 and "not a picture uploaded here" in refused.text and "passwd" not in refused.text


def test_an_upload_is_drawn_from_at_denoise_strength(served):
    pipe, url = served
    picture = Image.new("RGB", (88, 64), (10, 200, 30))
    sent = requests.post(f"{url}/upload/image", files={"image": ("cat.png", png(picture))}, data={"type": "input"})
    assert sent.status_code == 200 and sent.json()["type"] == "input"
    name = sent.json()["name"]
    assert requests.get(f"{url}/view", params={"filename": name, "type": "input"}).content == png(picture)
    graph = drawing(**{"10": {"class_type": "LoadImage", "inputs": {"image": f"{name} [input]", "upload": "image"}}})
    graph["11"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["10", 0], "vae": ["4", 2]}}
    graph["3"]["inputs"] |= {"latent_image": ["11", 0], "denoise": 0.5}
    assert requests.post(f"{url}/prompt", json={"prompt": graph}, timeout=10).status_code == 200
    request = pipe.calls[-1]
    assert request.strength == 0.5 and request.image.getpixel((0, 0)) == (10, 200, 30)
    assert (request.width, request.height) == (88, 64)  # the picture's own size


def flux_graph(sampler: dict) -> dict:
    """FLUX's loaders (UNETLoader, DualCLIPLoader, VAELoader) and a LoraLoader before the sampler."""
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "fake/model", "weight_dtype": "default"}},
        "2": {"class_type": "DualCLIPLoader", "inputs": {"clip_name1": "t5xxl_fp16.safetensors", "type": "flux",
              "clip_name2": "clip_l.safetensors"}},
        "3": {"class_type": "VAELoader", "inputs": {"vae_name": "ae.safetensors"}},
        "4": {"class_type": "LoraLoader", "inputs": {"model": ["1", 0], "clip": ["2", 0], "lora_name": "style.safetensors",
              "strength_model": 0.6, "strength_clip": 0.6}},
        "5": {"class_type": "CLIPTextEncode", "inputs": {"text": "a fox", "clip": ["4", 1]}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["4", 1]}},
        "7": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 88, "height": 64, "batch_size": 2}},
        "8": sampler,
        "9": {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": ["3", 0]}},
        "10": {"class_type": "SaveImage", "inputs": {"images": ["9", 0], "filename_prefix": "flux/run"}},
    }  # fmt: skip


LINKS = {"model": ["4", 0], "positive": ["5", 0], "negative": ["6", 0], "latent_image": ["7", 0]}
ADVANCED = {"add_noise": "enable", "noise_seed": 7, "steps": 3, "cfg": 1.0, "sampler_name": "euler"}
ADVANCED |= {"scheduler": "simple", "start_at_step": 0, "end_at_step": 10000, "return_with_leftover_noise": "disable"}


def test_fluxs_loaders_a_lora_and_a_whole_ksampler_advanced_make_one_request(served):
    pipe, url = served
    graph = flux_graph({"class_type": "KSamplerAdvanced", "inputs": {**ADVANCED, **LINKS}})
    answer = requests.post(f"{url}/prompt", json={"prompt": graph}, timeout=10)
    assert answer.status_code == 200, answer.text
    r = pipe.calls[-1]
    assert (r.prompt, r.seed, r.num_inference_steps, r.guidance_scale, r.scheduler) == ("a fox", 7, 3, 1.0, "euler")
    assert (r.width, r.height, r.num_images, r.lora_scales) == (88, 64, 2, {"style": 0.6})
    graph["8"]["inputs"]["start_at_step"] = 2  # a second half of a drawing: not one drawing
    refused = requests.post(f"{url}/prompt", json={"prompt": graph}, timeout=10)
    assert refused.status_code == 400 and "KSamplerAdvanced is taken as a whole drawing only" in refused.text
    graph["4"]["inputs"]["strength_clip"] = 1.0
    graph["8"]["inputs"]["start_at_step"] = 0
    refused = requests.post(f"{url}/prompt", json={"prompt": graph}, timeout=10)
    assert refused.status_code == 400 and "4" in refused.json()["node_errors"] and "one weight" in refused.text


def test_a_picture_upscaled_with_a_model_equals_a1111s_extras_of_the_same_drawing(served):
    pipe, url = served
    listed = requests.get(f"{url}/object_info/UpscaleModelLoader", timeout=10).json()
    assert listed["UpscaleModelLoader"]["input"]["required"]["model_name"][0] == ["4x-Tiny"]
    graph = drawing(**{"10": {"class_type": "UpscaleModelLoader", "inputs": {"model_name": "4x-Tiny"}}})
    graph["11"] = {"class_type": "ImageUpscaleWithModel", "inputs": {"upscale_model": ["10", 0], "image": ["8", 0]}}
    graph["9"]["inputs"]["images"] = ["11", 0]
    prompt_id = requests.post(f"{url}/prompt", json={"prompt": graph}, timeout=10).json()["prompt_id"]
    deadline = time.monotonic() + 30
    while (item := requests.get(f"{url}/history/{prompt_id}", timeout=10).json().get(prompt_id)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    view = requests.get(f"{url}/view", params=item["outputs"]["9"]["images"][0], timeout=10)
    upscaled = Image.open(io.BytesIO(view.content))
    drawn = a1111_picture(url, prompt="a cat", seed=1, steps=3, cfg_scale=8, width=64, height=64, sampler_name="Euler")
    body = {"image": b64png(drawn), "upscaler_1": "4x-Tiny", "upscaling_resize": 4}
    extras = requests.post(f"{url}/sdapi/v1/extra-single-image", json=body, timeout=30).json()["image"]
    assert upscaled.size == (256, 256) and max_pixel_difference(upscaled, decode_png(extras)) == 0
    graph["10"]["inputs"]["model_name"] = "4x-UltraSharp.pth"
    refused = requests.post(f"{url}/prompt", json={"prompt": graph}, timeout=10)
    assert refused.status_code == 400 and "'4x-UltraSharp.pth' not in (4x-Tiny)" in refused.text


def test_system_stats_and_queue_and_interrupt_speak_comfyuis_shapes_within_the_callers_share():
    pipe = FakeEngine(hold=True)
    pipe.dtype, pipe.compute_path = "bfloat16", "bfloat16, oneDNN (avx512_bf16)"
    with TestClient(fake_app(pipe, max_caller_requests=1)) as client:
        stats = client.get("/api/system_stats").json()
        assert stats["system"]["jax_sd_dtype"] == "bfloat16" and stats["system"]["argv"] == []
        assert stats["system"]["jax_sd_compute_path"].startswith("bfloat16") and stats["devices"][0]["name"] == "cpu:0"
        prompt_id = client.post("/api/prompt", json={"prompt": drawing()}).json()["prompt_id"]
        running = client.get("/queue").json()["queue_running"]
        assert [entry[1] for entry in running] == [prompt_id]
        over = client.post("/prompt", json={"prompt": drawing()})  # the caller's share, as at every door
        assert over.status_code == 429 and "busy with your requests" in over.json()["error"]["message"]
        assert client.post("/interrupt").json() == {} and pipe.tickets[-1].cancel_requested
        deadline = time.monotonic() + 10
        while prompt_id not in (history := client.get(f"/history/{prompt_id}").json()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        status = history[prompt_id]["status"]
        assert status["status_str"] == "error" and status["messages"][-1][0] == "execution_interrupted"
        assert client.get("/queue").json() == {"queue_running": [], "queue_pending": []}
        assert client.post("/prompt", json={"prompt": drawing()}).status_code == 200  # its share is free again


def test_an_anonymous_caller_is_refused_where_api_keys_are_set_and_a_callers_pictures_are_its_own():
    key, other = "comfy-key-1", "comfy-key-2"
    with ServedApp(fake_app(FakeEngine(), api_keys=[key, other])) as url:
        refused = requests.post(f"{url}/prompt", json={"prompt": drawing()}, timeout=10)
        assert refused.status_code == 401 and refused.json()["error"]["message"].startswith("Incorrect credentials")
        assert requests.get(f"{url}/api/object_info", timeout=10).status_code == 401

        async def anonymous_socket():
            async with aiohttp.ClientSession() as session:
                with pytest.raises(aiohttp.WSServerHandshakeError):
                    await session.ws_connect(f"{url.replace('http', 'ws')}/ws?clientId=x")

        asyncio.run(anonymous_socket())
        heard, picture = asyncio.run(open_webui_draws(url, drawing(), "owui-2", key=key))
        assert heard[-1]["data"]["node"] is None and picture.startswith(b"\x89PNG")
        image = next(m["data"]["output"]["images"][0] for m in heard if m["type"] == "executed")
        prompt_id = heard[-1]["data"]["prompt_id"]
        for who, found in ((key, 200), (other, 404)):
            headers = {"Authorization": f"Bearer {who}"}
            assert requests.get(f"{url}/view", params=image, headers=headers, timeout=10).status_code == found
            history = requests.get(f"{url}/history/{prompt_id}", headers=headers, timeout=10).json()
            assert (prompt_id in history) == (found == 200)


def test_an_upload_over_the_pixel_or_body_limit_is_refused_before_it_is_kept_and_the_next_is_served():
    from tests._api_server import png_claiming

    with TestClient(fake_app(FakeEngine(), max_body_mb=1)) as client:
        huge = client.post("/upload/image", files={"image": ("huge.png", png_claiming(20000, 20000))})
        assert huge.status_code == 400 and "image is too large" in huge.text, huge.text
        assert "huge.png" not in client.get("/object_info/LoadImage").text  # nothing was kept
        body = client.post("/api/upload/image", files={"image": ("big.png", b"\0" * (2 * 2**20))})
        assert body.status_code == 413, body.text
        small = client.post("/upload/image", files={"image": ("cat.png", png(Image.new("RGB", (8, 8))))})
        assert small.status_code == 200, small.text
        kept = client.get("/view", params={"filename": small.json()["name"], "type": "input"})
        assert kept.status_code == 200 and Image.open(io.BytesIO(kept.content)).size == (8, 8)
