"""Raw values, from the page or a JSON body, turned into an `engine.GenerationRequest`.

Every door (the Gradio page, REST APIs) hands its raw values to `parse_request`; a value that cannot be read
raises `engine.InvalidRequest` with a message for the user, and the engine's own `Limits` then check the
ranges with theirs. Each door maps `InvalidRequest` to its own way of refusing (the page: `gr.Error`). No
Gradio here.
"""

from __future__ import annotations

import math
import secrets
from typing import Any

from PIL import Image

import engine
from engine import request_fields

# The page's mode labels -> the engine's modes; an API sends the same labels. "Edit": the model edits from reference
# pictures (`GenerationRequest.references`), offered only by a model that takes them.
MODES = {"Text to image": "txt2img", "Edit": "edit", "Image to image": "img2img", "Inpaint": "inpaint"}
# The ControlNet's and the LoRAs' inputs, in the order the page lists them after the form.
ADAPTER_INPUTS = ("control_image", "canny_edges", "controlnet_conditioning_scale", "lora_scales")
# `/generate`'s parameters as they stood before any field was added: the page's own ("random_seed", "size", ...) and
# the request fields' page names. Every other field with a place on the page follows, in `request_fields` order.
FIRST_INPUTS = ("prompt", "negative_prompt", "seed", "random_seed", "steps", "guidance_scale", "scheduler", "size")
FIRST_INPUTS += ("images_per_device", *ADAPTER_INPUTS, "mode", "picture", "mask", "strength")
# The page's own inputs added after callers had learnt `/generate`'s positions: after every field, so that a caller
# passing values by position (gradio_client, scripts) finds each parameter where it was
LAST_INPUTS = ("references",)  # the Edit mode's pictures
# The page's own inputs that a history entry keeps, beside the fields of the remembered sections.
REMEMBERED_OWN = ("size", "images_per_device")


def page_fields() -> dict[str, request_fields.RequestField]:
    """The request fields with a place on the page, by the page's name for them."""
    return {f.page_name: f for f in request_fields.current() if f.page}


def page_inputs() -> tuple[str, ...]:
    """`/generate`'s parameters in order: the first ones, every later field with a place on the page, the last ones."""
    return FIRST_INPUTS + tuple(name for name in page_fields() if name not in FIRST_INPUTS) + LAST_INPUTS


def form_fields() -> tuple[str, ...]:
    """The form's values that a history entry, a live drawing and a dropped picture's recipe hold, in order."""
    fields = page_fields()
    kept = [name for name, f in fields.items() if f.page.section in request_fields.REMEMBERED]
    return tuple(name for name in page_inputs() if name in kept or name in REMEMBERED_OWN)


def _refuse(message: str) -> engine.InvalidRequest:
    return engine.InvalidRequest(message)


def _shown(value: Any) -> str:
    # A value in a message, cut short: a 400-digit number is not echoed whole (nor converted: Python caps that).
    if isinstance(value, int) and abs(value) >= 10**30:
        return "a number of more than 30 digits"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def as_int(value: Any, what: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        if abs(value) >= 2**63:
            raise _refuse(f"{what} is out of range: {_shown(value)}.")
        return value
    try:
        number = float(str(value).strip()) if isinstance(value, str) else float(value)
    except (TypeError, ValueError, OverflowError):
        raise _refuse(f"{what} must be a whole number, not {_shown(value)}.") from None
    if not math.isfinite(number) or number != int(number) or abs(number) >= 2**63:
        raise _refuse(f"{what} must be a whole number in range, not {_shown(value)}.")
    return int(number)


def as_float(value: Any, what: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise _refuse(f"{what} must be a number, not {_shown(value)}.") from None
    return number


def as_text(value: Any, what: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise _refuse(f"{what} must be text.")
    return value.strip()


def as_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes", "on")
    return bool(value)


def size_choices(pipe: engine.EngineFace) -> list[str] | None:
    """The sizes the server offers, as "WxH" labels; None when any size in range is served."""
    sizes = pipe.limits.sizes
    return None if sizes is None else [f"{w}x{h}" for w, h in sizes]


def as_size(pipe: engine.EngineFace, value: Any) -> tuple[int, int]:
    text = str(value).strip().lower().replace("×", "x").split(" ")[0]
    width, _, height = text.partition("x")
    offered = size_choices(pipe)
    try:
        return int(width), int(height)
    except ValueError:
        choices = f"; choose one of {', '.join(offered)}" if offered else ""
        raise _refuse(f"Size must be written WIDTHxHEIGHT, like 512x512, not {value!r}{choices}.") from None


# ---- image-to-image and inpainting: the picture inputs ----------------------------------------


def variant_of(pipe: engine.EngineFace) -> engine.Variant:
    """What the model is; an engine that does not say is a text-to-image one."""
    return getattr(pipe, "variant", None) or engine.VARIANTS[0]


def mode_choices(pipe: engine.EngineFace) -> list[str]:
    """The modes the model can run: an inpainting model only repaints (its variant needs a picture and a mask), a
    model that only edits (FLUX.1 Kontext) only edits, and Edit is offered by a model that takes reference pictures."""
    if variant_of(pipe).needs:
        return ["Inpaint"]
    fewest, most = (getattr(pipe.limits, name, 0) for name in ("min_references", "max_references"))
    if fewest:
        return ["Edit"]
    return [mode for mode in MODES if most or mode != "Edit"]


def default_strength(pipe: engine.EngineFace, mode: Any) -> float:
    """The model's own strength for a mode (inpainting and image to image differ)."""
    return variant_of(pipe).default_strength("mask" if mode == "Inpaint" else None)


def picture_fields(mode: Any, picture: Any, mask: Any, strength: Any, references: Any = ()) -> dict[str, Any]:
    """The request's image, mask_image and strength from a mode, an image editor's value (or a picture) and an
    optional mask; PIL pictures. Inpainting without a mask reads the editor's painted layers as the mask. Edit: the
    `references` pictures, in order (the engine refuses them for a model that does not edit)."""
    kind = MODES.get(mode or "Text to image")
    if kind is None:
        raise _refuse(f"Mode must be one of {', '.join(MODES)}, not {mode!r}.")
    if kind == "txt2img":
        return {}
    if kind == "edit":
        if not references:
            raise _refuse("Edit needs the pictures to edit from: upload one or more reference pictures first.")
        # the picture takes the first one's size, as image to image takes its picture's
        return {"references": tuple(p.convert("RGB") for p in references), "width": None}
    editor = picture if isinstance(picture, dict) else {"background": picture, "layers": []}
    image = editor.get("background")
    if image is None:
        raise _refuse(f"{mode} needs a picture: upload one first.")
    fields = {"image": image.convert("RGB"), "strength": as_float(strength, "Strength"), "width": None}
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


# ---- ControlNet and LoRA ---------------------------------------------------------------------


def as_picture(value: Any) -> Image.Image | None:
    """The control picture, already opened by the door that received it (the page opens a client's upload
    through `pictures.ClientFiles`); a path or anything else is refused here, never opened."""
    if value is None or isinstance(value, Image.Image):
        return value
    raise _refuse("The control picture must be an uploaded image.")


def adapter_fields(
    pipe: engine.EngineFace,
    control_image: Any = None,
    canny_edges: Any = False,
    controlnet_conditioning_scale: Any = 1.0,
    lora_scales: Any = None,
) -> dict[str, Any]:
    """The request's ControlNet and LoRA fields; the Canny edge map, when asked for, is the engine's."""
    picture = as_picture(control_image)
    if picture is not None and as_bool(canny_edges):
        picture = pipe.canny_image(picture)
    fields = {"control_image": picture}
    if controlnet_conditioning_scale is not None:
        fields["controlnet_conditioning_scale"] = as_float(controlnet_conditioning_scale, "Conditioning scale")
    if lora_scales:
        if not isinstance(lora_scales, dict):
            raise _refuse("LoRA weights must map each LoRA's name to its weight.")
        fields["lora_scales"] = {name: as_float(w, f"LoRA {name} weight") for name, w in lora_scales.items()}
    return fields


# ---- the request ---------------------------------------------------------------------------


def read_value(f: request_fields.RequestField, value: Any, what: str) -> Any:
    """A field's raw value as its type; None or an empty box: the field's default (None: the model's own)."""
    if value is None or (value == "" and f.type is not str):
        return f.default
    if f.type is int:
        return as_int(value, what)
    if f.type is float:
        return as_float(value, what)
    if f.type is str:
        text = as_text(value, what)
        return text or None if f.default is None else text  # an empty optional text: none at all
    return value


def parse_request(
    pipe: engine.EngineFace,
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
    **values: Any,
) -> engine.GenerationRequest:
    """Turns the page's (or an API client's) raw values into a request; the engine checks their ranges.

    `pictures`: `picture_fields`' image, mask_image and strength; a picture brings its own size. `values`: the
    ControlNet's and the LoRAs' values (`adapter_fields`, all optional), then every other field of the page's
    basic and advanced sections by its page name (`request_fields`: "deep_cache", "token_merging", ...).
    Raises `engine.InvalidRequest` with a message for the user."""
    prompt = as_text(prompt, "Prompt")
    if not prompt:
        raise _refuse("Type a prompt first.")
    if as_bool(random_seed) or (isinstance(seed, str) and seed.strip().lower() in ("", "random")):
        seed = secrets.randbelow(engine.SEED_LIMIT)
    else:
        seed = as_int(seed, "Seed")
    per_device = as_int(images_per_device, "Images per device")
    top = pipe.limits.max_images_per_device
    if not 1 <= per_device <= top:
        raise _refuse(f"Images per device must be from 1 to {top}; {per_device} is out of range.")
    width, height = as_size(pipe, size)
    pictures = dict(pictures or {})
    if pictures.pop("width", 0) is None:
        width = height = None
    adapters = {name: values.pop(name) for name in ADAPTER_INPUTS if name in values}
    values.update(negative_prompt=negative_prompt, steps=steps, guidance_scale=guidance_scale, scheduler=scheduler)
    fields = page_fields()
    unknown = [name for name in values if name not in fields]
    if unknown:
        raise TypeError(f"parse_request() got unexpected values {', '.join(unknown)}")
    read = {fields[name].name: read_value(fields[name], value, fields[name].title) for name, value in values.items()}
    return engine.GenerationRequest(
        prompt=prompt,
        seed=seed,
        width=width,
        height=height,
        num_images=per_device * len(pipe.devices),
        **read,
        **adapter_fields(pipe, **adapters),
        **pictures,
    )


# ---- the APIs' requests ----------------------------------------------------------------------


def _optional_int(value: Any, what: str) -> int | None:
    return None if value is None or value == "" else as_int(value, what)


def api_request(prompt: Any, **values: Any) -> engine.GenerationRequest:
    """A REST API's values, already under the request's names (`request_fields`), as a request; None takes the
    model's default (an image brings its own size; one picture). A seed of None or -1 is drawn at random. The
    engine checks every range."""
    fields = request_fields.by_name(request_fields.current())
    unknown = [name for name in values if name not in fields]
    if unknown:
        raise TypeError(f"api_request() got unexpected fields {', '.join(unknown)}")
    seed = _optional_int(values.pop("seed", None), "seed")
    read = {
        "prompt": as_text(prompt, "prompt") or "",
        "seed": secrets.randbelow(engine.SEED_LIMIT) if seed is None or seed == -1 else seed,
        "num_images": as_int(1 if values.get("num_images") is None else values.pop("num_images"), "number of images"),
    }
    for name, value in values.items():
        if value is not None and value != {}:
            read[name] = read_value(fields[name], value, name)
    return engine.GenerationRequest(**read)
