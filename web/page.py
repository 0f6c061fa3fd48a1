"""The Gradio page: its widgets and their wiring (`create_demo`), over any engine with `engine.EngineFace`.

What each event does lives in handlers.py, and raw values become a request in requests.py; here they
meet Gradio: an `engine.InvalidRequest` or `engine.Busy` becomes a `gr.Error` message, an update value of
None becomes `gr.skip()`. The model comes from the server's configuration, never from the page.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import gradio as gr

import engine

from . import handlers
from .api_gate import incident
from .callers import Caller, CallerLimits, page_caller
from .pictures import ClientFiles, default_max_pixels
from .requests import default_strength, mode_choices, picture_fields, size_choices

log = logging.getLogger("jax-sd")

API_NAME = "generate"  # gradio_client: Client(url).predict(..., api_name="/generate")
MAX_SEED = engine.SEED_LIMIT - 1
CACHE_SWEEP_S = 600  # how often Gradio's cache is swept of the files older than the pictures' time

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


def example_prompts(pipe: engine.EngineFace) -> list[str]:
    """The model's own examples when it ships some (a small model knows what it can draw), else ours."""
    prompts = [p for p in getattr(pipe, "example_prompts", None) or [] if p]
    return list(dict.fromkeys(prompts or EXAMPLE_PROMPTS))


def refuse(message: str) -> gr.Error:
    # An expected refusal, shown to the user; not a server fault, so no traceback in the log.
    return gr.Error(message, print_exception=False)


def _skip(value: Any) -> Any:
    return gr.skip() if value is None else value


async def run_generation(
    pipe: engine.EngineFace,
    raw: dict[str, Any],
    progress: Any,
    files: ClientFiles | None = None,
    limits: CallerLimits | None = None,
    caller: Caller | None = None,
) -> AsyncIterator[tuple]:
    """Submits one request as `caller`, within its share (`limits`), and yields (gallery, seed, details) as it goes:
    queue position, previews, pictures (the files written are noted in `files`). Every refusal or failure is a
    `gr.Error` with the message the user sees."""
    try:
        request, ticket = handlers.submit(pipe, raw, limits, caller)
    except engine.InvalidRequest as e:  # a value the page or the engine refuses
        raise refuse(str(e)) from None
    except engine.Busy as e:
        raise refuse(f"{e}.") from None
    try:
        async for gallery, seed, details in handlers.stream(pipe, request, ticket, raw["random_seed"], progress, files):
            yield _skip(gallery), seed, details
    except engine.Cancelled:
        raise refuse("Stopped.") from None
    except Exception as error:  # the request failed in the engine; the server serves on, the log has the details
        raise refuse(f"Generation failed: {incident(error, 'page')}.") from None


def restore(history: list[dict], selected: gr.SelectData) -> list:
    """The settings of the clicked generation, back in the form (its seed fixed, so it draws the same)."""
    return handlers.restore(history, selected.index)


def read_png_info(pipe: engine.EngineFace, image: Any, files: ClientFiles) -> list:
    """A dropped picture's recipe into the form; fields it does not carry stay as they are."""
    try:
        return [_skip(value) for value in handlers.read_png_info(pipe, image, files)]
    except engine.InvalidRequest as e:
        raise refuse(str(e)) from None


# ---- the picture inputs, ControlNet and LoRAs --------------------------------------------------


def picture_controls(pipe: engine.EngineFace) -> tuple[gr.Radio, gr.ImageEditor, gr.Image, gr.Slider]:
    """The mode choice, the picture (inpainting: paint over what to redraw), an optional uploaded mask, strength."""
    choices = mode_choices(pipe)
    with gr.Accordion("Start from a picture: image to image, inpainting", open=choices[0] != "Text to image"):
        mode = gr.Radio(choices, value=choices[0], label="Mode", elem_id="mode")
        picture = gr.ImageEditor(
            label="Picture (to inpaint, paint over what to redraw)",
            type="pil",
            sources=("upload", "clipboard"),
            brush=gr.Brush(colors=["#ffffff"], color_mode="fixed"),
            transforms=(),
            elem_id="picture",
        )
        mask = gr.Image(
            label="Mask (instead of painting: white is redrawn)", type="pil", sources=("upload",), elem_id="mask"
        )
        strength = gr.Slider(
            0.05,
            1.0,
            value=default_strength(pipe, choices[0]),
            step=0.05,
            label="Strength (how much of the picture is redrawn)",
            elem_id="strength",
        )
    return mode, picture, mask, strength


def adapter_controls(pipe: engine.EngineFace, files: ClientFiles) -> list:
    """The ControlNet's and the LoRAs' controls (hidden when the server loaded none); returns the inputs
    of `requests.ADAPTER_INPUTS`, in order. LoRA sliders write their weights into one value, the API's
    `lora_scales`."""
    limits = pipe.limits
    control = getattr(limits, "control", False)
    loras = tuple(getattr(limits, "loras", ()))
    with gr.Accordion("ControlNet: steer the picture with a control picture", open=True, visible=control):
        with gr.Row():
            picture = gr.Image(
                label="Control picture",
                type="pil",
                sources=["upload", "clipboard"],
                elem_id="control-image",
                height=200,
            )
            shown = gr.Image(label="What the ControlNet sees", interactive=False, elem_id="control-preview", height=200)
        canny = gr.Checkbox(label="Canny edges (use the picture's edge map)", value=False, elem_id="canny")
        scale = gr.Slider(
            *limits.control_scale_range, value=1.0, step=0.05, label="Conditioning scale", elem_id="control-scale"
        )

    def preview(raw, canny_edges):
        try:  # preprocess=False: the picture is opened here, only as `files` allows, never by Gradio
            return handlers.control_preview(pipe, files.picture(raw, "The control picture"), bool(canny_edges))
        except engine.InvalidRequest as e:
            raise refuse(str(e)) from None

    for event in (picture.change, canny.change):
        event(preview, [picture, canny], [shown], api_visibility="private", queue=False, preprocess=False)
    weights = gr.JSON(dict.fromkeys(loras, 1.0), visible=False, elem_id="lora-scales")
    with gr.Accordion("LoRAs loaded by the server", open=True, visible=bool(loras)):
        sliders = [
            gr.Slider(*limits.lora_scale_range, value=1.0, step=0.05, label=f"LoRA {name} weight") for name in loras
        ]
    for slider in sliders:
        slider.change(
            lambda *w: dict(zip(loras, w, strict=True)), sliders, [weights], api_visibility="private", queue=False
        )
    return [picture, canny, scale, weights]


# ---- the page ----------------------------------------------------------------------------


def create_demo(
    pipe: engine.EngineFace,
    images_per_device: int = 1,
    concurrency: int | None = None,
    files: ClientFiles | None = None,
    callers: CallerLimits | None = None,
) -> gr.Blocks:
    """The page. `concurrency`: requests handed to the engine at once (default: twice its slots); `files`: the
    paths a client may name and the pixel limit of its pictures (default: Gradio's upload folder, and
    `pictures.default_max_pixels`); `callers`: each caller's share of the engine, shared with the APIs
    (callers.py; default: its own)."""
    defaults, limits = pipe.defaults, pipe.limits
    callers = callers or CallerLimits()
    files = files or ClientFiles(default_max_pixels(limits))
    results = handlers.LastResults()  # each tab's last pictures, which its history entry is made from
    sizes = size_choices(pipe)
    default_size = f"{defaults['width']}x{defaults['height']}"
    concurrency = concurrency or 2 * pipe.batch_size

    async def generate(
        prompt,
        negative_prompt,
        seed,
        random_seed,
        steps,
        guidance_scale,
        scheduler,
        size,
        images_per_device,
        control_image=None,
        canny_edges=False,
        controlnet_conditioning_scale=1.0,
        lora_scales=None,
        mode="Text to image",
        picture=None,
        mask=None,
        strength=None,
        deep_cache=0,
        token_merging=0.0,
        request: gr.Request = None,
        progress=gr.Progress(),  # noqa: B008 - Gradio finds the tracker by this default
    ):
        """Draws pictures with Stable Diffusion from a text prompt, or from a picture and a prompt.

        Args:
            prompt: what the picture should show, in English words.
            negative_prompt: what to keep out of the picture; empty for none.
            seed: the random seed of the first picture (picture k uses seed + k); ignored when random_seed is true.
            random_seed: draw a new seed for this request; the seed used is returned.
            steps: denoising steps; more is slower and usually finer.
            guidance_scale: how closely to follow the prompt (classifier-free guidance); 1 or less turns it off.
            scheduler: the sampler: pndm, ddim, euler, euler_a, dpm++2m, dpm++2m_karras, lcm or tcd.
            size: WIDTHxHEIGHT in pixels, one of the sizes the server offers.
            images_per_device: pictures per device; the server has one or more devices.
            control_image: a picture that steers the drawing (servers started with --controlnet only).
            canny_edges: steer with the control picture's Canny edge map rather than the picture itself.
            controlnet_conditioning_scale: how strongly the control picture steers, 0 to 2.
            lora_scales: the server's LoRAs by name -> weight (a LoRA left out keeps 1.0).
            mode: "Text to image", "Image to image" (redraw `picture`) or "Inpaint" (redraw its masked part).
            picture: the starting picture, as the image editor sends it (its background; painted layers are the mask).
            mask: inpainting: a mask at the picture's size, white where the picture is redrawn (else the painting).
            strength: with a picture, how much is redrawn, above 0 and at most 1.
            deep_cache: DeepCache: a whole UNet pass every this many steps, only its first level between (faster, a
                slightly different picture); 0 or 1: every step whole.
            token_merging: the share of the first UNet level's tokens merged into similar ones before its
                self-attentions (ToMe: faster, a slightly different picture); 0: off.

        Returns:
            the pictures with "device · seed" captions, the seed used, and a line of details.
        """
        try:  # preprocess=False: a client's pictures are opened here, only as `files` allows
            pictures = picture_fields(
                mode, files.editor(picture, "The picture"), files.picture(mask, "The mask"), strength
            )
            control_image = files.picture(control_image, "The control picture")
        except engine.InvalidRequest as e:
            raise refuse(str(e)) from None
        raw = {
            "prompt": prompt,
            "negative_prompt": negative_prompt,
            "seed": seed,
            "random_seed": random_seed,
            "steps": steps,
            "guidance_scale": guidance_scale,
            "scheduler": scheduler,
            "size": size,
            "images_per_device": images_per_device,
            "control_image": control_image,
            "canny_edges": canny_edges,
            "controlnet_conditioning_scale": controlnet_conditioning_scale,
            "lora_scales": lora_scales,
            "pictures": pictures,
            "deep_cache": deep_cache,
            "token_merging": token_merging,
        }
        last = None
        async for update in run_generation(pipe, raw, progress, files, callers, page_caller(request)):
            last = update
            yield update
        if last is not None and isinstance(last[0], list) and last[0]:  # the finished pictures: the last update
            results.keep(getattr(request, "session_hash", None), last[0][0][0])

    def remember(
        history,
        text,
        negative,
        seed_value,
        steps_value,
        guidance,
        kind,
        size_value,
        per,
        deep,
        merging,
        request: gr.Request,
    ):
        form = (text, negative, seed_value, steps_value, guidance, kind, size_value, per, deep, merging)
        return handlers.remember(history, results.take(request.session_hash), *form)

    def refresh_status():
        return handlers.status_line(pipe), gr.Timer(active=not pipe.ready)

    # Gradio's copies of the pictures (its cache, and the uploads) are deleted on the schedule of ours.
    age = max(1, round(files.ttl_s))
    sweep = (min(age, CACHE_SWEEP_S), age)  # (every so many seconds, files older than)
    with gr.Blocks(title="jax-sd", analytics_enabled=False, delete_cache=sweep) as demo:
        gr.Markdown("# jax-sd\nStable Diffusion in JAX: text to image, image to image, inpainting.")
        gr.Markdown(handlers.model_summary(pipe), elem_id="model")
        status = gr.Markdown(handlers.status_line(pipe), elem_id="status")
        with gr.Row():
            with gr.Column(scale=2):
                prompt = gr.Textbox(label="Prompt", lines=2, placeholder="What should the picture show?")
                live = gr.Checkbox(
                    label="Live: redraw as you type (for one-step Turbo models, or few steps)",
                    value=False,
                    elem_id="live",
                )
                negative_prompt = gr.Textbox(label="Negative prompt", value="", placeholder="What to keep out of it")
                with gr.Row():
                    seed = gr.Number(label="Seed", value=0, precision=0, minimum=0, maximum=MAX_SEED, scale=3)
                    random_seed = gr.Checkbox(label="Random seed", value=True, scale=1)
                steps = gr.Slider(1, limits.max_steps, value=defaults["num_inference_steps"], step=1, label="Steps")
                guidance_scale = gr.Slider(
                    *limits.guidance_range, value=defaults["guidance_scale"], step=0.5, label="Guidance scale"
                )
                mode, picture, mask, strength = picture_controls(pipe)
                with gr.Accordion("Advanced", open=False):
                    scheduler = gr.Dropdown(list(limits.schedulers), value=defaults["scheduler"], label="Scheduler")
                    if sizes is None:  # any size in range: typed as WIDTHxHEIGHT
                        size = gr.Textbox(
                            value=default_size, label=f"Size (WIDTHxHEIGHT, multiples of {limits.side_multiple})"
                        )
                    else:
                        size = gr.Dropdown(sizes, value=default_size, label="Size (width x height)")
                    n = len(pipe.devices)
                    per_device = gr.Slider(
                        1,
                        limits.max_images_per_device,
                        value=images_per_device,
                        step=1,
                        label=f"Images per device ({n} device{'s' if n != 1 else ''})",
                    )
                    deep_cache = gr.Slider(
                        0,
                        max(limits.max_deep_cache, 1),
                        value=0,
                        step=1,
                        label="Deep cache: a whole UNet pass every N steps, its first level alone between (0: off)",
                        visible=limits.max_deep_cache > 0,
                    )
                    token_merging = gr.Slider(
                        0.0,
                        max(limits.max_token_merging, 0.05),
                        value=0.0,
                        step=0.05,
                        label="Token merging ratio: the share of the first level's tokens merged (0: off)",
                        visible=limits.max_token_merging > 0,
                    )
                adapters = adapter_controls(pipe, files)
                with gr.Accordion("PNG info: drop a picture to reuse its settings", open=False):
                    # A file, not an image widget: the picture's bytes arrive as they are, text chunks included.
                    dropped = gr.File(file_types=[".png"], type="filepath", show_label=False, elem_id="pnginfo")
                with gr.Row():
                    button = gr.Button("Generate", variant="primary", elem_id="generate", scale=3)
                    stop = gr.Button("Stop", variant="stop", elem_id="stop", scale=1)
            with gr.Column(scale=3):
                # Two fixed columns: one picture stays small enough for its caption to show.
                gallery = gr.Gallery(
                    label="Images",
                    columns=4,  # the batch at a glance: 8 pictures as 4x2 (a props update would reach API clients)
                    fit_columns=False,  # one picture keeps a small cell, so its caption shows
                    object_fit="scale-down",  # never blown up past its own pixels
                    format="png",
                    type="filepath",
                    elem_id="gallery",
                )
                info = gr.Markdown(label="Details", elem_id="info")
                # The last generations of this browser, kept in its local storage, never on the server.
                history = gr.BrowserState([], storage_key="jax-sd-history")
                with gr.Accordion(f"History: your last {handlers.HISTORY_LENGTH} (click one to restore it)", open=True):
                    history_gallery = gr.Gallery(
                        show_label=False,
                        columns=10,
                        fit_columns=False,
                        height=140,
                        allow_preview=False,
                        elem_id="history",
                    )
        gr.Examples(
            examples=[[p] for p in example_prompts(pipe)],
            inputs=[prompt],
            label="Examples",
            examples_per_page=20,
            cache_examples=False,
        )

        inputs = [prompt, negative_prompt, seed, random_seed, steps, guidance_scale, scheduler, size, per_device]
        inputs += adapters
        inputs += [mode, picture, mask, strength, deep_cache, token_merging]
        # preprocess=False: the handler receives the raw JSON values and checks them itself, so an API
        # caller sending a bad value gets the same readable message as the page. Many requests run at
        # once: the engine batches them on the devices; Gradio's queue holds the rest.
        event = dict(
            fn=generate,
            inputs=inputs,
            outputs=[gallery, seed, info],
            api_name=API_NAME,
            preprocess=False,
            concurrency_limit=concurrency,
            show_progress_on=[gallery],
        )
        clicked = button.click(**event)
        submitted = prompt.submit(**event, api_visibility="private")
        # Stop cancels the page's running request; the engine frees its slots at the next chunk.
        stop.click(None, cancels=[clicked, submitted], api_visibility="private")

        form = [prompt, negative_prompt, seed, steps, guidance_scale, scheduler, size, per_device]
        form += [deep_cache, token_merging]
        for done in (clicked, submitted):
            done.success(
                remember,
                [history, *form],
                [history, history_gallery],
                api_visibility="private",
                queue=False,
            )
        mode.change(
            lambda chosen: default_strength(pipe, chosen), [mode], [strength], api_visibility="private", queue=False
        )
        history_gallery.select(restore, [history], [*form, random_seed], api_visibility="private", queue=False)
        dropped.upload(
            lambda image: read_png_info(pipe, image, files),
            [dropped],
            [*form, random_seed, info],
            api_visibility="private",
            queue=False,
            preprocess=False,  # the file is opened in read_png_info, only as `files` allows
        )

        # Live mode: every keystroke notes the latest text at once; the drawing waits for a pause and
        # draws only if its text is still the latest, so a burst of typing makes one picture, for its end.
        latest = handlers.LiveTexts()

        def note(text, request: gr.Request):
            latest.note(request.session_hash, text)

        async def draw_live(
            on,
            text,
            negative,
            seed_value,
            steps_value,
            guidance,
            kind,
            size_value,
            per,
            deep,
            merging,
            request: gr.Request,
        ):
            await asyncio.sleep(handlers.LIVE_PAUSE_S)
            if not on or not (text or "").strip() or not latest.is_latest(request.session_hash, text):
                yield gr.skip(), gr.skip(), gr.skip()
                return
            values = (text, negative, seed_value, steps_value, guidance, kind, size_value, per, deep, merging)
            raw = handlers.live_values(*values)
            try:
                live = run_generation(pipe, raw, None, limits=callers, caller=page_caller(request))
                async for gallery_update, used_seed, details in live:
                    yield gallery_update, used_seed, f"Live: “{text}” · {details}"
            except gr.Error as e:
                yield gr.skip(), gr.skip(), f"Live: {e.message}"

        prompt.input(note, [prompt], None, queue=False, api_visibility="private")
        prompt.input(
            draw_live,
            [live, *form],
            [gallery, seed, info],
            trigger_mode="always_last",  # a drawing in progress is followed by one for the latest text only
            show_progress="hidden",
            concurrency_limit=concurrency,
            api_visibility="private",
        )
        demo.load(handlers.show_history, [history], [history_gallery], api_visibility="private", queue=False)

        timer = gr.Timer(1.0, active=not pipe.ready)
        timer.tick(refresh_status, outputs=[status, timer], queue=False, api_visibility="private")
        demo.load(refresh_status, outputs=[status, timer], queue=False, api_visibility="private")
    return demo
