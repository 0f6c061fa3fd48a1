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
# The keys this dataclass owns; everything else stays in `extra`, in the order it came.
_OWN = ("Steps", "Sampler", "Schedule type", "CFG scale", "Seed", "Size", "Model", "Denoising strength", "Clip skip")
_OWN += ("Eta", "Eta DDIM", "Deep cache", "Token merging ratio")
# A1111 writes a sampler's eta only when it is not the sampler's default (0 for ours, as diffusers' pipelines):
# "Eta DDIM" for DDIM (its `eta_infotext_field`), "Eta" for the others.
_ETA_KEYS = {"ddim": "Eta DDIM"}
# A1111's order for the keys that lead its line; the others follow in the order they came.
_ORDER = ("Steps", "Sampler", "Schedule type", "CFG scale", "Seed", "Size", "Model hash", "Model")


def _adapter_entries(request: GenerationRequest) -> dict[str, str]:
    """The LoRAs' weights and the ControlNet's scale, as text entries (the prompt stays as typed, with no
    A1111 `<lora:name:w>` tags; A1111's `Lora hashes` needs file hashes, which the request does not carry)."""
    extra = {}
    if request.lora_scales:
        extra["Lora weights"] = ", ".join(f"{name}: {weight:g}" for name, weight in request.lora_scales.items())
    if request.control_image is not None:
        extra["ControlNet weight"] = f"{request.controlnet_conditioning_scale:g}"
    return extra


@dataclass(frozen=True)
class GenerationParameters:
    """One picture's recipe, named as `GenerationRequest` names it. None: not recorded."""

    prompt: str
    negative_prompt: str = ""  # A1111 writes no negative line for an empty one, so None and "" read back as ""
    num_inference_steps: int | None = None  # "Steps"
    scheduler: str | None = None  # our kind ("euler_a"); None when the text names a sampler we do not have
    guidance_scale: float | None = None  # "CFG scale"
    seed: int | None = None  # this picture's own seed (image k of a request: seed + k)
    width: int | None = None  # "Size: {width}x{height}"
    height: int | None = None
    model: str | None = None  # "Model": the model's name, not a path to it
    clip_skip: int = 0  # layers skipped, as `GenerationRequest.clip_skip`; A1111 writes "Clip skip: 2" for 1
    strength: float | None = None  # "Denoising strength": image-to-image and inpainting only, as A1111 writes it
    eta: float = 0.0  # "Eta DDIM" (DDIM) or "Eta": the sampler's stochasticity, written when not 0
    deep_cache: int = 0  # "Deep cache": a whole UNet pass every that many steps (DeepCache), written when above 1
    token_merging: float = 0.0  # "Token merging ratio", as A1111 writes ToMe's ratio, when not 0
    # Every other key, as text, in the order written ("Model hash", "Version", "Sampler" when unknown to us, ...).
    extra: dict[str, str] = field(default_factory=dict, hash=False)

    @property
    def sampler(self) -> str | None:
        """A1111's name for the sampler: ours, else the one the text named."""
        return SAMPLER_NAMES[self.scheduler] if self.scheduler else self.extra.get("Sampler")

    @classmethod
    def from_request(cls, request: GenerationRequest, seed: int, model: str) -> GenerationParameters:
        """The recipe of one picture of a complete request (`Limits.resolve` has filled in the defaults)."""
        return cls(
            prompt=request.prompt,
            negative_prompt=request.negative_prompt or "",
            num_inference_steps=request.num_inference_steps,
            scheduler=request.scheduler,
            guidance_scale=request.guidance_scale,
            seed=seed,
            width=request.width,
            height=request.height,
            model=model,
            clip_skip=request.clip_skip,
            extra=_adapter_entries(request),
            strength=request.strength if request.image is not None else None,
            eta=float(request.eta),
            deep_cache=int(request.deep_cache) if request.deep_cache > 1 else 0,
            token_merging=float(request.token_merging),
        )

    def request_fields(self) -> dict[str, Any]:
        """The `GenerationRequest` keyword arguments this recipe sets (the ones recorded), for a form or a request."""
        fields = dict(
            prompt=self.prompt,
            negative_prompt=self.negative_prompt,
            seed=self.seed,
            num_inference_steps=self.num_inference_steps,
            guidance_scale=self.guidance_scale,
            height=self.height,
            width=self.width,
            scheduler=self.scheduler,
            clip_skip=self.clip_skip,
            strength=self.strength,
            eta=self.eta,
            deep_cache=self.deep_cache,
            token_merging=self.token_merging,
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


def format_parameters(params: GenerationParameters) -> str:
    """The text of the "parameters" chunk, laid out as A1111's `create_infotext` lays it out."""
    own: dict[str, str] = {}
    if params.num_inference_steps is not None:
        own["Steps"] = str(int(params.num_inference_steps))
    if params.scheduler is not None:
        if params.scheduler not in SAMPLER_NAMES:
            raise ValueError(f"unknown scheduler {params.scheduler!r}; one of {', '.join(SAMPLER_NAMES)}")
        own["Sampler"] = SAMPLER_NAMES[params.scheduler]
        if params.scheduler == "dpm++2m":  # else A1111 1.9+ reads a bare "DPM++ 2M" as Karras ("Automatic")
            own["Schedule type"] = "Uniform"
    if params.guidance_scale is not None:
        own["CFG scale"] = _number(params.guidance_scale)
    if params.seed is not None:
        own["Seed"] = str(int(params.seed))
    if params.width is not None and params.height is not None:
        own["Size"] = f"{int(params.width)}x{int(params.height)}"
    if params.model:
        own["Model"] = params.model
    if params.strength is not None:
        own["Denoising strength"] = _number(params.strength)
    if params.clip_skip:
        own["Clip skip"] = str(params.clip_skip + 1)
    if params.eta:
        own[_ETA_KEYS.get(params.scheduler, "Eta")] = _number(params.eta)
    if params.deep_cache > 1:
        own["Deep cache"] = str(params.deep_cache)
    if params.token_merging:
        own["Token merging ratio"] = _number(params.token_merging)
    pairs = {**params.extra, **own}  # our fields win over a stale copy in `extra`
    ordered = [key for key in _ORDER if key in pairs] + [key for key in pairs if key not in _ORDER]
    line = ", ".join(f"{key}: {quote(pairs[key])}" for key in ordered)
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
    clip_skip = _whole(pairs.get("Clip skip"))
    eta = _real(pairs.get("Eta DDIM", pairs.get("Eta")))
    deep_cache = _whole(pairs.get("Deep cache"))
    token_merging = _real(pairs.get("Token merging ratio"))
    values = dict(
        num_inference_steps=_whole(pairs.get("Steps")),
        scheduler=kind,
        guidance_scale=_real(pairs.get("CFG scale")),
        seed=_whole(pairs.get("Seed")),
        width=width,
        model=pairs.get("Model"),
        clip_skip=max(clip_skip - 1, 0) if clip_skip is not None else 0,
        strength=_real(pairs.get("Denoising strength")),
        eta=eta or 0.0,
        deep_cache=deep_cache or 0,
        token_merging=token_merging or 0.0,
    )
    # A key whose value we could not take (an unknown sampler, a seed that is not a number) stays as text.
    taken = {
        "Steps": values["num_inference_steps"] is not None,
        "Sampler": kind is not None,
        "Schedule type": kind is not None,
        "CFG scale": values["guidance_scale"] is not None,
        "Seed": values["seed"] is not None,
        "Size": width is not None,
        "Model": True,
        "Denoising strength": values["strength"] is not None,
        "Clip skip": clip_skip is not None,
        "Eta": eta is not None and "Eta DDIM" not in pairs,
        "Eta DDIM": eta is not None,
        "Deep cache": deep_cache is not None,
        "Token merging ratio": token_merging is not None,
    }
    extra = {key: value for key, value in pairs.items() if key not in _OWN or not taken[key]}
    return GenerationParameters(
        prompt="\n".join(prompt),
        negative_prompt="\n".join(negative),
        height=height,
        extra=extra,
        **values,
    )


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
