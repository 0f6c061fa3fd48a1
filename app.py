"""jax-sd web demo: a Gradio Blocks page over the engine.

UI only: widgets, raw values turned into a request, errors turned into messages, the gallery
streaming previews and pictures. Everything that
touches the model lives in `engine/`. The model comes from the server's configuration
(`--model` or `MODEL_ID`), never from the page.

    python app.py                                   # embedded default model, 127.0.0.1:7860
    python app.py --model stable-diffusion-v1-5/stable-diffusion-v1-5 --host 0.0.0.0
    python app.py --model FOLDER --controlnet lllyasviel/sd-controlnet-canny --lora style=style.safetensors
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import logging
import math
import os
import secrets
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import gradio as gr
from PIL import Image

# transformers (the tokenizers) advises installing PyTorch on import; the app does not need it.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
import engine  # noqa: E402
from engine.compat.pnginfo import GenerationParameters, png_info, save_png  # noqa: E402

log = logging.getLogger("jax-sd")

API_NAME = "generate"  # gradio_client: Client(url).predict(..., api_name="/generate")
MAX_SEED = engine.SEED_LIMIT - 1
MAX_IMAGES_PER_DEVICE = engine.Limits.max_images_per_device

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


def example_prompts(pipe: Any) -> list[str]:
    """The model's own examples when it ships some (a small model knows what it can draw), else ours."""
    prompts = [p for p in getattr(pipe, "example_prompts", None) or [] if p]
    return list(dict.fromkeys(prompts or EXAMPLE_PROMPTS))


def size_choices(pipe: Any) -> list[str] | None:
    """The sizes the server offers, as "WxH" labels; None when any size in range is served."""
    sizes = pipe.limits.sizes
    return None if sizes is None else [f"{w}x{h}" for w, h in sizes]


def model_summary(pipe: Any) -> str:
    """The model's family and the settings the page starts from, which follow the model (Turbo: 1 step, no guidance)."""
    d = pipe.defaults
    family = getattr(pipe, "label", None) or pipe.family
    safety = {
        "on": "the model's safety checker withholds flagged pictures",
        "off": "safety checker off (--no-safety-checker)",
        "none": "this model ships no safety checker: pictures are not filtered",
    }[getattr(pipe, "safety_mode", "none")]
    adapters = ""
    if getattr(pipe, "controlnet", None):
        adapters += f" · ControlNet `{pipe.controlnet}`"
    if getattr(pipe.limits, "loras", ()):
        adapters += f" · LoRAs: {', '.join(pipe.limits.loras)}"
    return (
        f"**{family}** · defaults: {d['width']}×{d['height']}, {d['num_inference_steps']} steps, "
        f"guidance {d['guidance_scale']:g}, {d['scheduler']} · {safety}{adapters}"
    )


# ---- raw page/API values -> a GenerationRequest; the engine's Limits check the ranges ------


def _refuse(message: str) -> gr.Error:
    # An expected refusal, shown to the user; not a server fault, so no traceback in the log.
    return gr.Error(message, print_exception=False)


def _as_int(value: Any, what: str) -> int:
    try:
        number = float(str(value).strip()) if isinstance(value, str) else float(value)
    except (TypeError, ValueError):
        raise _refuse(f"{what} must be a whole number, not {value!r}.") from None
    if not math.isfinite(number) or number != int(number):
        raise _refuse(f"{what} must be a whole number, not {value!r}.")
    return int(number)


def _as_float(value: Any, what: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise _refuse(f"{what} must be a number, not {value!r}.") from None


def _as_text(value: Any, what: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise _refuse(f"{what} must be text.")
    return value.strip()


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes", "on")
    return bool(value)


def _as_size(pipe: Any, value: Any) -> tuple[int, int]:
    text = str(value).strip().lower().replace("×", "x").split(" ")[0]
    width, _, height = text.partition("x")
    offered = size_choices(pipe)
    try:
        return int(width), int(height)
    except ValueError:
        choices = f"; choose one of {', '.join(offered)}" if offered else ""
        raise _refuse(f"Size must be written WIDTHxHEIGHT, like 512x512, not {value!r}{choices}.") from None


# ---- image-to-image and inpainting: the picture inputs ----------------------------------------

MODES = {"Text to image": "txt2img", "Image to image": "img2img", "Inpaint": "inpaint"}


def _variant(pipe: Any) -> engine.Variant:
    """What the model is (engine/variants.py); an engine that does not say is a text-to-image one."""
    return getattr(pipe, "variant", None) or engine.VARIANTS[0]


def mode_choices(pipe: Any) -> list[str]:
    """The modes the model can run: an inpainting model only repaints (its variant needs a picture and a mask)."""
    return ["Inpaint"] if _variant(pipe).needs else list(MODES)


def picture_controls(pipe: Any) -> tuple[gr.Radio, gr.ImageEditor, gr.Image, gr.Slider]:
    """The mode choice, the picture (inpainting: paint over what to redraw), an optional uploaded mask, strength."""
    choices = mode_choices(pipe)
    variant = _variant(pipe)
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
            value=variant.default_strength("mask" if choices[0] == "Inpaint" else None),
            step=0.05,
            label="Strength (how much of the picture is redrawn)",
            elem_id="strength",
        )
    return mode, picture, mask, strength


def _value(component: Any, raw: Any) -> Any:
    """A raw (not preprocessed) API value of an image component, as the component's own preprocess gives it."""
    if raw is None or component is None:
        return None
    if isinstance(raw, dict):
        raw = component.data_model.model_validate(raw)
    return component.preprocess(raw)


def picture_fields(mode: Any, picture: Any, mask: Any, strength: Any) -> dict[str, Any]:
    """The request's image, mask_image and strength from the page's mode, editor value and mask upload."""
    kind = MODES.get(mode or "Text to image")
    if kind is None:
        raise _refuse(f"Mode must be one of {', '.join(MODES)}, not {mode!r}.")
    if kind == "txt2img":
        return {}
    editor = picture if isinstance(picture, dict) else {"background": picture, "layers": []}
    image = editor.get("background")
    if image is None:
        raise _refuse(f"{mode} needs a picture: upload one first.")
    fields = {"image": image.convert("RGB"), "strength": _as_float(strength, "Strength"), "width": None}
    if kind == "inpaint":
        if mask is None:  # the painted strokes: every layer's opaque pixels, at the picture's size
            mask = Image.new("L", image.size, 0)
            for layer in editor.get("layers") or []:
                alpha = layer.convert("RGBA").getchannel("A").resize(image.size)
                mask.paste(255, mask=alpha.point(lambda a: 255 if a > 0 else 0))
            if mask.getbbox() is None:
                raise _refuse("Inpaint needs a mask: paint over what to redraw, or upload a mask.")
        fields["mask_image"] = mask
    return fields


def parse_request(
    pipe: Any,
    prompt: Any,
    negative_prompt: Any,
    seed: Any,
    random_seed: Any,
    steps: Any,
    guidance_scale: Any,
    scheduler: Any,
    size: Any,
    images_per_device: Any,
    pictures: dict[str, Any] | None = None,
    **adapters: Any,
) -> engine.GenerationRequest:
    """Turns the page's (or an API client's) raw values into a request; the engine checks their ranges.

    `pictures`: `picture_fields`' image, mask_image and strength; a picture brings its own size.
    `adapters`: the ControlNet's and the LoRAs' values (`adapter_fields`), all optional."""
    prompt = _as_text(prompt, "Prompt")
    if not prompt:
        raise _refuse("Type a prompt first.")
    if _as_bool(random_seed) or (isinstance(seed, str) and seed.strip().lower() in ("", "random")):
        seed = secrets.randbelow(engine.SEED_LIMIT)
    else:
        seed = _as_int(seed, "Seed")
    per_device = _as_int(images_per_device, "Images per device")
    top = pipe.limits.max_images_per_device
    if not 1 <= per_device <= top:
        raise _refuse(f"Images per device must be from 1 to {top}; {per_device} is out of range.")
    width, height = _as_size(pipe, size)
    pictures = dict(pictures or {})
    if pictures.pop("width", 0) is None:
        width = height = None
    return engine.GenerationRequest(
        prompt=prompt,
        negative_prompt=_as_text(negative_prompt, "Negative prompt") or None,  # an empty box: no negative prompt
        seed=seed,
        num_inference_steps=_as_int(steps, "Steps"),
        guidance_scale=_as_float(guidance_scale, "Guidance scale"),
        scheduler=scheduler,
        width=width,
        height=height,
        num_images=per_device * len(pipe.devices),
        **adapter_fields(pipe, **adapters),
        **pictures,
    )


# ---- ControlNet and LoRA: their controls, shown when the server loaded them ---------------------

ADAPTER_INPUTS = ("control_image", "canny_edges", "controlnet_conditioning_scale", "lora_scales")


def _as_picture(value: Any) -> Image.Image | None:
    """An uploaded picture as the handler receives it (Gradio's file data, unprocessed), or a PIL picture."""
    if value is None or isinstance(value, Image.Image):
        return value
    path = value.get("path") if isinstance(value, dict) else None
    if not path:
        raise _refuse("The control picture must be an uploaded image.")
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except OSError:
        raise _refuse("The control picture could not be read as an image.") from None


def adapter_fields(
    pipe: Any,
    control_image: Any = None,
    canny_edges: Any = False,
    controlnet_conditioning_scale: Any = 1.0,
    lora_scales: Any = None,
) -> dict[str, Any]:
    """The request's ControlNet and LoRA fields; the Canny edge map, when asked for, is the engine's."""
    picture = _as_picture(control_image)
    if picture is not None and _as_bool(canny_edges):
        picture = pipe.canny_image(picture)
    fields = {"control_image": picture}
    if controlnet_conditioning_scale is not None:
        fields["controlnet_conditioning_scale"] = _as_float(controlnet_conditioning_scale, "Conditioning scale")
    if lora_scales:
        if not isinstance(lora_scales, dict):
            raise _refuse("LoRA weights must map each LoRA's name to its weight.")
        fields["lora_scales"] = {name: _as_float(w, f"LoRA {name} weight") for name, w in lora_scales.items()}
    return fields


def control_preview(pipe: Any, picture: Image.Image | None, canny: bool) -> Image.Image | None:
    """What the ControlNet will see: the picture, or its Canny edge map."""
    if picture is None:
        return None
    return pipe.canny_image(picture) if canny else picture


def adapter_controls(pipe: Any) -> list:
    """The ControlNet's and the LoRAs' controls (hidden when the server loaded none); returns the inputs
    of `ADAPTER_INPUTS`, in order. LoRA sliders write their weights into one value, the API's `lora_scales`."""
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
    for event in (picture.change, canny.change):
        event(
            lambda p, c: control_preview(pipe, p, c), [picture, canny], [shown], api_visibility="private", queue=False
        )
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


# ---- one generation, streamed ----------------------------------------------------------------


def describe(result: Any, random_seed: bool) -> str:
    r = result.request
    n = len(result.images)
    parts = [
        f"**{n} image{'s' if n != 1 else ''}** in {result.timings['total_s']:.1f} s",
        f"{r.width}×{r.height}",
        f"{r.num_inference_steps} steps" + (f", strength {r.strength:g}" if r.image is not None else ""),
        f"{r.scheduler}",
        f"seed {r.seed}" + (" (random)" if random_seed else ""),
    ]
    text = " · ".join(parts)
    if result.timings.get("queue_s", 0) >= 0.5:
        text += f"  \nWaited {result.timings['queue_s']:.1f} s for a free slot."
    if result.compiled:
        text += f"  \nIncludes compiling for this size ({result.timings['compile_s']:.1f} s), which happens once."
    filtered = sum(result.nsfw_content_detected or [])
    if filtered:
        text += (
            f"  \n{filtered} picture{'s were' if filtered != 1 else ' was'} withheld by the safety checker; "
            "try another seed or prompt."
        )
    for warning in result.warnings:
        text += f"  \nNote: {warning}"
    return text


def _with_parameters(image: Image.Image, request: engine.GenerationRequest, seed: int, model: str) -> str:
    """The picture as a PNG file that carries its recipe (A1111's "parameters" chunk): what the gallery serves,
    so a downloaded picture remembers how it was made."""
    handle, path = tempfile.mkstemp(suffix=".png", prefix=f"seed{seed}-")
    os.close(handle)
    save_png(image, path, GenerationParameters.from_request(request, seed, model))
    return path


def read_png_info(pipe: Any, image: str | None) -> list:
    """A dropped picture's recipe, into the form (prompt, negative, seed, steps, guidance, sampler, size)."""
    params = png_info(image) if image is not None else None
    if params is None:
        note = "That picture carries no generation parameters." if image is not None else gr.skip()
        return [gr.skip()] * (len(FORM_FIELDS) + 1) + [note]
    fields = params.request_fields()
    size = f"{params.width}x{params.height}" if params.width and params.height else None
    offered = size_choices(pipe)
    values = {
        "prompt": params.prompt,
        "negative_prompt": params.negative_prompt,
        "seed": params.seed,
        "steps": fields.get("num_inference_steps"),
        "guidance_scale": params.guidance_scale,
        "scheduler": params.scheduler,
        "size": size if size and (offered is None or size in offered) else None,
        "images_per_device": None,
    }
    form = [gr.skip() if values[name] is None else values[name] for name in FORM_FIELDS]
    notes = [f"Read from the picture: {params.sampler or 'sampler'}, seed {params.seed}."]
    if size and values["size"] is None:
        notes.append(f"Its size {size} is not offered here; the size is unchanged.")
    if params.scheduler is None:
        notes.append("Its sampler is not one of ours; the scheduler is unchanged.")
    return [*form, False, " ".join(notes)]


def _placeholder(size: tuple[int, int]) -> Image.Image:
    # A plain grey picture where the safety checker withheld one; its caption says why, and its seed.
    return Image.new("RGB", size, (128, 128, 128))


def _preview_gallery(event: engine.Preview, request: engine.GenerationRequest, step: str) -> list:
    # Latent-resolution previews, scaled up so that they fill the picture's place in the gallery.
    return [
        (Image.fromarray(img).resize((request.width, request.height), Image.Resampling.BILINEAR), f"preview · {step}")
        for img in event.images
    ]


async def run_generation(pipe: Any, raw: dict[str, Any], progress: Any) -> AsyncIterator[tuple]:
    """Submits one request and yields (gallery, seed, details) as it goes: queue position, previews, pictures."""
    request = parse_request(pipe, **raw)
    try:
        ticket = pipe.submit(request)
    except engine.InvalidRequest as e:  # the engine's verdict on the values
        raise _refuse(str(e)) from None
    except engine.Busy as e:
        raise _refuse(f"{e}.") from None
    step = "starting"
    async for event in ticket.aevents():
        if isinstance(event, engine.Queued):
            yield gr.skip(), request.seed, f"Waiting for a free slot: number {event.position} in line."
        elif isinstance(event, engine.Progress):
            step = f"step {event.step}/{event.total}"
            if progress is not None:
                progress((event.step, event.total), desc="Denoising", unit="steps")
        elif isinstance(event, engine.Preview):
            yield _preview_gallery(event, ticket.request, step), request.seed, f"Drawing: {step}"
        elif isinstance(event, engine.Failed):
            error = event.error
            if isinstance(error, engine.Cancelled):
                raise _refuse("Stopped.")
            log.error("generation failed: %s", error)
            raise _refuse(f"Generation failed: {error}")
        elif isinstance(event, engine.Finished):
            result = event.result
            flagged = result.nsfw_content_detected or [False] * len(result.images)
            gallery = [
                (_placeholder(image.size), f"filtered by the safety checker · seed {seed}")
                if withheld
                else (_with_parameters(image, result.request, seed, pipe.model_name), f"{device} · seed {seed}")
                for image, device, seed, withheld in zip(
                    result.images, result.devices, result.seeds, flagged, strict=True
                )
            ]
            yield gallery, request.seed, describe(result, _as_bool(raw["random_seed"]))


# ---- history (kept in the browser) and live mode ----------------------------------------------

# The form's fields, in the order the page lists them: history entries and live drawings use them.
FORM_FIELDS = ("prompt", "negative_prompt", "seed", "steps", "guidance_scale", "scheduler", "size", "images_per_device")
HISTORY_LENGTH = 20
LIVE_PAUSE_S = 0.3  # live mode draws once typing pauses this long
THUMBNAIL_SIDE = 96


def _thumbnail(path: str) -> str:
    with Image.open(path) as image:
        image.thumbnail((THUMBNAIL_SIDE, THUMBNAIL_SIDE))
        buffer = io.BytesIO()
        image.convert("RGB").save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def show_history(history: list[dict] | None) -> list:
    items = []
    for entry in history or []:
        image = Image.open(io.BytesIO(base64.b64decode(entry["thumbnail"])))
        items.append((image, f"seed {entry['seed']}"))
    return items


def remember(history: list[dict] | None, gallery: list | None, *form) -> tuple[list[dict], list]:
    """Puts the finished generation first in the browser's history: its settings and a thumbnail."""
    if not gallery:
        return history or [], show_history(history)
    first = gallery[0][0] if isinstance(gallery[0], list | tuple) else gallery[0]
    entry = dict(zip(FORM_FIELDS, form, strict=True), thumbnail=_thumbnail(first))
    history = [entry, *(history or [])][:HISTORY_LENGTH]
    return history, show_history(history)


def restore(history: list[dict], selected: gr.SelectData) -> list:
    """The settings of the clicked generation, back in the form (its seed fixed, so it draws the same)."""
    entry = history[selected.index]
    return [entry[name] for name in FORM_FIELDS] + [False]


# ---- the page ----------------------------------------------------------------------------


def _status(pipe: Any) -> str:
    n = len(pipe.devices)
    unit = "core pair" if getattr(pipe, "core_pairs", False) else "device"  # engine/pairs.py
    where = f"`{pipe.model_name}` on {n} {unit}{'s' if n != 1 else ''} ({', '.join(pipe.devices)})"
    slots = f"{pipe.batch_size} pictures drawn at once"
    state = pipe.warmup_state
    if not pipe.ready:
        return f"**Warming up**: compiling {where} for the default size. Requests wait until it is done."
    if state.error:
        return f"Ready: {where}, {slots}. Warm-up failed ({state.error}); the first request compiles instead."
    if state.seconds is None:
        return f"Ready: {where}, {slots}."
    return f"Ready: {where}, {slots}. Warm-up compiled in {state.seconds:.1f} s."


def create_demo(pipe: Any, images_per_device: int = 1, concurrency: int | None = None) -> gr.Blocks:
    """The page. `concurrency`: requests handed to the engine at once (default: twice its slots)."""
    defaults, limits = pipe.defaults, pipe.limits
    sizes = size_choices(pipe)
    default_size = f"{defaults['width']}x{defaults['height']}"

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
            scheduler: the sampler: pndm, ddim, euler, euler_a, dpm++2m or dpm++2m_karras.
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

        Returns:
            the pictures with "device · seed" captions, the seed used, and a line of details.
        """
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
            "pictures": picture_fields(
                mode, _value(widgets.get("picture"), picture), _value(widgets.get("mask"), mask), strength
            ),
        }
        async for update in run_generation(pipe, raw, progress):
            yield update

    def refresh_status():
        return _status(pipe), gr.Timer(active=not pipe.ready)

    widgets: dict[str, Any] = {}  # the picture inputs, which `generate` preprocesses itself

    with gr.Blocks(title="jax-sd", analytics_enabled=False) as demo:
        gr.Markdown("# jax-sd\nStable Diffusion in JAX: text to image, image to image, inpainting.")
        gr.Markdown(model_summary(pipe), elem_id="model")
        status = gr.Markdown(_status(pipe), elem_id="status")
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
                widgets.update(picture=picture, mask=mask)
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
                adapters = adapter_controls(pipe)
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
                with gr.Accordion(f"History: your last {HISTORY_LENGTH} (click one to restore it)", open=True):
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
        inputs += [mode, picture, mask, strength]
        # preprocess=False: the handler receives the raw JSON values and checks them itself, so an API
        # caller sending a bad value gets the same readable message as the page. Many requests run at
        # once: the engine batches them on the devices; Gradio's queue holds the rest.
        event = dict(
            fn=generate,
            inputs=inputs,
            outputs=[gallery, seed, info],
            api_name=API_NAME,
            preprocess=False,
            concurrency_limit=concurrency or 2 * pipe.batch_size,
            show_progress_on=[gallery],
        )
        clicked = button.click(**event)
        submitted = prompt.submit(**event, api_visibility="private")
        # Stop cancels the page's running request; the engine frees its slots at the next chunk.
        stop.click(None, cancels=[clicked, submitted], api_visibility="private")

        form = [prompt, negative_prompt, seed, steps, guidance_scale, scheduler, size, per_device]
        for done in (clicked, submitted):
            done.success(
                remember, [history, gallery, *form], [history, history_gallery], api_visibility="private", queue=False
            )
        mode.change(
            lambda chosen: _variant(pipe).default_strength("mask" if chosen == "Inpaint" else None),
            [mode],
            [strength],
            api_visibility="private",
            queue=False,
        )
        history_gallery.select(restore, [history], [*form, random_seed], api_visibility="private", queue=False)
        dropped.upload(
            lambda image: read_png_info(pipe, image),
            [dropped],
            [*form, random_seed, info],
            api_visibility="private",
            queue=False,
        )

        # Live mode: every keystroke notes the latest text at once; the drawing waits for a pause and
        # draws only if its text is still the latest, so a burst of typing makes one picture, for its end.
        latest: dict[str, str] = {}

        def note(text, request: gr.Request):
            latest[request.session_hash] = text
            while len(latest) > 1000:  # one entry per browser tab; the oldest go first
                latest.pop(next(iter(latest)))

        async def draw_live(
            on, text, negative, seed_value, steps_value, guidance, kind, size_value, per, request: gr.Request
        ):
            await asyncio.sleep(LIVE_PAUSE_S)
            if not on or not (text or "").strip() or latest.get(request.session_hash) != text:
                yield gr.skip(), gr.skip(), gr.skip()
                return
            values = (text, negative, seed_value, steps_value, guidance, kind, size_value, per)
            raw = dict(zip(FORM_FIELDS, values, strict=True), random_seed=False)
            try:
                async for gallery_update, used_seed, details in run_generation(pipe, raw, None):
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
            concurrency_limit=concurrency or 2 * pipe.batch_size,
            api_visibility="private",
        )
        demo.load(show_history, [history], [history_gallery], api_visibility="private", queue=False)

        timer = gr.Timer(1.0, active=not pipe.ready)
        timer.tick(refresh_status, outputs=[status, timer], queue=False, api_visibility="private")
        demo.load(refresh_status, outputs=[status, timer], queue=False, api_visibility="private")
    return demo


def read_auth(value: str | None) -> list[tuple[str, str]] | None:
    """`--auth`: "user:password", several comma-separated, or a file with one pair per line."""
    if not value:
        return None
    text = Path(value).read_text() if Path(value).is_file() else value
    pairs = []
    for item in text.replace(",", "\n").splitlines():
        item = item.strip()
        if not item or item.startswith("#"):
            continue
        user, sep, password = item.partition(":")
        if not sep or not user or not password:
            raise ValueError(f"--auth: {item!r} is not user:password")
        pairs.append((user, password))
    if not pairs:
        raise ValueError("--auth: no user:password pair given")
    return pairs


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
    parser.add_argument("--queue-size", type=int, default=48, help="requests waiting at most; more are refused")
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=engine.DEFAULT_MAX_BATCH_SIZE,
        help="pictures drawn at once over all devices (rounded up to a multiple of the device count)",
    )
    parser.add_argument(
        "--sizes",
        default="common",
        help='sizes offered, "512x512,768x512,...", or "common" (the model\'s own and common aspect ratios)',
    )
    parser.add_argument(
        "--images-per-device", type=int, default=1, help="default images per device (the page can change it)"
    )
    parser.add_argument(
        "--auth",
        default=os.environ.get("JAX_SD_AUTH") or None,
        help='log-in for the page and its API: "user:password", several comma-separated, or a file of such '
        "lines (env JAX_SD_AUTH)",
    )
    parser.add_argument("--mcp", action="store_true", help="also serve /generate as an MCP tool (Gradio's MCP server)")
    parser.add_argument(
        "--no-safety-checker",
        action="store_true",
        help="do not run the model's own safety checker (for local use; a public page should keep it)",
    )
    parser.add_argument(
        "--controlnet",
        default=os.environ.get("JAX_SD_CONTROLNET") or None,
        help="a diffusers-format ControlNet folder or Hub id for the model (env JAX_SD_CONTROLNET); the page "
        "then takes a control picture",
    )
    parser.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a LoRA (.safetensors file, folder or Hub id) under a name; repeat for several. The page shows a "
        "weight slider for each",
    )
    args = parser.parse_args(argv)
    loras = {}
    for item in args.lora:
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            parser.error(f"--lora {item!r} is not NAME=PATH")
        if name.strip() in loras:
            parser.error(f"--lora: the name {name.strip()!r} is given twice")
        loras[name.strip()] = path.strip()
    if not 1 <= args.images_per_device <= MAX_IMAGES_PER_DEVICE:
        parser.error(f"--images-per-device must be from 1 to {MAX_IMAGES_PER_DEVICE}")
    if args.queue_size < 1:
        parser.error("--queue-size must be at least 1")
    if args.max_batch_size < 1:
        parser.error("--max-batch-size must be at least 1")
    sizes = args.sizes
    if sizes != "common":
        try:
            sizes = [tuple(int(v) for v in item.strip().lower().split("x")) for item in sizes.split(",")]
            assert all(len(pair) == 2 for pair in sizes)
        except (ValueError, AssertionError):
            parser.error('--sizes must be "common" or a list like "512x512,768x512"')
    try:
        auth = read_auth(args.auth)
    except ValueError as e:
        parser.error(str(e))
    # Our own progress lines; other libraries only when something is wrong (no backend-probing chatter).
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    log.setLevel(logging.INFO)

    engine.pair_cores()  # two CPU devices per image on a CPU host (engine/pairs.py), before JAX starts
    engine.enable_compile_cache()
    started = time.perf_counter()
    pipe = engine.load_pipeline(
        args.model,
        max_batch_size=args.max_batch_size,
        sizes=sizes,
        safety_checker=not args.no_safety_checker,
        controlnet=args.controlnet,
        loras=loras,
    )
    log.info("loaded %s on %s in %.1f s", pipe.model_name, pipe.devices, time.perf_counter() - started)
    pipe.start_warmup(num_images=args.images_per_device * len(pipe.devices))
    demo = create_demo(pipe, images_per_device=args.images_per_device)
    demo.queue(max_size=args.queue_size)
    demo.launch(
        server_name=args.host,
        server_port=args.port,
        share=args.share,
        show_error=True,
        theme=THEME,
        auth=auth,
        auth_message="This jax-sd page is for invited users: log in with the name and password you were given.",
        mcp_server=args.mcp,
    )


if __name__ == "__main__":
    main()
