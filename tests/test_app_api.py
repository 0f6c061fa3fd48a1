"""The web demo through its API.

Fast tests check the page's input handling against a stand-in engine; the end-to-end tests
start the real `app.py` on the embedded model and call it through `gradio_client`, as a
user's script would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from typing import Any

import gradio as gr
import numpy as np
import pytest
from PIL import Image

import app
import engine
from engine.compat.pnginfo import GenerationParameters, png_info, save_png
from engine.serving.warmup import Warmup
from tests._app_server import CONCURRENCY, QUEUE_SIZE, AppServer, shared_app
from tests.multidevice import xla_flags
from web import handlers, page, requests
from web.pictures import ClientFiles

# ---- fast: the page's logic over a stand-in engine ----------------------------------------


class FakeEngine:
    """The engine's public face, answering at once: tickets with progress, a preview, then plain pictures."""

    defaults = {"num_inference_steps": 4, "guidance_scale": 7.5, "height": 64, "width": 64, "scheduler": "ddim"}
    family = "sd"
    variant = engine.VARIANTS[0]  # text-to-image SD: every mode
    model_name = "fake"
    devices = ["cpu:0", "cpu:1"]
    batch_size = 4
    ready = True
    warmup_state = Warmup(seconds=1.0)
    example_prompts = ["a red circle on a blue background", "Armchair in the shape of an avocado"]
    limits = engine.Limits(
        schedulers=("pndm", "ddim"),
        side_multiple=8,
        max_side=1024,
        max_clip_skip=0,
        devices=2,
        sizes=((64, 64), (88, 64)),
        max_steps=50,
        max_deep_cache=10,
        max_token_merging=0.75,
    )

    def __init__(self, error: Exception | None = None):
        self.error = error
        self.calls: list[engine.GenerationRequest] = []

    def submit(self, request, caller=""):
        request = self.limits.resolve(request, self.defaults)
        self.calls.append(request)
        ticket = engine.Ticket(request, ["prompt: 100 tokens, encoded in 2 chunks of 75"])
        if isinstance(self.error, engine.InvalidRequest | engine.Busy):
            raise self.error
        if self.error is not None:
            ticket.emit(engine.Failed(self.error))
            return ticket
        steps = request.num_inference_steps
        ticket.emit(engine.Queued(1))
        for step in range(1, steps + 1):
            ticket.emit(engine.Progress(step, steps))
        ticket.emit(engine.Preview([np.zeros((8, 8, 3), np.uint8)]))
        n = request.num_images
        ticket.emit(
            engine.Finished(
                engine.GenerationResult(
                    images=[Image.new("RGB", (request.width, request.height)) for _ in range(n)],
                    seeds=request.image_seeds(),
                    devices=[self.devices[k % len(self.devices)] for k in range(n)],
                    timings={"queue_s": 0.0, "compile_s": 0.0, "run_s": 0.1, "total_s": 0.1},
                    compiled=False,
                    warnings=ticket.warnings,
                    request=request,
                )
            )
        )
        return ticket


class RecordingProgress:
    def __init__(self):
        self.updates = []

    def __call__(self, value, desc=None, unit="steps"):
        self.updates.append(value)


def page_values(**changes: Any) -> dict[str, Any]:
    values = {
        "prompt": "a cat",
        "negative_prompt": "",
        "seed": 7,
        "random_seed": False,
        "steps": 4,
        "guidance_scale": 7.5,
        "scheduler": "ddim",
        "size": "64x64",
        "images_per_device": 1,
    }
    values.update(changes)
    return values


def run(pipe, values, progress=None) -> list[tuple]:
    """Every update the handler streams to the page, in order."""

    async def collect():
        return [update async for update in page.run_generation(pipe, values, progress)]

    return asyncio.run(collect())


def test_parse_request_turns_page_values_into_a_request():
    request = requests.parse_request(
        FakeEngine(), **page_values(seed="12", steps=4.0, images_per_device=2, size="88x64")
    )
    assert request == engine.GenerationRequest(
        prompt="a cat",
        negative_prompt=None,  # an empty box means no negative prompt at all
        seed=12,
        num_inference_steps=4,
        guidance_scale=7.5,
        scheduler="ddim",
        width=88,
        height=64,
        num_images=4,  # two devices, two each
    )
    assert requests.parse_request(FakeEngine(), **page_values(negative_prompt=" blurry ")).negative_prompt == "blurry"
    assert requests.parse_request(FakeEngine(), **page_values(deep_cache="3")).deep_cache == 3
    assert requests.parse_request(FakeEngine(), **page_values(token_merging=0.5)).token_merging == 0.5


@pytest.mark.parametrize("unet", [True, False])
@pytest.mark.parametrize(
    ("label", "limit", "most"), [("Deep cache", "max_deep_cache", 10), ("Token merging", "max_token_merging", 0.75)]
)
def test_the_unet_speed_ups_show_only_where_the_model_has_unet_levels(unet, label, limit, most):
    pipe = FakeEngine()
    pipe.limits = dataclasses.replace(FakeEngine.limits, **{limit: most if unet else 0})
    demo = page.create_demo(pipe)
    (slider,) = [c["props"] for c in demo.config["components"] if c["props"].get("label", "").startswith(label)]
    assert slider["visible"] is unet and slider["value"] == 0
    if unet:
        assert slider["maximum"] == most


def test_the_hires_section_has_its_strength_and_the_picture_section_inpaintings_options():
    pipe = FakeEngine()
    pipe.limits = dataclasses.replace(FakeEngine.limits, upscalers=("Latent", "Lanczos"), sizes=None)
    shown = {c["props"].get("label"): c["props"] for c in page.create_demo(pipe).config["components"]}
    assert shown["Denoising strength"]["value"] == 0.7  # A1111's hires strength, no longer fixed
    assert shown["Mask blur (pixels; 0: a sharp edge)"]["value"] == 4  # A1111's page's blur
    assert shown["Only masked: draw the masked area at the full size, paste it back"]["value"] is False
    assert shown["Only masked padding (pixels)"]["value"] == 32
    values = page_values(hires_scale=2.0, hires_strength=0.35, mask_blur=8, inpaint_full_res=True, inpainting_fill=0)
    r = requests.parse_request(pipe, **values)
    assert (r.hires_strength, r.mask_blur, r.inpaint_full_res, r.inpainting_fill) == (0.35, 8, True, 0)
    assert pipe.limits.resolve(r, pipe.defaults).strength == 0.35  # the second pass's strength


def test_a_history_entry_saved_before_the_speed_ups_and_hires_fix_restores_them_off():
    old = dict(zip(handlers.FORM_FIELDS[:8], ["a cat", "", 7, 4, 7.5, "ddim", "64x64", 1], strict=True))
    assert handlers.FORM_FIELDS[8:] == (
        "deep_cache",
        "token_merging",
        "hires_scale",
        "hires_upscaler",
        "hires_steps",
        "hires_strength",
    )
    off = [0, 0.0, 0.0, "Latent", 0, None]  # hires_scale 0: no second pass (its strength: none, 0.7)
    assert handlers.restore([old], 0) == ["a cat", "", 7, 4, 7.5, "ddim", "64x64", 1, *off, False]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"prompt": "  "}, "Type a prompt"),
        ({"prompt": 5}, "Prompt must be text"),
        ({"seed": "abc"}, "Seed must be a whole number"),
        ({"seed": 1.5}, "Seed must be a whole number"),
        ({"seed": 2**32}, "seed must be a whole number from 0 to 4294967295"),
        ({"steps": 0}, "steps must be a whole number from 1 to 50"),
        ({"steps": 500}, "steps must be a whole number from 1 to 50"),
        ({"steps": "many"}, "Steps must be a whole number"),
        ({"guidance_scale": float("nan")}, "guidance scale must be a number from 0 to 30"),
        ({"guidance_scale": 31}, "guidance scale must be a number from 0 to 30"),
        ({"size": "100x100"}, "height must be a multiple of 8"),
        ({"size": "72x64"}, "size 72x64 is not offered here; choose one of 64x64, 88x64"),
        ({"size": "big"}, "Size must be written WIDTHxHEIGHT"),
        ({"scheduler": "magic"}, "unknown scheduler 'magic'"),
        ({"images_per_device": 0}, "Images per device must be from 1"),
        ({"prompt": "x" * 3000}, "prompt is too long"),
    ],
)
def test_bad_values_are_refused_with_the_engines_message(change, message):
    with pytest.raises(gr.Error, match=re.escape(message)):
        run(FakeEngine(), page_values(**change))


def test_random_seed_is_drawn_and_reported():
    pipe = FakeEngine()
    gallery, seed, info = run(pipe, page_values(random_seed=True))[-1]
    assert 0 <= seed < 2**32
    assert pipe.calls[0].seed == seed
    assert f"seed {seed} (random)" in info
    assert gallery[0][1] == f"cpu:0 · seed {seed}"


def test_the_page_streams_queue_position_previews_then_the_pictures():
    progress = RecordingProgress()
    updates = run(FakeEngine(), page_values(images_per_device=2), progress)
    assert "number 1 in line" in updates[0][2]
    preview, _, drawing = updates[1]
    assert preview[0][1] == "preview · step 4/4" and preview[0][0].size == (64, 64) and "Drawing" in drawing
    gallery, seed, info = updates[-1]
    assert [caption for _, caption in gallery] == [
        "cpu:0 · seed 7",
        "cpu:1 · seed 8",
        "cpu:0 · seed 9",
        "cpu:1 · seed 10",
    ]
    assert seed == 7
    assert progress.updates == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert "encoded in 2 chunks" in info


def test_engine_refusal_and_failure_become_messages():
    with pytest.raises(gr.Error) as refused:
        run(FakeEngine(engine.InvalidRequest("height 72 is not a multiple of 16")), page_values())
    assert refused.value.message == "height 72 is not a multiple of 16"
    with pytest.raises(gr.Error, match="server is busy"):
        run(FakeEngine(engine.Busy("the server is busy")), page_values())
    with pytest.raises(gr.Error, match="Generation failed: internal error [0-9a-f]{12}") as failed:
        run(FakeEngine(engine.GenerationFailed("out of memory")), page_values())
    assert "out of memory" not in failed.value.message  # the details are the log's (tests/test_safety_doors.py)


def test_a_model_with_its_own_examples_shows_only_those():
    # The embedded model draws shapes; "HAL-9000 in the style of Van Gogh" would only disappoint.
    assert page.example_prompts(FakeEngine()) == FakeEngine.example_prompts


@pytest.mark.parametrize("own", [None, [], ["", ""]])
def test_a_model_without_examples_shows_the_general_ones(own):
    engine = FakeEngine()
    engine.example_prompts = own
    assert page.example_prompts(engine) == page.EXAMPLE_PROMPTS
    assert len(set(page.EXAMPLE_PROMPTS)) == 8


def test_the_page_reads_its_ranges_and_sizes_from_the_engines_limits():
    demo = page.create_demo(FakeEngine())
    props = {c["props"].get("label"): c["props"] for c in demo.config["components"] if "label" in c["props"]}
    limits = FakeEngine.limits
    assert props["Steps"]["maximum"] == limits.max_steps
    assert (props["Guidance scale"]["minimum"], props["Guidance scale"]["maximum"]) == limits.guidance_range
    assert [choice[0] for choice in props["Size (width x height)"]["choices"]] == ["64x64", "88x64"]
    assert props["Images per device (2 devices)"]["maximum"] == limits.max_images_per_device


def test_demo_exposes_a_stable_api_name():
    demo = page.create_demo(FakeEngine())
    names = [fn.api_name for fn in demo.fns.values() if fn.api_visibility == "public"]
    assert names == [page.API_NAME]


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (
            [],
            {},
            {"model": None, "server_name": "127.0.0.1", "server_port": 7860, "share": False, "queue": 48}
            | {"max_batch_size": 8, "sizes": "common"},
        ),
        (
            ["--host", "0.0.0.0", "--port", "8080", "--share", "--queue-size", "3", "--max-batch-size", "16"]
            + ["--sizes", "512x512, 768x512"],
            {"MODEL_ID": "stable-diffusion-v1-5/stable-diffusion-v1-5"},
            {
                "model": "stable-diffusion-v1-5/stable-diffusion-v1-5",
                "server_name": "0.0.0.0",
                "server_port": 8080,
                "share": True,
                "queue": 3,
                "max_batch_size": 16,
                "sizes": [(512, 512), (768, 512)],
            },
        ),
        (["--model", "/models/sd15"], {"MODEL_ID": "ignored/by-the-flag"}, {"model": "/models/sd15"}),
        (
            ["--model", "/models/dreamshaper.safetensors", "--config", "/models/sd15", "--prediction-type", "epsilon"],
            {},
            {"model": "/models/dreamshaper.safetensors", "config": "/models/sd15", "prediction_type": "epsilon"},
        ),
        (
            ["--embeddings", "/models/embeddings", "--upscalers", "/models/ESRGAN"],
            {},
            {"embeddings": "/models/embeddings", "upscalers": "/models/ESRGAN"},
        ),
    ],
)
def test_server_configuration_comes_from_flags_and_environment(monkeypatch, argv, env, expected):
    for name in ("MODEL_ID", "GRADIO_SERVER_NAME", "GRADIO_SERVER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    seen = {}
    monkeypatch.setattr(app.engine, "enable_compile_cache", lambda path=None: seen.setdefault("cache", True))
    # Asked for in a real start; here it would change this test process's own JAX devices.
    monkeypatch.setattr(app.engine, "pair_cores", lambda dtype=None, int8=False: seen.setdefault("pairs", True))

    def load_pipeline(source=None, **serving):
        seen.update(model=source, **serving)
        fake = FakeEngine()
        fake.start_warmup = lambda num_images: seen.setdefault("warmup", num_images)
        return fake

    monkeypatch.setattr(app.engine, "load_pipeline", load_pipeline)
    queue = gr.Blocks.queue

    def record_queue(self, *args, **kwargs):
        if "max_size" in kwargs:  # Gradio also calls queue() itself, with no arguments
            seen["queue"] = kwargs["max_size"]
        return queue(self, *args, **kwargs)

    monkeypatch.setattr(gr.Blocks, "queue", record_queue)
    monkeypatch.setattr(app.web, "serve", lambda web_app, **kwargs: seen.update(kwargs))
    app.main(argv)
    assert seen["cache"] and seen["pairs"] and seen["warmup"] == 2  # one image on each of the two devices
    assert {key: seen[key] for key in expected} == expected


# ---- end to end: the real app on the embedded model, through gradio_client ---------------


@pytest.fixture(scope="module")
def client(request, tmp_path_factory):
    from gradio_client import Client

    server = shared_app(request, tmp_path_factory)
    yield Client(server.url, verbose=False, download_files=str(tmp_path_factory.mktemp("downloads")))


def arguments(client, **changes: Any) -> dict[str, Any]:
    """The page's defaults for every API parameter, a fixed seed, and `changes`."""
    api = client.view_api(return_format="dict", print_info=False)["named_endpoints"]["/generate"]
    defaults = {p["parameter_name"]: p["parameter_default"] for p in api["parameters"]}
    return {**defaults, "prompt": "a red circle on a blue background", "random_seed": False, **changes}


def call(client, **changes: Any):
    """One request, as `gradio_client` users write it."""
    return client.predict(**arguments(client, **changes), api_name="/generate")


def slider_maximum(client, label: str) -> int:
    return next(c["props"]["maximum"] for c in client.config["components"] if c["props"].get("label") == label)


@pytest.mark.slow
def test_api_returns_as_many_images_as_asked_with_their_seeds(client):
    gallery, seed, info = call(client, seed=1234, images_per_device=2)
    defaults = arguments(client)
    assert seed == 1234
    assert len(gallery) % 2 == 0 and gallery, gallery
    devices = len(gallery) // 2
    expected_seeds = [1234 + k for k in range(2 * devices)]
    assert [item["caption"].split(" · seed ")[1] for item in gallery] == [str(s) for s in expected_seeds]
    for item in gallery:
        with Image.open(item["image"]) as image:
            assert f"{image.size[0]}x{image.size[1]}" == defaults["size"]
            assert image.getextrema() != ((0, 0), (0, 0), (0, 0))  # not a blank picture
    assert f"{2 * devices} images" in info
    recipe = png_info(gallery[1]["image"])  # a downloaded picture remembers how it was made
    assert (recipe.prompt, recipe.seed, recipe.num_inference_steps) == (defaults["prompt"], 1235, defaults["steps"])


@pytest.mark.slow
def test_random_seed_reports_the_seed_it_used(client):
    gallery, seed, info = call(client, random_seed=True)
    assert 0 <= seed < 2**32
    assert gallery[0]["caption"].endswith(f"seed {seed}")
    assert f"seed {seed} (random)" in info


@pytest.mark.slow
def test_the_progress_bar_follows_the_denoising_steps(client):
    steps = slider_maximum(client, "Steps")  # long enough a run to watch
    job = client.submit(**arguments(client, steps=steps), api_name="/generate")
    seen = set()
    while not job.done():
        for unit in job.status().progress_data or []:
            if unit.desc == "Denoising" and unit.index is not None:
                seen.add((unit.index, unit.length))
        time.sleep(0.01)
    job.result()
    assert len(seen) >= 2, f"the bar did not move: {seen}"
    assert all(length >= steps and 0 < index <= length for index, length in seen), seen


@pytest.mark.slow
def test_changing_steps_guidance_seed_or_prompt_does_not_recompile(client):
    call(client, seed=1)  # the default shapes: compiled by the warm-up, at worst here
    _, _, info = call(client, prompt="a green square", seed=99, steps=3, guidance_scale=2.0)
    assert "compil" not in info, info


@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"steps": 100_000}, "steps must be a whole number from 1 to 150"),
        ({"seed": "not-a-number"}, "Seed must be a whole number"),
        ({"size": "100x100"}, "height must be a multiple of 8"),
        ({"size": "64x4096"}, "height must be a multiple of 8 from 64 to 1024"),
        ({"size": "72x72"}, "size 72x72 is not offered here; choose one of 64x64, 88x64"),
    ],
)
def test_bad_input_gets_a_clear_error_and_the_next_request_works(client, change, message):
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match=re.escape(message)):
        call(client, **change)
    gallery, _, _ = call(client, seed=5)
    assert gallery


@pytest.mark.slow
def test_a_full_queue_refuses_with_a_message_and_serving_goes_on(client):
    from gradio_client.utils import QueueError

    # CONCURRENCY requests run and QUEUE_SIZE wait; the longest allowed runs keep the queue full.
    slow = arguments(client, steps=slider_maximum(client, "Steps"))
    jobs = [client.submit(**{**slow, "seed": k}, api_name="/generate") for k in range(CONCURRENCY + QUEUE_SIZE + 4)]
    refused, served = [], 0
    for job in jobs:
        try:
            job.result(timeout=120)
            served += 1
        except QueueError as e:
            refused.append(str(e))
    assert served >= 1 and refused, (served, refused)
    assert all("Queue is full" in message for message in refused), refused
    gallery, _, _ = call(client, seed=6)
    assert gallery


@pytest.mark.slow
def test_the_compiled_program_is_kept_on_disk(client, request, tmp_path_factory):
    # A restart finds the engine's three programs (admit, advance, decode) in JAX's
    # persistent cache instead of compiling them again.
    call(client, seed=2)
    cache = shared_app(request, tmp_path_factory).cache_dir
    entries = sorted(p.name for p in cache.iterdir()) if cache.is_dir() else []
    for program in ("jit_admit", "jit_advance", "jit_decode_lanes"):
        assert any(name.startswith(program) for name in entries), f"{program} not in the persistent cache: {entries}"


@pytest.mark.slow
def test_one_picture_per_device_each_captioned_with_its_device(tmp_path):
    from gradio_client import Client

    # Two simulated CPU devices: the default request fills one slot on each.
    server = AppServer(tmp_path, env={"XLA_FLAGS": xla_flags(2)}).wait_until_up()
    try:
        client = Client(server.url, verbose=False, download_files=str(tmp_path / "downloads"))
        gallery, _, info = call(client, seed=40)
        assert [item["caption"] for item in gallery] == ["cpu:0 · seed 40", "cpu:1 · seed 41"], server.log_tail()
        assert "compil" not in info, "the warm-up compiled the default shapes for both devices"
    finally:
        server.stop()


def test_history_remembers_settings_and_a_thumbnail_and_restores_them(tmp_path):
    picture = tmp_path / "p.png"
    Image.new("RGB", (64, 64), "red").save(picture)
    form = ["a cat", "", 7, 4, 7.5, "ddim", "64x64", 1, 2, 0.5, 1.5, "Lanczos", 3, 0.45]  # hires fix's too
    kept = handlers.thumbnail(str(picture))  # the server's own result, never a picture the client names
    history, shown = handlers.remember([], kept, *form)
    other = ["a dog", "", 8, 4, 7.5, "ddim", "64x64", 1, 0, 0.0, 0.0, "Latent", 0, 0.7]
    history, shown = handlers.remember(history, kept, *other)
    assert [entry["prompt"] for entry in history] == ["a dog", "a cat"] and len(shown) == 2
    assert shown[1][0].size == (64, 64) and shown[1][1] == "seed 7"
    selected = gr.SelectData(None, {"index": 1, "value": None})
    assert page.restore(history, selected) == [*form, False]
    for _ in range(30):
        history, _ = handlers.remember(history, kept, *form)
    assert len(history) == handlers.HISTORY_LENGTH


def test_a_dropped_picture_fills_the_form_with_its_recipe(tmp_path):
    picture = tmp_path / "made-elsewhere.png"
    recipe = GenerationParameters(
        prompt="a cat, (masterpiece:1.2)",
        negative_prompt="blurry",
        num_inference_steps=30,
        scheduler="euler_a",
        guidance_scale=6.5,
        seed=1234,
        width=88,
        height=64,
        model="sd15",
        deep_cache=3,
        token_merging=0.4,
    )
    save_png(Image.new("RGB", (88, 64)), picture, recipe)
    *form, random_seed, note = page.read_png_info(
        FakeEngine(), str(picture), ClientFiles(10**6, upload_folder=tmp_path)
    )
    assert form[:6] == ["a cat, (masterpiece:1.2)", "blurry", 1234, 30, 6.5, "euler_a"]
    assert form[6] == "88x64" and random_seed is False and "seed 1234" in note
    form = dict(zip(handlers.FORM_FIELDS, form, strict=True))
    assert (form["deep_cache"], form["token_merging"]) == (3, 0.4)


def test_automatic1111s_own_text_fills_the_form_the_same_way(tmp_path):
    from PIL.PngImagePlugin import PngInfo

    text = (
        "a photo of a cat\nNegative prompt: ugly, blurry\n"
        "Steps: 20, Sampler: Euler a, CFG scale: 7, Seed: 5, Size: 88x64, Model hash: abc, Model: sd15"
    )
    info = PngInfo()
    info.add_text("parameters", text)
    picture = tmp_path / "a1111.png"
    Image.new("RGB", (88, 64)).save(picture, pnginfo=info)
    *form, random_seed, _ = page.read_png_info(FakeEngine(), str(picture), ClientFiles(10**6, upload_folder=tmp_path))
    assert form[:7] == ["a photo of a cat", "ugly, blurry", 5, 20, 7.0, "euler_a", "88x64"]


def test_a_picture_without_a_recipe_changes_nothing(tmp_path):
    picture = tmp_path / "plain.png"
    Image.new("RGB", (8, 8)).save(picture)
    *form, random_seed, note = page.read_png_info(
        FakeEngine(), str(picture), ClientFiles(10**6, upload_folder=tmp_path)
    )
    assert "carries no generation parameters" in note


ADAPTER_LABELS = ("Control picture", "Conditioning scale", "LoRA style weight", "LoRA detail weight")


class AdapterEngine(FakeEngine):
    """A server started with a ControlNet and two LoRAs."""

    controlnet = "tiny-controlnet"
    limits = dataclasses.replace(FakeEngine.limits, control=True, loras=("style", "detail"))

    def canny_image(self, image):
        return image.convert("L").convert("RGB")  # a stand-in: the real edge map is the engine's (tested there)


def test_the_page_shows_controlnet_and_lora_controls_only_when_the_server_loaded_them():
    def shown(pipe) -> dict[str, bool]:
        """Each control's label -> whether its accordion shows (a hidden accordion hides its children)."""
        components = page.create_demo(pipe).config["components"]
        accordions = {c["props"].get("label", "").split(":")[0].split(" ")[0]: c for c in components}
        return {
            label: label in {c["props"].get("label") for c in components}
            and accordions["ControlNet" if label in ADAPTER_LABELS[:2] else "LoRAs"]["props"].get("visible")
            is not False
            for label in ADAPTER_LABELS
        }

    assert shown(AdapterEngine()) == dict.fromkeys(ADAPTER_LABELS, True)
    assert not any(shown(FakeEngine()).values())
    api = page.create_demo(AdapterEngine()).get_api_info()["named_endpoints"]["/generate"]["parameters"]
    defaults = {p["parameter_name"]: p["parameter_default"] for p in api}
    assert defaults["lora_scales"] == {"style": 1.0, "detail": 1.0} and defaults["control_image"] is None
    assert defaults["canny_edges"] is False and defaults["controlnet_conditioning_scale"] == 1.0


def test_control_picture_canny_and_lora_weights_reach_the_request(tmp_path):
    pipe = AdapterEngine()
    picture = Image.new("RGB", (40, 30), (200, 30, 30))
    picture.save(tmp_path / "control.png")
    upload = Image.open(tmp_path / "control.png")  # as the page hands it on, once opened (tests/test_safety_paths.py)
    values = page_values(control_image=upload, canny_edges=True, controlnet_conditioning_scale=0.6)
    run(pipe, {**values, "lora_scales": {"style": 0.4}})
    request = pipe.calls[0]
    assert request.control_image.size == (40, 30) and request.control_image.getpixel((0, 0)) == (
        81,
        81,
        81,
    )  # grey: the stand-in edge map
    assert request.controlnet_conditioning_scale == 0.6 and request.lora_scales == {"style": 0.4, "detail": 1.0}
    run(pipe, page_values())  # an old API call: none of the new inputs
    assert pipe.calls[1].control_image is None and pipe.calls[1].lora_scales == {"style": 1.0, "detail": 1.0}
    with pytest.raises(gr.Error, match="unknown LoRA 'colour'; this server loaded: style, detail"):
        run(pipe, page_values(lora_scales={"colour": 1.0}))
    with pytest.raises(gr.Error, match="started without a ControlNet"):
        run(FakeEngine(), page_values(control_image=upload))


# ---- image to image and inpainting on the page ----------------------------------------------


def test_picture_modes_become_image_mask_and_strength():
    picture = Image.new("RGB", (88, 64), (200, 30, 30))
    stroke = Image.new("RGBA", (88, 64), (0, 0, 0, 0))
    stroke.paste((255, 255, 255, 255), (10, 10, 30, 40))
    editor = {"background": picture, "layers": [stroke], "composite": picture}
    pipe = FakeEngine()

    def request(mode, mask=None, strength=0.6):
        fields = requests.picture_fields(mode, editor, mask, strength)
        return pipe.limits.resolve(requests.parse_request(pipe, **page_values(), pictures=fields), pipe.defaults)

    assert request("Text to image").image is None
    img2img = request("Image to image")
    assert (img2img.image.size, img2img.mask_image, img2img.strength) == ((88, 64), None, 0.6)
    assert (img2img.width, img2img.height) == (88, 64)  # the picture's own size, not the size box's 64x64
    painted = request("Inpaint", strength=1.0).mask_image
    assert painted.size == (88, 64) and painted.getbbox() == (10, 10, 30, 40)  # the stroke, white
    uploaded = Image.new("L", (88, 64), 255)
    assert request("Inpaint", mask=uploaded).mask_image is uploaded  # an uploaded mask wins over the painting
    with pytest.raises(engine.InvalidRequest, match="Inpaint needs a mask"):
        requests.picture_fields("Inpaint", {"background": picture, "layers": []}, None, 1.0)
    with pytest.raises(engine.InvalidRequest, match="Image to image needs a picture"):
        requests.picture_fields("Image to image", None, None, 0.5)
    with pytest.raises(engine.InvalidRequest, match="Mode must be one of"):
        requests.picture_fields("Outpaint", editor, None, 0.5)


def test_the_api_keeps_its_old_parameters_first_and_the_picture_ones_have_defaults():
    demo = page.create_demo(FakeEngine())
    api = demo.get_api_info()["named_endpoints"]["/" + page.API_NAME]["parameters"]
    names = [p["parameter_name"] for p in api]
    assert names[:9] == ["prompt", "negative_prompt", "seed", "random_seed", "steps", "guidance_scale"] + [
        "scheduler",
        "size",
        "images_per_device",
    ]
    extra = {p["parameter_name"]: p for p in api[9:]}
    assert {"mode", "picture", "mask", "strength", "deep_cache", "token_merging"} <= set(extra)
    assert all(p["parameter_has_default"] for p in extra.values())
    assert extra["mode"]["parameter_default"] == "Text to image"


def test_the_web_app_serves_the_page_at_its_root_with_the_queue_and_log_in_asked_for():
    import web

    site = web.build_app(FakeEngine(), queue_size=3, auth=[("ann", "secret")], concurrency=5)
    demo = site.state.demo
    (mount,) = [route for route in site.routes if getattr(route, "path", None) == ""]  # "/" mounts as ""
    assert mount.app.get_blocks() is demo
    assert demo._queue.max_size == 3 and demo.auth == [("ann", "secret")] and not demo.show_error
    assert {fn.concurrency_limit for fn in demo.fns.values() if fn.api_name == page.API_NAME} == {5}


def test_the_status_line_and_a1111s_options_say_what_computes_the_pictures():
    from fastapi.testclient import TestClient

    import web

    class Computed(FakeEngine):
        dtype = "float32"
        compute_path = "float32, XLA (avx2)"

    assert "computed in float32, XLA (avx2)" in handlers.status_line(Computed())
    with TestClient(web.build_app(Computed())) as client:
        options = client.get("/sdapi/v1/options").json()
    assert (options["jax_sd_dtype"], options["jax_sd_compute_path"]) == ("float32", "float32, XLA (avx2)")
