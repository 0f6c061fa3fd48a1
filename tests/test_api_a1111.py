"""AUTOMATIC1111's API (/sdapi/v1) beside the page.

Fast tests drive the routes over a stand-in engine (tests/_api_server.py), through the real `webuiapi` client
against uvicorn on 127.0.0.1, or FastAPI's TestClient where only routing and parsing are in question. The slow
ones draw with the embedded model and check that a seed gives through the API the very picture the engine gives
for the same values.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import time

import pytest
import requests
import webuiapi
from fastapi.testclient import TestClient
from PIL import Image

import engine
import web
from engine.compat.pnginfo import png_info
from tests._api_server import (
    FakeEngine,
    ServedApp,
    b64png,
    decode_png,
    fake_app,
    max_pixel_difference,
    picture_colour,
    png_claiming,
    raw_http,
    shared_engine,
)

BODY = {"prompt": "a red circle", "seed": 5, "steps": 3, "width": 64, "height": 64}
INFO_KEYS = {"prompt", "negative_prompt", "seed", "all_seeds", "width", "height", "sampler_name", "cfg_scale", "steps"}
INFO_KEYS |= {"sd_model_name", "infotexts"}


@pytest.fixture(scope="module")
def fake():
    pipe = FakeEngine()
    with TestClient(fake_app(pipe)) as client:
        yield pipe, client


def client_for(url: str, **auth) -> webuiapi.WebUIApi:
    host, port = url.removeprefix("http://").split(":")
    return webuiapi.WebUIApi(host=host, port=int(port), sampler="Euler a", steps=3, **auth)


# ---- fast: the routes over a stand-in engine ------------------------------------------------------------


def test_txt2img_draws_batch_size_times_n_iter_pictures_with_consecutive_seeds():
    pipe = FakeEngine()
    with ServedApp(fake_app(pipe)) as url:
        result = client_for(url).txt2img(
            prompt="a red circle", negative_prompt="blurry", seed=5, batch_size=2, n_iter=2, width=64, height=64
        )
    assert len(result.images) == 4 and pipe.calls[-1].num_images == 4
    assert INFO_KEYS <= set(result.info) and result.info["all_seeds"] == [5, 6, 7, 8]
    assert result.info["sampler_name"] == "Euler a" and result.info["sd_model_name"] == "fake/model"
    for seed, image, text in zip(range(5, 9), result.images, result.info["infotexts"], strict=True):
        assert image.getpixel((0, 0)) == picture_colour(seed)
        params = png_info(image)  # each PNG carries its own recipe, as A1111's do
        assert params.seed == seed and params.negative_prompt == "blurry" and f"Seed: {seed}" in text
    assert result.parameters["batch_size"] == 2


@pytest.mark.parametrize(
    ("sampler", "scheduler", "kind"),
    [
        ("Euler a", "automatic", "euler_a"),
        ("DPM++ 2M", "Karras", "dpm++2m_karras"),
        ("DPM++ 2M", "Automatic", "dpm++2m_karras"),  # A1111's automatic schedule for DPM++ 2M is Karras
        ("DPM++ 2M", "uniform", "dpm++2m"),
        ("DPM++ 2M Karras", None, "dpm++2m_karras"),  # A1111 before 1.9
        ("k_euler", "normal", "euler"),  # an alias, and SillyTavern's default scheduler
        ("DDIM", None, "ddim"),
        ("LCM", "Automatic", "lcm"),
        (None, None, "ddim"),  # no sampler: the model's own default
    ],
)
def test_a1111_sampler_and_scheduler_names_pick_our_scheduler(fake, sampler, scheduler, kind):
    pipe, client = fake
    answer = client.post("/sdapi/v1/txt2img", json={**BODY, "sampler_name": sampler, "scheduler": scheduler})
    assert answer.status_code == 200, answer.text
    assert pipe.calls[-1].scheduler == kind


def test_clip_skip_lora_tags_and_unknown_fields(fake):
    pipe, client = fake
    body = {  # as SillyTavern sends it: A1111's override and SD.Next's field, hires fix off, fields we never read
        **BODY,
        "prompt": "a red circle <lora:style:0.5>, bright",
        "override_settings": {"CLIP_stop_at_last_layers": 2, "sd_vae": None},
        "clip_skip": 2,
        "enable_hr": False,
        "restore_faces": False,
        "save_images": True,
        "alwayson_scripts": {},
    }
    assert client.post("/sdapi/v1/txt2img", json=body).status_code == 200
    request = pipe.calls[-1]
    assert request.clip_skip == 1 and request.lora_scales == {"style": 0.5}
    assert request.prompt == "a red circle , bright"
    merged = {**BODY, "override_settings": {"token_merging_ratio": 0.5}}  # A1111's own ToMe setting
    assert client.post("/sdapi/v1/txt2img", json=merged).status_code == 200 and pipe.calls[-1].token_merging == 0.5
    seeded = client.post("/sdapi/v1/txt2img", json={**BODY, "seed": -1}).json()
    assert 0 <= json.loads(seeded["info"])["seed"] < engine.SEED_LIMIT


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"steps": 0}, "steps must be a whole number from 1 to 50, got 0"),
        ({"width": 72}, "size 72x64 is not offered here; choose one of 64x64, 88x64"),
        ({"prompt": "x" * 10_000}, "prompt is too long (10000 characters; at most 2000)"),
        ({"sampler_name": "Heun"}, "unknown sampler 'Heun'; this server offers: PLMS, DDIM, Euler, Euler a, DPM++ 2M"),
        ({"sampler_name": "Euler a", "scheduler": "Karras"}, "sampler 'Euler a' has no Karras schedule here"),
        ({"scheduler": "exponential", "sampler_name": "Euler"}, "unknown scheduler 'exponential'"),
        ({"batch_size": 0}, "batch_size and n_iter must be at least 1"),
        ({"prompt": "<lora:nope:1>"}, "unknown LoRA 'nope'; this server loaded: style"),
        ({"override_settings": {"sd_model_checkpoint": "v1-5.safetensors [6ce0161689]"}}, "is not served here"),
        ({"steps": "many"}, "steps: Input should be a valid integer"),
    ],
)
def test_bad_txt2img_values_are_refused_with_a_message_and_the_next_call_is_served(fake, change, message):
    pipe, client = fake
    drawn = len(pipe.calls)
    answer = client.post("/sdapi/v1/txt2img", json={**BODY, **change})
    assert answer.status_code == 422 and message in answer.json()["detail"], answer.text
    assert len(pipe.calls) == drawn  # nothing drawn
    assert client.post("/sdapi/v1/txt2img", json=BODY).status_code == 200


def test_img2img_and_inpainting_read_init_images_and_masks(fake):
    pipe, client = fake
    picture = Image.new("RGB", (64, 64), (10, 20, 30))
    body = {**BODY, "init_images": [b64png(picture, data_url=True)], "denoising_strength": 0.6}
    assert client.post("/sdapi/v1/img2img", json=body).status_code == 200
    request = pipe.calls[-1]
    assert request.image.getpixel((0, 0)) == (10, 20, 30) and request.strength == 0.6 and request.mask_image is None
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (0, 0, 32, 64))  # white: repaint
    answer = client.post("/sdapi/v1/img2img", json={**body, "mask": b64png(mask)})
    assert answer.status_code == 200 and json.loads(answer.json()["info"])["is_using_inpainting_conditioning"]
    assert pipe.calls[-1].mask_image.getpixel((0, 0)) == 255 and pipe.calls[-1].mask_image.getpixel((63, 0)) == 0
    assert answer.json()["parameters"]["init_images"] is None  # not echoed back unless include_init_images
    client.post("/sdapi/v1/img2img", json={**body, "mask": b64png(mask), "inpainting_mask_invert": 1})
    assert pipe.calls[-1].mask_image.getpixel((0, 0)) == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"init_images": ["data:image/png;base64,%%%not base64"]}, "init_images[0] is not valid base64"),
        ({"init_images": [base64.b64encode(b"plain text").decode()]}, "init_images[0] could not be read as a picture"),
        ({"init_images": [base64.b64encode(png_claiming(20000, 20000)).decode()]}, "init_images[0] is too large"),
        (
            {"init_images": [base64.b64encode(png_claiming(5000, 1000)).decode()]},
            "is 5000x1000 pixels; at most 4194304",
        ),
        ({"mask": b64png(Image.new("L", (32, 32)))}, "mask_image is 32x32 but image is 64x64"),
        ({"init_images": []}, "img2img needs init_images"),
    ],
)
def test_bad_pictures_are_refused_before_their_pixels_are_read(fake, change, message):
    pipe, client = fake
    body = {**BODY, "init_images": [b64png(Image.new("RGB", (64, 64)))], **change}
    answer = client.post("/sdapi/v1/img2img", json=body)
    assert answer.status_code == 422 and message in answer.json()["detail"], answer.text
    assert client.post("/sdapi/v1/txt2img", json=BODY).status_code == 200


def test_models_samplers_options_and_the_empty_lists_through_webuiapi():
    pipe = FakeEngine()
    with ServedApp(fake_app(pipe)) as url:
        api = client_for(url)
        assert api.util_get_model_names() == ["fake/model"] and api.util_get_current_model() == "fake/model"
        assert "Euler a" in api.util_get_sampler_names() and "DPM++ 2M" in api.util_get_sampler_names()
        assert api.util_get_scheduler_names() == ["automatic", "karras", "uniform"]
        assert [lora["name"] for lora in api.get_loras()] == ["style"]
        assert api.get_upscalers() == [] and api.get_sd_vae() == [] and api.get_latent_upscale_modes() == []
        assert api.get_scripts() == {"txt2img": [], "img2img": []}
        assert api.get_embeddings() == {"loaded": {}, "skipped": {}}
        assert api.set_options({"sd_model_checkpoint": "fake/model", "CLIP_stop_at_last_layers": 2}) is None
        other = requests.post(f"{url}/sdapi/v1/options", json={"sd_model_checkpoint": "sdxl.safetensors"})
        assert other.status_code == 422 and "does not switch models" in other.json()["detail"]
        assert api.get_options()["sd_model_checkpoint"] == "fake/model"  # never switched
        idle = api.get_progress()
        assert idle["progress"] == 0 and idle["state"]["job_count"] == 0


def test_progress_and_interrupt_concern_the_callers_own_requests():
    pipe = FakeEngine(hold=True)
    app = fake_app(pipe, auth=[("ann", "secret-a"), ("bob", "secret-b")])
    with ServedApp(app) as url, concurrent.futures.ThreadPoolExecutor(2) as pool:
        ann, bob = (
            client_for(url, username="ann", password="secret-a"),
            client_for(url, username="bob", password="secret-b"),
        )
        drawing = pool.submit(ann.txt2img, prompt="a red circle", seed=3, steps=10, width=64, height=64)
        other = pool.submit(bob.txt2img, prompt="a blue square", seed=4, steps=10, width=64, height=64)
        deadline = time.monotonic() + 20
        while len(pipe.tickets) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        progress = ann.get_progress()
        assert progress["state"]["job_count"] == 1 and progress["state"]["sampling_steps"] == 10
        assert progress["state"]["sampling_step"] == 1 and 0 < progress["progress"] < 1
        assert decode_png(progress["current_image"]).size == (64, 64)  # the preview, at the picture's size
        skipped = requests.get(f"{url}/sdapi/v1/progress?skip_current_image=true", auth=("ann", "secret-a")).json()
        assert skipped["current_image"] is None
        assert ann.interrupt() == {}
        result = drawing.result(timeout=20)  # A1111 answers an interrupted request with what it has: none here
        assert result.images == [] and result.info["interrupted"] is True
        assert not other.done() and bob.get_progress()["state"]["job_count"] == 1  # bob's request still runs
        bob.interrupt()
        assert other.result(timeout=20).images == []
        assert ann.get_progress()["state"]["job_count"] == 0


def test_open_webuis_call_sequence():
    """Open WebUI's automatic1111 engine (backend/open_webui/routers/images.py): it reads the model from
    /options, lists /sd-models, writes the whole options dict back with its model, then posts txt2img with
    prompt, batch_size, width, height, steps and negative_prompt; an empty `authorization` without api_auth."""
    pipe = FakeEngine()
    with TestClient(fake_app(pipe)) as client:
        headers = {"authorization": ""}
        options = client.get("/sdapi/v1/options", headers=headers).json()
        models = client.get("/sdapi/v1/sd-models", headers=headers).json()
        chosen = models[0]["title"]
        assert options["sd_model_checkpoint"] == chosen
        assert client.post("/sdapi/v1/options", json={**options, "sd_model_checkpoint": chosen}).status_code == 200
        body = {"prompt": "a red circle", "batch_size": 2, "width": 88, "height": 64, "steps": 3, "negative_prompt": ""}
        answer = client.post("/sdapi/v1/txt2img", json=body, headers=headers)
    assert answer.status_code == 200
    images = [decode_png(text) for text in answer.json()["images"]]
    assert [image.size for image in images] == [(88, 64)] * 2
    assert pipe.calls[-1].negative_prompt is None and pipe.calls[-1].scheduler == "ddim"


def test_a_full_queue_and_a_failed_drawing_answer_at_once():
    with TestClient(fake_app(FakeEngine(error=engine.Busy("the queue is full; try again in a moment")))) as client:
        answer = client.post("/sdapi/v1/txt2img", json=BODY)
    assert answer.status_code == 503 and answer.json()["detail"] == "the queue is full; try again in a moment"
    assert answer.headers["retry-after"]
    with TestClient(fake_app(FakeEngine(error=engine.GenerationFailed("the picture diverged (NaN)")))) as client:
        answer = client.post("/sdapi/v1/txt2img", json=BODY)
    assert answer.status_code == 500 and answer.json()["detail"].startswith("internal error ")
    assert "diverged" not in answer.text  # the details are the log's (tests/test_safety_doors.py)


def test_bodies_over_the_limit_are_refused_before_they_are_read():
    pipe = FakeEngine()
    with ServedApp(fake_app(pipe, max_body_mb=1)) as url:
        port = int(url.rsplit(":", 1)[1])
        head = "POST /sdapi/v1/txt2img HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        status, text = raw_http(port, head + f"Content-Length: {50 * 2**20}\r\n\r\n", [b'{"prompt": "'])
        assert status == 413 and "over this server's limit of 1 MB" in text  # said by its header: 50 MB never sent
        chunk = b"x" * 2**16
        chunks = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * (2**20 // len(chunk) + 2)  # no length: counted as it comes
        status, text = raw_http(port, head + "Transfer-Encoding: chunked\r\n\r\n", chunks)
        assert status == 413 and "--max-body-mb" in text
        assert requests.post(f"{url}/sdapi/v1/txt2img", json=BODY, timeout=20).status_code == 200
    assert len(pipe.calls) == 1


def test_auth_closes_the_api_to_anonymous_and_wrong_credentials():
    pipe = FakeEngine()
    app = fake_app(pipe, auth=[("ann", "secret-a")], api_keys=["sk-jaxsd-key-1"])
    with TestClient(app) as client:
        for auth in (None, ("ann", "wrong"), ("bob", "secret-a")):
            answer = client.post("/sdapi/v1/txt2img", json=BODY, auth=auth)
            assert answer.status_code == 401 and answer.headers["www-authenticate"].startswith("Basic")
        assert client.get("/sdapi/v1/sd-models").status_code == 401
        assert pipe.calls == []  # nothing drawn
        assert client.post("/sdapi/v1/txt2img", json=BODY, auth=("ann", "secret-a")).status_code == 200
        assert client.post("/sdapi/v1/txt2img", json=BODY, auth=("anyone", "sk-jaxsd-key-1")).status_code == 200
        bearer = {"Authorization": "Bearer sk-jaxsd-key-1"}
        assert client.get("/sdapi/v1/sd-models", headers=bearer).status_code == 200


def test_an_api_key_alone_closes_the_api_and_leaves_the_page_open():
    with TestClient(fake_app(FakeEngine(), api_keys=["sk-jaxsd-key-1"])) as client:
        assert client.get("/sdapi/v1/options").status_code == 401
        assert client.get("/sdapi/v1/options", auth=("u", "sk-jaxsd-key-1")).status_code == 200
        assert client.get("/").status_code == 200  # the page, as before
    with TestClient(fake_app(FakeEngine())) as client:  # neither: open, whatever Authorization says
        assert client.get("/sdapi/v1/options", headers={"Authorization": "Basic dW5kZWZpbmVk"}).status_code == 200


def test_api_keys_are_read_from_a_list_or_a_file(tmp_path):
    assert web.read_api_keys("sk-aaaaaaaa, sk-bbbbbbbb") == ["sk-aaaaaaaa", "sk-bbbbbbbb"]
    (tmp_path / "keys").write_text("# ours\nsk-cccccccc\n\nsk-dddddddd\n")
    assert web.read_api_keys(f"@{tmp_path / 'keys'}") == ["sk-cccccccc", "sk-dddddddd"]
    assert web.read_api_keys(None) is None
    with pytest.raises(ValueError, match="at least 8 characters"):
        web.read_api_keys("short")


def test_the_command_line_hands_the_api_keys_and_the_body_limit_to_the_app(monkeypatch):
    import app

    seen = {}
    pipe = FakeEngine()
    pipe.start_warmup = lambda num_images: None
    monkeypatch.setattr(app.engine, "enable_compile_cache", lambda path=None: None)
    monkeypatch.setattr(app.engine, "pair_cores", lambda dtype=None, int8=False: None)
    monkeypatch.setattr(app.engine, "load_pipeline", lambda source=None, **serving: pipe)
    monkeypatch.setattr(app.web, "build_app", lambda engine, **options: seen.update(options))
    monkeypatch.setattr(app.web, "serve", lambda web_app, **kwargs: None)
    monkeypatch.setenv("JAX_SD_API_KEY", "sk-env-key-1,sk-env-key-2")
    app.main(["--max-body-mb", "5"])
    assert seen["api_keys"] == ["sk-env-key-1", "sk-env-key-2"] and seen["max_body_mb"] == 5
    with pytest.raises(SystemExit):
        app.main(["--api-key", "short"])


# ---- slow: the embedded model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(request, tmp_path_factory):
    pipe = shared_engine(request, tmp_path_factory)
    with ServedApp(web.build_app(pipe)) as url:
        yield pipe, url


def direct(pipe, **values) -> list[Image.Image]:
    fields = dict(num_inference_steps=4, guidance_scale=7.0, width=64, height=64, scheduler="euler_a")
    return pipe.submit(engine.GenerationRequest(**{**fields, **values})).result(timeout=300).images


@pytest.mark.slow
def test_a_seed_draws_through_webuiapi_the_pictures_the_engine_draws(served):
    pipe, url = served
    api = client_for(url)
    result = api.txt2img(prompt="a yellow star", seed=11, steps=4, cfg_scale=7, width=64, height=64, batch_size=2)
    expected = direct(pipe, prompt="a yellow star", seed=11, num_images=2)
    assert [max_pixel_difference(a, b) for a, b in zip(result.images, expected, strict=True)] == [0, 0]

    start = expected[0]
    mask = Image.new("L", (64, 64), 0)
    mask.paste(255, (0, 0, 32, 64))
    moved = api.img2img(images=[start], prompt="a purple star", seed=12, steps=4, cfg_scale=7, width=64, height=64)
    same = direct(pipe, prompt="a purple star", seed=12, image=start, strength=0.75)[0]  # webuiapi sends 0.75
    assert max_pixel_difference(moved.image, same) <= 1
    painted = api.img2img(
        images=[start], mask_image=mask, prompt="a purple star", seed=13, steps=4, cfg_scale=7, width=64, height=64
    )
    a1111 = dict(mask_blur=4, inpaint_full_res=True, inpaint_full_res_padding=0, inpainting_fill=0)  # webuiapi's
    same = direct(pipe, prompt="a purple star", seed=13, image=start, mask_image=mask, strength=0.75, **a1111)[0]
    assert max_pixel_difference(painted.image, same) <= 1


@pytest.mark.slow
def test_concurrent_api_calls_mixed_with_page_users_end_in_pictures_or_a_clear_busy_answer(
    request, tmp_path_factory, tmp_path, served
):
    from gradio_client import Client

    shared_engine(request, tmp_path_factory)  # the compile cache is set: this engine loads its programs from disk
    pipe = engine.load_pipeline(max_batch_size=2, max_waiting=3)
    a1111 = {
        "prompt": "a yellow star",
        "steps": 4,
        "cfg_scale": 7,
        "width": 64,
        "height": 64,
        "sampler_name": "Euler a",
    }
    openai = {"prompt": "a yellow star", "num_inference_steps": 4, "guidance_scale": 7, "size": "64x64"}

    def api_call(k):  # 32 calls, half through each API
        if k % 2:
            return requests.post(f"{url}/v1/images/generations", json={**openai, "seed": k}, timeout=240)
        return requests.post(f"{url}/sdapi/v1/txt2img", json={**a1111, "seed": k}, timeout=240)

    def page_user(k):  # 4 people on the page at the same time
        client = Client(f"{url}/", verbose=False, download_files=str(tmp_path / f"user{k}"))
        try:
            gallery, seed, _ = client.predict(
                prompt="a red circle", seed=k, random_seed=False, steps=4, size="64x64", api_name="/generate"
            )
            return len(gallery)
        except Exception as error:  # gradio_client raises the page's refusal
            return str(error)

    try:
        with ServedApp(web.build_app(pipe)) as url, concurrent.futures.ThreadPoolExecutor(36) as pool:
            users = [pool.submit(page_user, k) for k in range(4)]
            answers = list(pool.map(api_call, range(32), timeout=300))
            pages = [user.result(timeout=300) for user in users]
    finally:
        pipe.close()
    drawn = [a for a in answers if a.status_code == 200]
    busy = [a for a in answers if a.status_code == 503]
    assert len(drawn) + len(busy) == 32 and drawn, [a.text for a in answers]
    for answer in drawn:
        assert len(answer.json().get("images") or answer.json().get("data")) == 1
    for answer in busy:
        body = answer.json()
        assert "the server is busy" in (body.get("detail") or body["error"]["message"])
    assert all(page == 1 or "busy" in str(page) for page in pages), pages
