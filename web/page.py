"""The Gradio page: its widgets and their wiring (`create_demo`), over any engine with `engine.EngineFace`.

What each event does lives in handlers.py, and raw values become a request in requests.py; here they
meet Gradio: an `engine.InvalidRequest` or `engine.Busy` becomes a `gr.Error` message, an update value of
None becomes `gr.skip()`. The model comes from the server's configuration, never from the page.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator
from typing import Any

import gradio as gr

import engine

from . import handlers
from .api_gate import incident
from .callers import Caller, CallerLimits, page_caller
from .pictures import ClientFiles, default_max_pixels
from .requests import (
    ADAPTER_INPUTS,
    default_strength,
    form_fields,
    mode_choices,
    page_fields,
    page_inputs,
    picture_fields,
    size_choices,
)

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


# ---- the controls and `/generate`'s parameters, from the request's fields ---------------------------

# The page's own inputs, which are not request fields: what `/generate` says of each, and its default.
OWN_INPUTS = {
    "random_seed": ("draw a new seed for this request; the seed used is returned.", inspect.Parameter.empty),
    "size": ("WIDTHxHEIGHT in pixels, one of the sizes the server offers.", inspect.Parameter.empty),
    "images_per_device": ("pictures per device; the server has one or more devices.", inspect.Parameter.empty),
    "canny_edges": ("steer with the control picture's Canny edge map rather than the picture itself.", False),
    "mode": (
        '"Text to image", "Image to image" (redraw `picture`), "Inpaint" (redraw its masked part) or, for a model that'
        ' edits, "Edit" (edit from `references`).',
        "Text to image",
    ),
    "picture": (
        "the starting picture, as the image editor sends it (its background; painted layers are the mask).",
        None,
    ),
    "mask": ("inpainting: a mask at the picture's size, white where the picture is redrawn (else the painting).", None),
    "references": (
        "Edit: the pictures the model edits from, in order (models that edit only); the picture takes the first's size.",
        None,
    ),
}
FIRST_WITHOUT_DEFAULT = 9  # /generate's first parameters (prompt ... images_per_device) have no default
GENERATE_DOC = """Draws pictures with Stable Diffusion from a text prompt, or from a picture and a prompt.

Args:
{args}

Returns:
    the pictures with "device · seed" captions, the seed used, and a line of details.
"""


def _positional(names: list[str]) -> inspect.Signature:
    """A handler's signature: these positional values, then gradio's request (found by its type)."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter(name, kind) for name in names]
    return inspect.Signature([*params, inspect.Parameter("request", kind, annotation=gr.Request)])


def field_control(pipe: engine.EngineFace, name: str, **props: Any) -> gr.components.Component:
    """The control of the request field the page calls `name`: a slider over its range on this server's limits
    (hidden where the range is empty, as DeepCache's on a model without UNet levels), or a dropdown of its choices;
    its value the model's default, else the field's."""
    f = page_fields()[name]
    value = props.pop("value", pipe.defaults.get(f.name, f.default if f.page.value is None else f.page.value))
    if f.page.control == "checkbox":
        return gr.Checkbox(value=bool(value), label=f.page.label, **props)
    if f.page.control == "dropdown":
        choices = list(f.choices(pipe.limits))
        props.setdefault("visible", bool(choices))  # nothing to choose: hidden (hires fix on an inpainting model)
        return gr.Dropdown(choices or [value], value=value, label=f.page.label, **props)
    low, high = f.bounds(pipe.limits)
    low = low if f.page.minimum is None else f.page.minimum
    step = f.page.step
    return gr.Slider(
        low, max(high, low + step), value=value, step=step, label=f.page.label, visible=high > low, **props
    )


def model_props(pipe: engine.EngineFace, name: str) -> dict[str, Any]:
    """A control's props that depend on what the model is: a step-distilled model's guidance slider (FLUX.2 [klein]'s,
    which ignores the scale) is shown, cannot be moved, and says why."""
    if name == "guidance_scale" and not getattr(pipe, "guided", True):
        return {"interactive": False, "info": "This model is step-distilled: the guidance scale changes nothing."}
    return {}


def generate_signature() -> tuple[inspect.Signature, str]:
    """`/generate`'s parameters (`requests.page_inputs`, then gradio's request and progress) and its docstring,
    which gradio_client's and MCP's descriptions are read from."""
    fields, params, args = page_fields(), [], []
    for k, name in enumerate(page_inputs()):
        meaning, default = OWN_INPUTS[name] if name in OWN_INPUTS else (fields[name].meaning, fields[name].default)
        default = inspect.Parameter.empty if k < FIRST_WITHOUT_DEFAULT else default
        params.append(inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default))
        args.append(f"    {name}: {meaning}")
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params.append(inspect.Parameter("request", kind, default=None, annotation=gr.Request))
    params.append(inspect.Parameter("progress", kind, default=gr.Progress()))
    return inspect.Signature(params), GENERATE_DOC.format(args="\n".join(args))


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


def picture_controls(
    pipe: engine.EngineFace, controls: dict[str, Any]
) -> tuple[gr.Radio, gr.ImageEditor, gr.Image, gr.Slider, gr.Gallery]:
    """The mode choice, the picture (inpainting: paint over what to redraw), an optional uploaded mask, strength, and
    the Edit mode's reference pictures (shown only for a model that edits); the picture section's other fields (mask
    blur, only masked, ...) go into `controls`."""
    choices = mode_choices(pipe)
    most = getattr(pipe.limits, "max_references", 0)
    title = "Start from a picture: " + ("edit, " if most else "") + "image to image, inpainting"
    with gr.Accordion(title, open=choices[0] != "Text to image"):
        mode = gr.Radio(choices, value=choices[0], label="Mode", elem_id="mode")
        references = gr.Gallery(
            label=f"Edit: the pictures the model edits from (up to {most}; the picture takes the first one's size)"
            if most
            else "Edit: the pictures the model edits from",
            type="pil",
            interactive=True,
            file_types=["image"],
            columns=4,
            height=200,
            visible=bool(most),
            elem_id="references",
        )
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
        strength = field_control(pipe, "strength", value=default_strength(pipe, choices[0]), elem_id="strength")
        for name, f in page_fields().items():  # inpainting's options, in their order
            if f.page.section == "picture" and name != "strength":
                controls[name] = field_control(pipe, name)
    return mode, picture, mask, strength, references


def gallery_pictures(files: ClientFiles, value: Any, what: str, most: int) -> list:
    """The pictures of an upload gallery's raw value (Gradio's file data, each under "image", or bare), each opened
    as `files` allows; more than `most` are refused before any is opened."""
    if not value:
        return []
    if not isinstance(value, list):
        raise engine.InvalidRequest(f"{what} must be a list of uploaded pictures.")
    if not most:  # as Limits.check says it, before any picture is opened
        raise engine.InvalidRequest(
            "this model does not take reference pictures (it does not edit); send no references"
        )
    if len(value) > most:
        raise engine.InvalidRequest(f"{len(value)} reference pictures are too many; this model takes at most {most}")
    return [files.picture(item.get("image", item) if isinstance(item, dict) else item, what) for item in value]


# How `/generate` describes the LoRAs' weights to API and MCP clients: a map of names to numbers. gr.JSON describes
# itself as `{"type": {}}`, which is no JSON Schema: an MCP server that validates a call's arguments against the
# tool's schema (the MCP SDK's does) refuses every call to the tool for it. Set on the one component, not through a
# gr.JSON subclass, which Gradio would write a .pyi stub beside this file for.
LORA_WEIGHTS_API = {"type": "object", "additionalProperties": {"type": "number"}}


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
        scale = field_control(pipe, "controlnet_conditioning_scale", elem_id="control-scale")

    def preview(raw, canny_edges):
        try:  # preprocess=False: the picture is opened here, only as `files` allows, never by Gradio
            return handlers.control_preview(pipe, files.picture(raw, "The control picture"), bool(canny_edges))
        except engine.InvalidRequest as e:
            raise refuse(str(e)) from None

    for event in (picture.change, canny.change):
        event(preview, [picture, canny], [shown], api_visibility="private", queue=False, preprocess=False)
    weights = gr.JSON(dict.fromkeys(loras, 1.0), visible=False, elem_id="lora-scales")
    weights.api_info = lambda: dict(LORA_WEIGHTS_API)
    with gr.Accordion("LoRAs loaded by the server", open=True, visible=bool(loras)):
        sliders = [
            gr.Slider(*limits.lora_scale_range, value=1.0, step=0.05, label=f"LoRA {name} weight") for name in loras
        ]
    for slider in sliders:
        slider.change(
            lambda *w: dict(zip(loras, w, strict=True)), sliders, [weights], api_visibility="private", queue=False
        )
    return [picture, canny, scale, weights]


def upscale_controls(pipe: engine.EngineFace, files: ClientFiles) -> None:
    """Upscale a picture (an upload or one drawn here) with one of the server's upscalers, as A1111's Extras do;
    shown only where the engine offers upscalers. One upscale at a time: it takes the CPUs the drawings use."""
    folder = getattr(pipe, "upscalers", None)
    names = folder.names() if folder is not None else []
    with gr.Accordion("Upscale a picture", open=False, visible=bool(names)):
        with gr.Row():
            source = gr.Image(label="Picture", type="pil", sources=["upload", "clipboard"], elem_id="upscale-in")
            shown = gr.Image(label="Upscaled", interactive=False, format="png", elem_id="upscale-out")
        scale = gr.Slider(1.0, handlers.MAX_UPSCALE, value=2.0, step=0.5, label="Upscale by", elem_id="upscale-by")
        upscaler = gr.Dropdown(names or ["Lanczos"], value=(names or ["Lanczos"])[0], label="Upscaler")
        button = gr.Button("Upscale", elem_id="upscale")

    async def upscale(raw, by, name):
        try:  # preprocess=False: the picture is opened here, only as `files` allows
            picture = files.picture(raw, "The picture to upscale")
            return await asyncio.to_thread(handlers.upscale_picture, pipe, picture, by, name)
        except engine.InvalidRequest as e:
            raise refuse(str(e)) from None

    button.click(
        upscale, [source, scale, upscaler], [shown], api_visibility="private", preprocess=False, concurrency_limit=1
    )


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

    signature, doc = generate_signature()
    most_references = getattr(pipe.limits, "max_references", 0)

    async def generate(*args):
        bound = signature.bind(*args)
        bound.apply_defaults()
        raw = dict(bound.arguments)
        request, progress = raw.pop("request"), raw.pop("progress")
        try:  # preprocess=False: a client's pictures are opened here, only as `files` allows
            pictures = picture_fields(
                raw.pop("mode"),
                files.editor(raw.pop("picture"), "The picture"),
                files.picture(raw.pop("mask"), "The mask"),
                raw.pop("strength"),
                gallery_pictures(files, raw.pop("references"), "A reference picture", most_references),
            )
            raw["control_image"] = files.picture(raw["control_image"], "The control picture")
        except engine.InvalidRequest as e:
            raise refuse(str(e)) from None
        raw["pictures"] = pictures
        last = None
        async for update in run_generation(pipe, raw, progress, files, callers, page_caller(request)):
            last = update
            yield update
        if last is not None and isinstance(last[0], list) and last[0]:  # the finished pictures: the last update
            results.keep(getattr(request, "session_hash", None), last[0][0][0])

    generate.__signature__, generate.__doc__ = signature, doc
    generate.__annotations__ = {"request": gr.Request}  # gradio finds the request by its type

    def remember(history, *form_and_request):
        *form, request = form_and_request
        return handlers.remember(history, results.take(request.session_hash), *form)

    form_names = form_fields()
    remember.__signature__ = _positional(["history", *form_names])
    remember.__annotations__ = {"request": gr.Request}

    def refresh_status():
        return handlers.status_line(pipe), gr.Timer(active=not pipe.ready)

    # Gradio's copies of the pictures (its cache, and the uploads) are deleted on the schedule of ours.
    age = max(1, round(files.ttl_s))
    sweep = (min(age, CACHE_SWEEP_S), age)  # (every so many seconds, files older than)
    with gr.Blocks(title="jax-sd", analytics_enabled=False, delete_cache=sweep) as demo:
        gr.Markdown("# jax-sd\nStable Diffusion in JAX: text to image, image to image, inpainting.")
        gr.Markdown(handlers.model_summary(pipe), elem_id="model")
        served = getattr(pipe, "models", None)  # a server of several models (--models): A1111's checkpoint menu
        if served is not None and len(served.titles()) > 1:
            checkpoint = gr.Dropdown(
                served.titles(),
                value=served.default,
                label="Model: the server's default, for every caller (as A1111's checkpoint menu)",
                elem_id="checkpoint",
            )
            checkpoint.change(
                lambda name: served.set_default(name) and None,
                [checkpoint],
                None,
                api_visibility="private",
                queue=False,
            )
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
                basic = [name for name, f in page_fields().items() if f.page.section == "basic"]
                controls = {
                    name: field_control(pipe, name, **model_props(pipe, name))
                    for name in basic
                    if name not in ("prompt", "negative_prompt", "seed")
                }
                mode, picture, mask, strength, references = picture_controls(pipe, controls)
                with gr.Accordion("Advanced", open=False):
                    controls["scheduler"] = field_control(pipe, "scheduler")
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
                    for name, f in page_fields().items():  # the other fields of the section, in their order
                        if f.page.section == "advanced" and name not in controls:
                            controls[name] = field_control(pipe, name)
                offered = bool(getattr(limits, "upscalers", ()))  # hires fix needs an upscaler: none, not offered
                with gr.Accordion("Hires fix: draw the picture again, larger", open=False, visible=offered):
                    for name, f in page_fields().items():
                        if f.page.section == "hires":
                            controls[name] = field_control(pipe, name)
                adapters = adapter_controls(pipe, files)
                upscale_controls(pipe, files)
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

        controls.update(
            prompt=prompt,
            negative_prompt=negative_prompt,
            seed=seed,
            random_seed=random_seed,
            size=size,
            images_per_device=per_device,
            mode=mode,
            picture=picture,
            mask=mask,
            strength=strength,
            references=references,
        )
        controls.update(zip(ADAPTER_INPUTS, adapters, strict=True))
        inputs = [controls[name] for name in page_inputs()]
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

        form = [controls[name] for name in form_names]
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

        async def draw_live(on, *form_and_request):
            *values, request = form_and_request
            text = values[0]
            await asyncio.sleep(handlers.LIVE_PAUSE_S)
            if not on or not (text or "").strip() or not latest.is_latest(request.session_hash, text):
                yield gr.skip(), gr.skip(), gr.skip()
                return
            raw = handlers.live_values(*values)
            try:
                live = run_generation(pipe, raw, None, limits=callers, caller=page_caller(request))
                async for gallery_update, used_seed, details in live:
                    yield gallery_update, used_seed, f"Live: “{text}” · {details}"
            except gr.Error as e:
                yield gr.skip(), gr.skip(), f"Live: {e.message}"

        draw_live.__signature__ = _positional(["on", *form_names])
        draw_live.__annotations__ = {"request": gr.Request}
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
