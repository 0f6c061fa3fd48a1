"""How a picture was made, inside the picture: the "parameters" PNG text chunk as AUTOMATIC1111 writes it.

AUTOMATIC1111's web UI (`create_infotext` in modules/processing.py, read back by
`parse_generation_parameters` in modules/infotext_utils.py) stores three parts, one per line:

    a photo of a cat
    Negative prompt: blurry
    Steps: 20, Sampler: Euler a, CFG scale: 7, Seed: 5, Size: 512x512, Model: sd-turbo

The prompt may span several lines; the negative line is left out when there is none; the last line is
`key: value` pairs, a value quoted as a JSON string when it holds a comma, a colon or a newline. ComfyUI,
Fooocus, InvokeAI, Civitai and this page read it, so a picture carries its own recipe between them.
"""

from __future__ import annotations

import io
import json
import math
import re
from dataclasses import dataclass, field
from os import PathLike
from typing import IO, TYPE_CHECKING, Any

from PIL import Image
from PIL.PngImagePlugin import PngInfo

from .. import request_fields
from ..loading.models_folder import title_parts

if TYPE_CHECKING:
    from ..request import GenerationRequest

CHUNK_KEY = "parameters"
FORMATS = ("PNG", "JPEG", "WEBP")  # the formats a picture's recipe is read from; no other decoder runs
MAX_PIXELS = 4096 * 4096  # a file larger than this is not read (a server passes its own limit)

# Our scheduler kinds and the sampler names A1111 gives them (PNDM without Runge-Kutta warm-up is PLMS).
SAMPLER_NAMES = {
    "pndm": "PLMS",
    "ddim": "DDIM",
    "euler": "Euler",
    "euler_a": "Euler a",
    "dpm++2m": "DPM++ 2M",
    "dpm++2m_karras": "DPM++ 2M Karras",
    "lcm": "LCM",  # A1111's name for it
    "tcd": "TCD",  # A1111 has none; Forge and SD.Next call it this
    "flow_euler": "Euler",  # A1111 and Forge call Euler on a flow model (SD3, FLUX.1) Euler too
}
# A1111 1.9 split the sigma schedule out of the sampler name ("DPM++ 2M Karras" became "DPM++ 2M" with
# "Schedule type: Karras"), and its "Automatic" schedule is Karras for DPM++ 2M and the model's own
# uniform one for the others; "Uniform" is the model's own. Before 1.9 there was no "Schedule type", and a
# plain "DPM++ 2M" was uniform.
_AUTOMATIC = {"DPM++ 2M": "Karras"}
_SCHEDULE_SUFFIX = {"Karras": " Karras", "Uniform": ""}
_KINDS: dict[str, str] = {}  # a name read back is the first kind of that name ("Euler": euler); a flow model's door
for _kind, _name in SAMPLER_NAMES.items():  # takes its own Euler for it (web/names.py)
    _KINDS.setdefault(_name, _kind)

# A1111's `re_param`: a key starts with a word character; a value is a JSON string or runs to the next comma.
_PARAM = re.compile(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')
_SIZE = re.compile(r"^(\d+)x(\d+)$")
_NEGATIVE = "Negative prompt:"
# A1111's order for the keys that lead its line; the others follow in the order they came.
_ORDER = ("Steps", "Sampler", "Schedule type", "CFG scale", "Seed", "Size", "Model hash", "Model")


def _recorded() -> dict[str, request_fields.RequestField]:
    """The request fields a recipe records: those with a key in PNG parameters, in the description's order."""
    return {f.name: f for f in request_fields.current() if f.png}


def _unset(f: request_fields.RequestField) -> Any:
    # A recipe's value when not recorded: the field's default, or None where the default would be written (a seed).
    return None if f.default is None or f.is_written(f.default) else f.default


def _adapter_entries(request: GenerationRequest) -> dict[str, str]:
    """The LoRAs' weights and the ControlNet's scale, as text entries (the prompt stays as typed, with no
    A1111 `<lora:name:w>` tags; A1111's `Lora hashes` needs file hashes, which the request does not carry)."""
    extra = {}
    if request.lora_scales:
        extra["Lora weights"] = ", ".join(f"{name}: {weight:g}" for name, weight in request.lora_scales.items())
    if request.control_image is not None:
        extra["ControlNet weight"] = f"{request.controlnet_conditioning_scale:g}"
    return extra


@dataclass(frozen=True, init=False)
class GenerationParameters:
    """One picture's recipe, named as `GenerationRequest` names it. None: not recorded.

    Its own fields: the prompt, the negative prompt (A1111 writes no negative line for an empty one, so None and ""
    read back as ""), the scheduler (our kind; None when the text names a sampler we do not have), the size and the
    model's name; then every request field with a `png` key (`request_fields`), in `values` and as keyword
    arguments and attributes: `num_inference_steps`, `guidance_scale`, `seed` (this picture's own: image k of a
    request is seed + k), `strength` (with a picture only), `clip_skip`, `eta`, `deep_cache`, `token_merging`, ...
    `extra`: every other key, as text, in the order written ("Model hash", "Version", "Sampler" when unknown to us).
    """

    prompt: str
    negative_prompt: str
    scheduler: str | None
    width: int | None
    height: int | None
    model: str | None
    values: dict[str, Any] = field(hash=False)
    extra: dict[str, str] = field(hash=False)

    def __init__(
        self,
        prompt: str,
        negative_prompt: str = "",
        num_inference_steps: int | None = None,
        scheduler: str | None = None,
        guidance_scale: float | None = None,
        seed: int | None = None,
        width: int | None = None,
        height: int | None = None,
        model: str | None = None,
        extra: dict[str, str] | None = None,
        values: dict[str, Any] | None = None,
        **recorded: Any,
    ):
        fields = _recorded()
        unknown = [name for name in recorded if name not in fields]
        if unknown:
            raise TypeError(f"GenerationParameters records no field {', '.join(unknown)}")
        given = dict(num_inference_steps=num_inference_steps, guidance_scale=guidance_scale, seed=seed)
        if values is not None:  # `dataclasses.replace`: the values as they were, then the changed ones
            given = {name: values[name] for name in given if name in values} | {
                name: value for name, value in given.items() if value is not None
            }
        merged = {**(values or {}), **given, **recorded}
        own = dict(prompt=prompt, negative_prompt=negative_prompt, scheduler=scheduler, width=width, height=height)
        for name, value in own.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "values", {name: merged.get(name, _unset(f)) for name, f in fields.items()})
        object.__setattr__(self, "extra", dict(extra or {}))

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("values", {})
        if name in values:
            return values[name]
        raise AttributeError(f"GenerationParameters has no {name!r}")

    @property
    def sampler(self) -> str | None:
        """A1111's name for the sampler: ours, else the one the text named."""
        return SAMPLER_NAMES[self.scheduler] if self.scheduler else self.extra.get("Sampler")

    @classmethod
    def from_request(cls, request: GenerationRequest, seed: int, model: str) -> GenerationParameters:
        """The recipe of one picture of a complete request (`Limits.resolve` has filled in the defaults)."""
        recorded = {}
        pictured = request.image is not None or getattr(request, "hires", False)  # hires: redrawn as a picture
        for name, f in _recorded().items():
            value = seed if name == "seed" else getattr(request, name, f.default)
            if f.needs_image and not pictured or not f.is_written(value):
                value = _unset(f)  # written only with a picture (denoising strength); or off (deep cache 1)
            recorded[name] = value if value is None else f.type(value)
        extra = _adapter_entries(request)
        if getattr(request, "model", None):  # a models folder's checkpoint: A1111's model name and short hash
            model, short = title_parts(request.model)
            if short:
                extra = {"Model hash": short, **extra}
        return cls(
            prompt=request.prompt,
            negative_prompt=request.negative_prompt or "",
            scheduler=request.scheduler,
            width=request.width,
            height=request.height,
            model=model,
            extra=extra,
            **recorded,
        )

    def request_fields(self) -> dict[str, Any]:
        """The `GenerationRequest` keyword arguments this recipe sets (the ones recorded), for a form or a request."""
        fields = dict(
            prompt=self.prompt,
            negative_prompt=self.negative_prompt,
            height=self.height,
            width=self.width,
            scheduler=self.scheduler,
            **self.values,
        )
        return {name: value for name, value in fields.items() if value is not None}


def quote(value: Any) -> str:
    """A1111's `quote`: a value holding a comma, a colon or a newline is written as a JSON string."""
    text = str(value)
    if "," not in text and ":" not in text and "\n" not in text:
        return text
    return json.dumps(text, ensure_ascii=False)


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] == '"':
        try:
            return json.loads(text)
        except ValueError:
            return text
    return text


def _number(value: float) -> str:
    """7.0 -> "7", as A1111's sliders hand it whole numbers; 7.5 -> "7.5"; the shortest text that reads back."""
    value = float(value)
    return str(int(value)) if value.is_integer() else repr(value)


def settings(params: GenerationParameters) -> dict[str, str]:
    """The settings line's keys and values as text, in A1111's order (its leading keys, then as they came)."""
    own: dict[str, str] = {}
    if params.scheduler is not None and params.scheduler not in SAMPLER_NAMES:
        raise ValueError(f"unknown scheduler {params.scheduler!r}; one of {', '.join(SAMPLER_NAMES)}")
    for name, f in _recorded().items():
        value = params.values[name]
        if value is None or not f.is_written(value):
            continue
        value = f.to_a1111(value) if f.to_a1111 else value
        if f.range == "schedulers":  # a sampler of ours (hires fix's second pass's): by A1111's name
            value = SAMPLER_NAMES.get(value, value)
        own[f.png_key(params.scheduler)] = (
            str(value) if f.type is str else str(int(value)) if f.type is int else _number(value)
        )
    if params.scheduler is not None:
        own["Sampler"] = SAMPLER_NAMES[params.scheduler]
        if params.scheduler == "dpm++2m":  # else A1111 1.9+ reads a bare "DPM++ 2M" as Karras ("Automatic")
            own["Schedule type"] = "Uniform"
    if params.width is not None and params.height is not None:
        own["Size"] = f"{int(params.width)}x{int(params.height)}"
    if params.model:
        own["Model"] = params.model
    pairs = {**params.extra, **own}  # our fields win over a stale copy in `extra`
    ordered = [key for key in _ORDER if key in pairs] + [key for key in pairs if key not in _ORDER]
    return {key: pairs[key] for key in ordered}


def format_parameters(params: GenerationParameters) -> str:
    """The text of the "parameters" chunk, laid out as A1111's `create_infotext` lays it out."""
    line = ", ".join(f"{key}: {quote(value)}" for key, value in settings(params).items())
    negative = f"\n{_NEGATIVE} {params.negative_prompt}" if params.negative_prompt else ""
    return f"{params.prompt}{negative}\n{line}".strip()


def _scheduler(sampler: str | None, schedule: str | None) -> str | None:
    """Our kind for an A1111 sampler name and "Schedule type" (absent: the name says it all, as before 1.9)."""
    if sampler is None:
        return None
    if schedule is not None:
        if schedule == "Automatic":
            schedule = _AUTOMATIC.get(sampler, "Uniform")
        if schedule not in _SCHEDULE_SUFFIX:
            return None
        sampler += _SCHEDULE_SUFFIX[schedule]
    return _KINDS.get(sampler)


def _whole(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _real(text: str | None) -> float | None:
    try:
        value = float(text) if text is not None else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None


def parse_parameters(text: str) -> GenerationParameters:
    """Reads a "parameters" text back, as A1111's `parse_generation_parameters` does.

    The last line holds the settings when at least three `key: value` pairs are found in it (else it is
    part of the prompt); the lines before it are the prompt, up to a line that starts with
    "Negative prompt:", which starts the negative prompt. Each line is stripped, as A1111 strips it. A
    value that does not read as what its key needs (a seed that is not a number) stays in `extra`.
    """
    *lines, last = text.strip().split("\n")
    if len(_PARAM.findall(last)) < 3:
        lines.append(last)
        last = ""
    prompt: list[str] = []
    negative: list[str] = []
    for line in lines:
        line = line.strip()
        if not negative and line.startswith(_NEGATIVE):
            negative.append(line[len(_NEGATIVE) :].strip())
        elif negative:
            negative.append(line)
        else:
            prompt.append(line)
    pairs = {key: _unquote(value) if value.startswith('"') else value for key, value in _PARAM.findall(last)}

    kind = _scheduler(pairs.get("Sampler"), pairs.get("Schedule type"))
    width = height = None
    if size := _SIZE.match(pairs.get("Size", "")):
        width, height = int(size.group(1)), int(size.group(2))
    taken = {"Sampler": kind is not None, "Schedule type": kind is not None, "Size": width is not None}
    taken["Model"] = True
    recorded = {}
    for name, f in _recorded().items():
        key = next((key for key in f.png_keys() if key in pairs), None)
        if key is None:
            continue
        value = pairs[key] if f.type is str else (_whole if f.type is int else _real)(pairs[key])
        if f.range == "schedulers":  # A1111's sampler name: our kind, or (a sampler we lack) kept as text
            value = _KINDS.get(value)
        taken[key] = value is not None  # a value that does not read as its type (a seed of "abc") stays as text
        if value is not None:
            recorded[name] = f.from_a1111(value) if f.from_a1111 else value
    extra = {key: value for key, value in pairs.items() if not taken.get(key, False)}
    return GenerationParameters(
        prompt="\n".join(prompt),
        negative_prompt="\n".join(negative),
        scheduler=kind,
        width=width,
        height=height,
        model=pairs.get("Model"),
        extra=extra,
        **recorded,
    )


def infotext_items(params: GenerationParameters) -> dict[str, str]:
    """The recipe as A1111's `/png-info` gives its `parameters`: "Prompt", "Negative prompt", then each key of the
    settings line with its value as text."""
    return {"Prompt": params.prompt, "Negative prompt": params.negative_prompt, **settings(params)}


def save_png(image: Image.Image, target: str | PathLike | IO[bytes], params: GenerationParameters) -> None:
    """Writes `image` as a PNG with the "parameters" chunk (tEXt, or iTXt for text beyond Latin-1)."""
    info = PngInfo()
    info.add_text(CHUNK_KEY, format_parameters(params))
    image.save(target, format="PNG", pnginfo=info)


def png_info(
    source: Image.Image | bytes | str | PathLike | IO[bytes], max_pixels: int = MAX_PIXELS
) -> GenerationParameters | None:
    """The parameters a picture carries (a PIL image, PNG bytes, a path or a file), or None when it has none.
    A file is opened only as a PNG, JPEG or WebP of at most `max_pixels` pixels (from its header, before its pixels
    are read); else ValueError."""
    if isinstance(source, Image.Image):
        text = source.info.get(CHUNK_KEY)
    else:
        with Image.open(
            io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source, formats=FORMATS
        ) as image:
            if image.size[0] * image.size[1] > max_pixels:
                raise ValueError(
                    f"the picture is {image.size[0]}x{image.size[1]}; at most {max_pixels} pixels are read"
                )
            image.load()  # text chunks written after the pixels are read only with them
            text = image.info.get(CHUNK_KEY)
    if not isinstance(text, str) or not text.strip():
        return None
    return parse_parameters(text)
