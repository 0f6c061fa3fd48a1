"""jax-sd web demo: a Gradio Blocks page over the engine.

UI only: widgets, input checks with readable messages, and the gallery. Everything that
touches the model lives in `engine/`. The model comes from the server's configuration
(`--model` or `MODEL_ID`), never from the page.

    python app.py                                   # embedded default model, 127.0.0.1:7860
    python app.py --model stable-diffusion-v1-5/stable-diffusion-v1-5 --host 0.0.0.0
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import gradio as gr

import engine

log = logging.getLogger("jax-sd")

API_NAME = "generate"  # gradio_client: Client(url).predict(..., api_name="/generate")
MAX_SEED = 2**32 - 1
MAX_PROMPT_CHARS = 2000  # the text encoder sees 77 tokens; this only stops absurd payloads
MAX_IMAGES_PER_DEVICE = 8
GUIDANCE_RANGE = (0.0, 30.0)

EXAMPLE_PROMPTS = [
    "Labrador in the style of Hokusai",
    "Painting of a squirrel skating in New York",
    "HAL-9000 in the style of Van Gogh",
    "Times Square under water, with fish and a dolphin swimming around",
    "Ancient Roman fresco showing a man working on his laptop",
    "Close-up photograph of young black woman against urban background, high quality, bokeh",
    "Armchair in the shape of an avocado",
    "Clown astronaut in space, with Earth in the background",
]

# System fonts only: the page must render offline, and a Space needs no font download either.
THEME = gr.themes.Soft(
    font=["ui-sans-serif", "system-ui", "sans-serif"],
    font_mono=["ui-monospace", "monospace"],
)


class Warmup:
    """Compiles the default shapes in a background thread while the page is already up.

    Requests that arrive before it finishes wait for it, so the first user never triggers a
    second, concurrent compilation of the same shapes.
    """

    def __init__(self, pipe: Any, num_images: int | None = None):
        self._pipe = pipe
        self._num_images = num_images
        self._done = threading.Event()
        self.seconds: float | None = None
        self.error: str | None = None

    def start(self) -> Warmup:
        threading.Thread(target=self._run, name="jax-sd-warmup", daemon=True).start()
        return self

    def _run(self) -> None:
        try:
            self.seconds = float(self._pipe.warmup(num_images=self._num_images))
            log.info("warm-up finished in %.1f s", self.seconds)
        except Exception as e:  # the first request compiles instead; the server stays up
            self.error = f"{type(e).__name__}: {e}"
            log.exception("warm-up failed")
        finally:
            self._done.set()

    @property
    def ready(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)


def example_prompts(pipe: Any) -> list[str]:
    """The model's own examples when it ships some (a small model knows what it can draw), else ours."""
    prompts = [p for p in getattr(pipe, "example_prompts", None) or [] if p]
    return list(dict.fromkeys(prompts or EXAMPLE_PROMPTS))


def size_range(pipe: Any) -> tuple[int, int]:
    return 64, (2048 if pipe.family == "sdxl" else 1024)


def model_summary(pipe: Any) -> str:
    """The model's family and the settings the page starts from, which follow the model (Turbo: 1 step, no guidance)."""
    d = pipe.defaults
    family = getattr(pipe, "label", None) or pipe.family
    return (
        f"**{family}** · defaults: {d['width']}×{d['height']}, {d['num_inference_steps']} steps, "
        f"guidance {d['guidance_scale']:g}, {d['scheduler']}"
    )


# ---- input checks: raw values in (the API sends anything), engine arguments out ----------


def _refuse(message: str) -> gr.Error:
    # An expected refusal, shown to the user; not a server fault, so no traceback in the log.
    return gr.Error(message, print_exception=False)


def _as_int(value: Any, what: str, low: int, high: int) -> int:
    try:
        number = float(str(value).strip()) if isinstance(value, str) else float(value)
    except (TypeError, ValueError):
        raise _refuse(f"{what} must be a whole number from {low} to {high}, not {value!r}.") from None
    if not math.isfinite(number) or number != int(number):
        raise _refuse(f"{what} must be a whole number from {low} to {high}, not {value!r}.")
    if not low <= number <= high:
        raise _refuse(f"{what} must be from {low} to {high}; {int(number)} is out of range.")
    return int(number)


def _as_float(value: Any, what: str, low: float, high: float) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise _refuse(f"{what} must be a number from {low:g} to {high:g}, not {value!r}.") from None
    if not (math.isfinite(number) and low <= number <= high):
        raise _refuse(f"{what} must be from {low:g} to {high:g}; {number:g} is out of range.")
    return number


def _as_text(value: Any, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _refuse(f"{what} must be text.")
    if len(value) > MAX_PROMPT_CHARS:
        raise _refuse(f"{what} is too long ({len(value)} characters; at most {MAX_PROMPT_CHARS}).")
    return value.strip()


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes", "on")
    return bool(value)


def parse_request(
    pipe: Any,
    prompt: Any,
    negative_prompt: Any,
    seed: Any,
    random_seed: Any,
    steps: Any,
    guidance_scale: Any,
    scheduler: Any,
    width: Any,
    height: Any,
    images_per_device: Any,
) -> dict[str, Any]:
    """Checks the page's (or an API client's) values; returns keyword arguments for `generate`."""
    prompt = _as_text(prompt, "Prompt")
    if not prompt:
        raise _refuse("Type a prompt first.")
    if _as_bool(random_seed) or (isinstance(seed, str) and seed.strip().lower() in ("", "random")):
        seed = secrets.randbelow(MAX_SEED + 1)
    else:
        seed = _as_int(seed, "Seed", 0, MAX_SEED)
    low, high = size_range(pipe)
    size = {}
    for name, value in (("Width", width), ("Height", height)):
        size[name] = _as_int(value, name, low, high)
        if size[name] % 8:
            raise _refuse(f"{name} must be a multiple of 8 pixels; {size[name]} is not.")
    if scheduler not in pipe.schedulers:
        raise _refuse(f"Unknown scheduler {scheduler!r}; choose one of {', '.join(pipe.schedulers)}.")
    per_device = _as_int(images_per_device, "Images per device", 1, MAX_IMAGES_PER_DEVICE)
    return {
        "prompt": prompt,
        "negative_prompt": _as_text(negative_prompt, "Negative prompt"),
        "seed": seed,
        "num_inference_steps": _as_int(steps, "Steps", 1, pipe.max_steps),
        "guidance_scale": _as_float(guidance_scale, "Guidance scale", *GUIDANCE_RANGE),
        "scheduler": scheduler,
        "width": size["Width"],
        "height": size["Height"],
        "num_images": per_device * len(pipe.devices),
    }


# ---- one generation ----------------------------------------------------------------------


def _call_with_progress(run: Callable[[Callable[[int, int], None]], Any], progress: Any) -> Any:
    """Runs `run(callback)` in a worker thread and forwards its step reports to Gradio.

    The engine may report steps from a thread of its own; Gradio's progress tracker only works
    in the request's thread, so the reports travel through a queue.
    """
    updates: queue.Queue = queue.Queue()
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            outcome["result"] = run(lambda step, total: updates.put((int(step), int(total))))
        except BaseException as e:  # re-raised in the request's thread below
            outcome["error"] = e
        finally:
            updates.put(None)

    threading.Thread(target=work, name="jax-sd-generate", daemon=True).start()
    while (update := updates.get()) is not None:
        progress(update, desc="Denoising", unit="steps")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def describe(result: Any, request: dict[str, Any], random_seed: bool) -> str:
    n = len(result.images)
    parts = [
        f"**{n} image{'s' if n != 1 else ''}** in {result.timings['total_s']:.1f} s",
        f"{request['width']}×{request['height']}",
        f"{request['num_inference_steps']} steps",
        f"{request['scheduler']}",
        f"seed {request['seed']}" + (" (random)" if random_seed else ""),
    ]
    text = " · ".join(parts)
    if result.compiled:
        text += f"  \nIncludes compiling for this size ({result.timings['compile_s']:.1f} s), which happens once."
    for warning in result.warnings:
        text += f"  \nNote: {warning}"
    return text


def run_generation(pipe: Any, warmup: Warmup | None, raw: dict[str, Any], progress: Any) -> tuple[list, int, str]:
    request = parse_request(pipe, **raw)
    if warmup is not None and not warmup.ready:
        progress(0.0, desc="Waiting for the model to finish warming up")
        warmup.wait()
    try:
        result = _call_with_progress(lambda report: pipe.generate(**request, progress=report), progress)
    except engine.InvalidRequest as e:  # the engine's own verdict on values the page let through
        raise _refuse(str(e)) from None
    except Exception as e:  # one failed request must not take the server down
        log.exception("generation failed")
        raise _refuse(f"Generation failed: {type(e).__name__}: {e}") from None
    gallery = [
        (image, f"{device} · seed {seed}")
        for image, device, seed in zip(result.images, result.devices, result.seeds, strict=True)
    ]
    return gallery, request["seed"], describe(result, request, _as_bool(raw["random_seed"]))


# ---- the page ----------------------------------------------------------------------------


def _status(pipe: Any, warmup: Warmup | None) -> str:
    where = f"`{pipe.model_name}` on {len(pipe.devices)} device{'s' if len(pipe.devices) != 1 else ''} ({', '.join(pipe.devices)})"
    if warmup is None:
        return f"Ready: {where}."
    if not warmup.ready:
        return f"**Warming up**: compiling {where} for the default size. Requests wait until it is done."
    if warmup.error:
        return f"Ready: {where}. Warm-up failed ({warmup.error}); the first request compiles instead."
    return f"Ready: {where}. Warm-up compiled in {warmup.seconds:.1f} s."


def create_demo(pipe: Any, warmup: Warmup | None = None, images_per_device: int = 1) -> gr.Blocks:
    """The page. `warmup`, when given, is the background compilation the page reports on."""
    defaults = pipe.defaults
    low, high = size_range(pipe)

    def generate(
        prompt,
        negative_prompt,
        seed,
        random_seed,
        steps,
        guidance_scale,
        scheduler,
        width,
        height,
        images_per_device,
        progress=gr.Progress(),  # noqa: B008 - Gradio finds the tracker by this default
    ):
        raw = {
            "prompt": prompt,
            "negative_prompt": negative_prompt,
            "seed": seed,
            "random_seed": random_seed,
            "steps": steps,
            "guidance_scale": guidance_scale,
            "scheduler": scheduler,
            "width": width,
            "height": height,
            "images_per_device": images_per_device,
        }
        return run_generation(pipe, warmup, raw, progress)

    def refresh_status():
        return _status(pipe, warmup), gr.Timer(active=warmup is not None and not warmup.ready)

    with gr.Blocks(title="jax-sd", analytics_enabled=False) as demo:
        gr.Markdown("# jax-sd\nStable Diffusion text-to-image in JAX.")
        gr.Markdown(model_summary(pipe), elem_id="model")
        status = gr.Markdown(_status(pipe, warmup), elem_id="status")
        with gr.Row():
            with gr.Column(scale=2):
                prompt = gr.Textbox(label="Prompt", lines=2, placeholder="What should the picture show?")
                negative_prompt = gr.Textbox(label="Negative prompt", value="", placeholder="What to keep out of it")
                with gr.Row():
                    seed = gr.Number(label="Seed", value=0, precision=0, minimum=0, maximum=MAX_SEED, scale=3)
                    random_seed = gr.Checkbox(label="Random seed", value=True, scale=1)
                steps = gr.Slider(1, pipe.max_steps, value=defaults["num_inference_steps"], step=1, label="Steps")
                guidance_scale = gr.Slider(
                    *GUIDANCE_RANGE, value=defaults["guidance_scale"], step=0.5, label="Guidance scale"
                )
                with gr.Accordion("Advanced", open=False):
                    scheduler = gr.Dropdown(list(pipe.schedulers), value=defaults["scheduler"], label="Scheduler")
                    with gr.Row():
                        width = gr.Slider(low, high, value=defaults["width"], step=8, label="Width")
                        height = gr.Slider(low, high, value=defaults["height"], step=8, label="Height")
                    per_device = gr.Slider(
                        1,
                        MAX_IMAGES_PER_DEVICE,
                        value=images_per_device,
                        step=1,
                        label=f"Images per device ({len(pipe.devices)} device{'s' if len(pipe.devices) != 1 else ''})",
                    )
                button = gr.Button("Generate", variant="primary", elem_id="generate")
            with gr.Column(scale=3):
                # Two fixed columns: one picture stays small enough for its caption to show.
                gallery = gr.Gallery(
                    label="Images", columns=2, fit_columns=False, object_fit="contain", format="png", elem_id="gallery"
                )
                info = gr.Markdown(label="Details", elem_id="info")
        gr.Examples(
            examples=[[p] for p in example_prompts(pipe)],
            inputs=[prompt],
            label="Examples",
            examples_per_page=20,
            cache_examples=False,
        )

        inputs = [
            prompt,
            negative_prompt,
            seed,
            random_seed,
            steps,
            guidance_scale,
            scheduler,
            width,
            height,
            per_device,
        ]
        # preprocess=False: the handler receives the raw JSON values and checks them itself, so
        # an API caller sending a bad value gets the same readable message as the page.
        # concurrency_limit=1: one generation at a time uses every device; the rest queue.
        event = dict(
            fn=generate,
            inputs=inputs,
            outputs=[gallery, seed, info],
            api_name=API_NAME,
            preprocess=False,
            concurrency_limit=1,
            show_progress_on=[gallery],
        )
        button.click(**event)
        prompt.submit(**event, api_visibility="private")

        timer = gr.Timer(1.0, active=warmup is not None and not warmup.ready)
        timer.tick(refresh_status, outputs=[status, timer], queue=False, api_visibility="private")
        demo.load(refresh_status, outputs=[status, timer], queue=False, api_visibility="private")
    return demo


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="jax-sd web demo")
    parser.add_argument(
        "--model",
        default=os.environ.get("MODEL_ID") or None,
        help="Hub id or local diffusers folder (env MODEL_ID); default: the embedded model",
    )
    parser.add_argument(
        "--host",
        default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        help="address to bind (default 127.0.0.1; 0.0.0.0 to serve the network)",
    )
    parser.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", "7860")))
    parser.add_argument("--share", action="store_true", help="also open a public Gradio share link")
    parser.add_argument("--queue-size", type=int, default=16, help="requests waiting at most; more are refused")
    parser.add_argument(
        "--images-per-device", type=int, default=1, help="default images per device (the page can change it)"
    )
    args = parser.parse_args(argv)
    if not 1 <= args.images_per_device <= MAX_IMAGES_PER_DEVICE:
        parser.error(f"--images-per-device must be from 1 to {MAX_IMAGES_PER_DEVICE}")
    if args.queue_size < 1:
        parser.error("--queue-size must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    engine.enable_compile_cache()
    started = time.perf_counter()
    pipe = engine.load_pipeline(args.model)
    log.info("loaded %s on %s in %.1f s", pipe.model_name, pipe.devices, time.perf_counter() - started)
    warmup = Warmup(pipe, num_images=args.images_per_device * len(pipe.devices)).start()
    demo = create_demo(pipe, warmup, images_per_device=args.images_per_device)
    demo.queue(max_size=args.queue_size)
    demo.launch(server_name=args.host, server_port=args.port, share=args.share, show_error=True, theme=THEME)


if __name__ == "__main__":
    main()
