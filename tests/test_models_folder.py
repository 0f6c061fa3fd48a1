"""A models folder in A1111's layout, served as several models: two tiny SD 1.x models (a diffusers folder and a
single file in the original layout), a LoRA, a truncated file. Each model draws what it draws served alone; a
request names its model (A1111's override_settings, OpenAI's model) or takes the default that `POST /options`
sets; two callers of different models at once each get their own model's pictures; a pool of one model evicts and
reloads; Open WebUI's and SillyTavern's model-switch call sequences (replayed from their sources) work; an unknown
or broken model is refused by name and the server goes on serving."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tiny_pipeline
import torch
import webuiapi
from _api_server import ServedApp
from PIL import Image
from safetensors.torch import save_file
from test_lora import write_loras
from test_single_file import to_original

import engine
import web
from engine.compat.pnginfo import png_info
from engine.loading import models_folder
from engine.loading.models_folder import HASH_CACHE, ModelsFolder, title_parts

# One picture at a time (every request here draws one): a warm-up then compiles its two guidance plans at the one
# width, not also both at a batch's width of two, which no request here runs and closing an engine waits for.
OPTIONS = dict(dtype="float32", safety_checker=False, previews=False, max_batch_size=1, sizes=None)
DRAW = dict(seed=3, num_inference_steps=2, guidance_scale=5.0, height=64, width=64, num_images=1, scheduler="ddim")
PROMPT = "a red circle on a blue background"
A1111 = dict(seed=3, steps=2, cfg_scale=5.0, width=64, height=64, sampler_name="DDIM", batch_size=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """MODELS/Stable-diffusion/{tiny-folder/, tiny-file.safetensors, broken.safetensors}, MODELS/Lora/style.safetensors;
    the single file's configs beside the folder, not in it."""
    root = tmp_path_factory.mktemp("models")
    os.environ[HASH_CACHE] = str(root.parent / f"{root.name}-hashes.json")  # never the user's own
    checkpoints = root / "Stable-diffusion"
    checkpoints.mkdir()
    pipe = tiny_pipeline.write("sd1", checkpoints / "tiny-folder")
    other = tiny_pipeline.build("sd1", seed=5)
    config = root.parent / f"{root.name}-config"
    other.save_pretrained(config, safe_serialization=True)
    save_file(to_original(other), checkpoints / "tiny-file.safetensors")
    whole = (checkpoints / "tiny-file.safetensors").read_bytes()
    (checkpoints / "broken.safetensors").write_bytes(whole[: len(whole) // 2])
    (root / "Lora").mkdir()
    loras = write_loras(pipe, root / "Lora", ("text_encoder",))
    shutil.move(loras["kohya"], root / "Lora" / "style.safetensors")
    (root / "Lora" / "peft.safetensors").unlink()
    yield root, config
    os.environ.pop(HASH_CACHE, None)


@pytest.fixture(scope="module")
def alone(models):
    """Each model's pictures served alone (load_pipeline), with and without the LoRA."""
    root, config = models
    sd = root / "Stable-diffusion"
    engine.enable_compile_cache()  # the session's: the pool's engines load what these compiled
    out = {}
    with_lora = engine.load_pipeline(
        sd / "tiny-folder", loras={"style": root / "Lora" / "style.safetensors"}, **OPTIONS
    )
    out["folder"] = with_lora.generate(PROMPT, lora_scales={"style": 0.0}, **DRAW).images[0]
    out["folder+style"] = with_lora.generate(PROMPT, lora_scales={"style": 0.8}, **DRAW).images[0]
    with_lora.close()
    single = engine.load_pipeline(sd / "tiny-file.safetensors", config=config, **OPTIONS)
    out["file"] = single.generate(PROMPT, **DRAW).images[0]
    single.close()
    return out


@pytest.fixture(scope="module")
def pool(models):
    root, config = models
    served = engine.load_models(root, max_loaded=2, config=config, **OPTIONS)
    yield served
    served.close()


def same(a: Image.Image, b: Image.Image) -> None:
    """Equal within 1/255 (the same programs on the same weights)."""
    np.testing.assert_allclose(np.asarray(a, np.int16), np.asarray(b, np.int16), atol=1)


def decoded(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def test_the_folder_is_listed_as_a1111_names_it(models):
    root, _ = models
    folder = ModelsFolder.open(root)
    sha = hashlib.sha256((root / "Stable-diffusion" / "tiny-file.safetensors").read_bytes()).hexdigest()
    file = folder.checkpoints[f"tiny-file.safetensors [{sha[:10]}]"]
    assert file.a1111() == {
        "title": f"tiny-file.safetensors [{sha[:10]}]",
        "model_name": "tiny-file",
        "hash": sha[:10],
        "sha256": sha,
        "filename": "Stable-diffusion/tiny-file.safetensors",
        "config": None,
    }
    assert [c.title for c in folder.usable()] == [file.title, "tiny-folder"]  # a diffusers folder has no hash
    assert "not a readable safetensors file" in folder.checkpoints["broken.safetensors"].problem
    for name in (file.title, "tiny-file.safetensors", "tiny-file", sha[:10], sha, "tiny-file.safetensors [0123456789]"):
        assert folder.match(name) is file, name
    with pytest.raises(
        engine.InvalidRequest,
        match=r"'nope' is not served here; this server offers 'tiny-file.safetensors \[\w+\]', 'tiny-folder'$",
    ):
        folder.match("nope")
    with pytest.raises(engine.InvalidRequest, match=r"'broken.safetensors' cannot be used: not a readable"):
        folder.match("broken")
    assert title_parts(file.title) == ("tiny-file", sha[:10])
    assert list(folder.loras) == ["style"] and folder.vaes == {}


def test_hashes_are_kept_so_a_start_reads_only_new_files(models, monkeypatch):
    root, _ = models
    kept = json.loads(Path(os.environ[HASH_CACHE]).read_text())
    sha = ModelsFolder.open(root).match("tiny-file").sha256
    assert [entry for entry, value in kept.items() if value == sha] == [
        f"{(root / 'Stable-diffusion' / 'tiny-file.safetensors').resolve()}|"
        f"{(root / 'Stable-diffusion' / 'tiny-file.safetensors').stat().st_size}|"
        f"{(root / 'Stable-diffusion' / 'tiny-file.safetensors').stat().st_mtime_ns}"
    ]
    monkeypatch.setattr(models_folder, "_sha256", lambda path: pytest.fail(f"{path} hashed again"))
    assert ModelsFolder.open(root).match("tiny-file").sha256 == sha


def test_each_model_draws_as_it_draws_alone(pool, alone):
    file = pool.generate(PROMPT, **DRAW)  # the default: the folder's first, as A1111 sorts it
    same(file.images[0], alone["file"])
    assert file.request.model == pool.models.match("tiny-file") == pool.models.default
    same(pool.generate(PROMPT, model="tiny-folder", **DRAW).images[0], alone["folder"])
    assert sorted(pool.loaded) == sorted(pool.models.titles())


def test_a_lora_of_the_folder_works_from_its_name_without_a_restart(pool, alone, models):
    root, _ = models
    styled = pool.generate(PROMPT, model="tiny-folder", lora_scales={"style": 0.8}, **DRAW).images[0]
    same(styled, alone["folder+style"])
    # Once added, a request that does not call it draws without it (A1111: a LoRA counts where it is called).
    same(pool.generate(PROMPT, model="tiny-folder", **DRAW).images[0], alone["folder"])
    shutil.copy(root / "Lora" / "style.safetensors", root / "Lora" / "copied.safetensors")  # after the start
    same(pool.generate(PROMPT, model="tiny-folder", lora_scales={"copied": 0.8}, **DRAW).images[0], styled)
    with pytest.raises(engine.InvalidRequest, match=r"unknown LoRA 'missing'; this server offers: copied, style"):
        pool.generate(PROMPT, lora_scales={"missing": 1.0}, **DRAW)


def test_one_model_at_a_time_evicts_the_idle_one_and_reloads(pool, alone):
    pool.max_loaded = 1
    try:
        loads = pool.loads
        same(pool.generate(PROMPT, model="tiny-file", **DRAW).images[0], alone["file"])
        deadline = time.monotonic() + 30
        while len(pool.loaded) > 1 and time.monotonic() < deadline:  # closed once its request has finished
            time.sleep(0.05)
        assert pool.loaded == [pool.models.match("tiny-file")]
        ticket = pool.submit(engine.GenerationRequest(PROMPT, model="tiny-folder", **DRAW))
        events = list(ticket.events(timeout=300))
        assert isinstance(events[0], engine.Loading) and events[0].model == "tiny-folder"  # it said why it waited
        assert isinstance(events[-1], engine.Finished), events[-1]
        same(events[-1].result.images[0], alone["folder"])
        assert pool.loaded == ["tiny-folder"] and pool.loads >= loads + 1
        # Two models asked for at once with room for one: the second waits for the first's request, then swaps in.
        tickets = [
            pool.submit(engine.GenerationRequest(PROMPT, model=name, **DRAW)) for name in ("tiny-file", "tiny-folder")
        ]
        same(tickets[0].result(timeout=300).images[0], alone["file"])
        same(tickets[1].result(timeout=300).images[0], alone["folder"])
        assert len(pool.loaded) == 1 and pool.loads >= loads + 3
    finally:
        pool.max_loaded = 2


@pytest.fixture(scope="module")
def server(pool):
    app = web.build_app(pool)
    with ServedApp(app) as url:
        yield url


def test_webuiapi_lists_switches_and_draws_with_each(server, pool, alone):
    host, port = server.removeprefix("http://").split(":")
    api = webuiapi.WebUIApi(host=host, port=int(port), sampler="DDIM", steps=2)
    draw = dict(A1111, eta=0.0)  # webuiapi sends eta 1.0 unless told (A1111's DDIM eta), the others none
    titles = api.util_get_model_names()
    assert titles == sorted(pool.models.titles())
    file_title = pool.models.match("tiny-file")
    api.util_set_model(file_title)  # a name of util_get_model_names, then set_options
    assert api.util_get_current_model() == file_title
    drawn = api.txt2img(prompt=PROMPT, **draw)
    same(drawn.image, alone["file"])
    params = png_info(drawn.image)
    assert params.model == "tiny-file" and params.extra["Model hash"] == file_title[-11:-1]
    assert drawn.info["sd_model_name"] == "tiny-file" and drawn.info["sd_model_hash"] == file_title[-11:-1]
    api.set_options({"sd_model_checkpoint": "tiny-folder"})
    same(api.txt2img(prompt=PROMPT, **draw).image, alone["folder"])
    # A request's own model wins over the default, and a prompt's <lora:> tag calls the folder's LoRA.
    named = api.txt2img(prompt=PROMPT, override_settings={"sd_model_checkpoint": file_title}, **draw)
    same(named.image, alone["file"])
    same(api.txt2img(prompt=f"{PROMPT} <lora:style:0.8>", **draw).image, alone["folder+style"])
    assert {item["name"] for item in api.get_loras()} >= {"style"}


def test_two_callers_of_different_models_at_once_get_their_own(server, alone):
    results = {}

    def call(name: str) -> None:
        body = dict(prompt=PROMPT, override_settings={"sd_model_checkpoint": name}, **A1111)
        results[name] = requests.post(f"{server}/sdapi/v1/txt2img", json=body, timeout=600)

    threads = [threading.Thread(target=call, args=(name,)) for name in ("tiny-folder", "tiny-file")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    same(decoded(results["tiny-folder"].json()["images"][0]), alone["folder"])
    same(decoded(results["tiny-file"].json()["images"][0]), alone["file"])


def test_openai_names_a_model_or_draws_with_the_default(server, pool, alone):
    listed = requests.get(f"{server}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in listed][0] == pool.models.default and len(listed) == 2
    body = dict(prompt=PROMPT, size="64x64", seed=3, num_inference_steps=2, guidance_scale=5.0, scheduler="ddim")
    for model, want in ((pool.models.match("tiny-file"), "file"), ("dall-e-3", None)):
        answer = requests.post(f"{server}/v1/images/generations", json=dict(body, model=model), timeout=600)
        want = want or ("folder" if pool.models.default == "tiny-folder" else "file")
        same(decoded(answer.json()["data"][0]["b64_json"]), alone[want])
    refused = requests.post(f"{server}/v1/images/generations", json=dict(body, model="nope"), timeout=30)
    assert refused.status_code == 400 and "this server offers" in refused.json()["error"]["message"]


def test_open_webui_switches_as_its_images_router_does(server, pool, alone):
    """open-webui backend/open_webui/routers/images.py: get_models, set_image_model, image_generations."""
    a1111 = f"{server}/sdapi/v1"
    models = [{"id": m["title"], "name": m["model_name"]} for m in requests.get(f"{a1111}/sd-models").json()]
    wanted = next(m["id"] for m in models if m["name"] == "tiny-file")
    options = requests.get(f"{a1111}/options").json()  # set_image_model: the whole options, sent back changed
    if wanted != options["sd_model_checkpoint"]:
        options["sd_model_checkpoint"] = wanted
        requests.post(f"{a1111}/options", json=options).raise_for_status()
    assert requests.get(f"{a1111}/options").json()["sd_model_checkpoint"] == wanted  # get_image_model
    data = {"prompt": PROMPT, "batch_size": 1, "width": 64, "height": 64, "steps": 2}
    data |= {"sampler_name": "DDIM", "cfg_scale": 5.0, "seed": 3}  # AUTOMATIC1111_PARAMS, as an admin sets them
    answer = requests.post(f"{a1111}/txt2img", json=data, timeout=600).json()
    same(decoded(answer["images"][0]), alone["file"])


def test_sillytavern_switches_as_its_stable_diffusion_endpoint_does(server, alone):
    """SillyTavern src/endpoints/stable-diffusion.js: /models, /get-model, /set-model (then /progress until idle),
    /generate (options read first, then txt2img)."""
    a1111 = f"{server}/sdapi/v1"
    titles = [m["title"] for m in requests.get(f"{a1111}/sd-models").json()]
    current = requests.get(f"{a1111}/options").json()["sd_model_checkpoint"]
    target = next(t for t in titles if t != current)
    assert requests.post(f"{a1111}/options", json={"sd_model_checkpoint": target}).ok
    for _ in range(10):
        progress = requests.get(f"{a1111}/progress").json()
        if progress["progress"] == 0.0 and progress["state"]["job_count"] == 0:
            break
    assert "forge_preset" not in requests.get(f"{a1111}/options").json()
    body = dict(prompt=PROMPT, negative_prompt="", **A1111)
    body |= {"override_settings": {"CLIP_stop_at_last_layers": 1}, "override_settings_restore_afterwards": True}
    answer = requests.post(f"{a1111}/txt2img", json=body, timeout=600).json()
    same(decoded(answer["images"][0]), alone["file" if target.startswith("tiny-file") else "folder"])


def test_an_unknown_or_broken_model_is_refused_by_name_and_the_next_is_served(server, models, alone):
    root, _ = models
    a1111 = f"{server}/sdapi/v1"
    # A whole safetensors of no checkpoint layout: listed after a rescan, refused when it is loaded, then unlisted.
    save_file({"not.a.model": torch.zeros(2)}, root / "Stable-diffusion" / "odd.safetensors")
    requests.post(f"{a1111}/refresh-checkpoints").raise_for_status()
    assert "odd" in [m["model_name"] for m in requests.get(f"{a1111}/sd-models").json()]
    odd = requests.post(f"{a1111}/txt2img", json=dict(prompt=PROMPT, override_settings={"sd_model_checkpoint": "odd"}))
    assert odd.status_code == 422 and "model 'odd.safetensors' cannot be used" in odd.text and "/tmp" not in odd.text
    assert "odd" not in [m["model_name"] for m in requests.get(f"{a1111}/sd-models").json()]
    refused = requests.post(f"{a1111}/options", json={"sd_model_checkpoint": "nope"})
    assert (
        refused.status_code == 422
        and "'nope' is not served here; this server offers 'tiny-file.safetensors [" in refused.text
    )
    body = dict(prompt=PROMPT, override_settings={"sd_model_checkpoint": "broken.safetensors"}, **A1111)
    broken = requests.post(f"{a1111}/txt2img", json=body)
    assert broken.status_code == 422 and "'broken.safetensors' cannot be used" in broken.text
    assert "/tmp" not in broken.text
    body["override_settings"] = {"sd_model_checkpoint": "tiny-folder"}
    same(decoded(requests.post(f"{a1111}/txt2img", json=body, timeout=600).json()["images"][0]), alone["folder"])


def test_the_pages_model_menu_sets_the_servers_default(pool):
    demo = web.build_app(pool).state.demo
    menu = next(c for c in demo.config["components"] if c["props"].get("elem_id") == "checkpoint")
    assert [choice[0] for choice in menu["props"]["choices"]] == pool.models.titles()
    change = next(fn for fn in demo.fns.values() if [block._id for block in fn.inputs] == [menu["id"]])
    before = pool.models.default
    other = next(title for title in pool.models.titles() if title != before)
    try:
        change.fn(other)
        assert pool.models.default == other
    finally:
        pool.models.set_default(before)


def test_the_command_line_serves_a_models_folder(monkeypatch, models, pool):
    import app

    root, _ = models
    seen = {}
    monkeypatch.setattr(pool, "start_warmup", lambda num_images: seen.setdefault("warmup", num_images))
    monkeypatch.setattr(app.engine, "enable_compile_cache", lambda path=None: None)
    monkeypatch.setattr(app.engine, "pair_cores", lambda dtype=None, int8=False: None)
    monkeypatch.setattr(
        app.engine, "load_models", lambda folder, **options: seen.update(options, folder=folder) or pool
    )
    monkeypatch.setattr(app.web, "build_app", lambda engine, **options: seen.setdefault("served", engine))
    monkeypatch.setattr(app.web, "serve", lambda web_app, **kwargs: None)
    app.main(["--models", str(root), "--model", "tiny-folder", "--max-loaded-models", "2", "--dtype", "float32"])
    assert seen["folder"] == str(root) and seen["default"] == "tiny-folder" and seen["max_loaded"] == 2
    assert seen["served"] is pool and seen["warmup"] == len(pool.devices) and seen["dtype"] == "float32"
    with pytest.raises(SystemExit):  # a LoRA comes from the folder's Lora/, called from the prompt
        app.main(["--models", str(root), "--lora", "style=style.safetensors"])


def test_a1111_progress_says_which_model_a_request_waits_for(server, pool, alone):
    a1111 = f"{server}/sdapi/v1"
    pool.max_loaded = 1  # the model asked for must wait for room: the other closes, then it loads
    try:
        kept = pool.generate(PROMPT, **DRAW).request.model  # the default; any other closes once idle
        deadline = time.monotonic() + 30
        while len(pool.loaded) > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        wanted = next(title for title in pool.models.titles() if title != kept)
        answer = {}
        body = dict(prompt=PROMPT, override_settings={"sd_model_checkpoint": wanted}, **A1111)
        call = threading.Thread(
            target=lambda: answer.update(r=requests.post(f"{a1111}/txt2img", json=body, timeout=600))
        )
        call.start()
        said = set()
        while call.is_alive():
            said.add(requests.get(f"{a1111}/progress").json()["textinfo"])
            time.sleep(0.02)
        name = wanted.split(" [")[0]
        assert f"Loading the model {name}." in said
        same(decoded(answer["r"].json()["images"][0]), alone["file" if name.startswith("tiny-file") else "folder"])
    finally:
        pool.max_loaded = 2


def test_a_warmed_up_default_makes_room_once_its_warm_up_is_done(pool, alone):
    pool.max_loaded = 1
    try:
        pool.start_warmup()  # as app.py starts: the default warms up; the others, loaded on demand, do not
        other = next(title for title in pool.models.titles() if title != pool.models.default)
        ticket = pool.submit(engine.GenerationRequest(PROMPT, model=other, **DRAW))
        want = alone["file" if other.startswith("tiny-file") else "folder"]
        same(ticket.result(timeout=300).images[0], want)  # closed once warmed up, never waited for forever
        back = pool.submit(engine.GenerationRequest(PROMPT, model=pool.models.default, **DRAW))
        same(back.result(timeout=300).images[0], alone["folder" if want is alone["file"] else "file"])
    finally:
        pool.max_loaded = 2
