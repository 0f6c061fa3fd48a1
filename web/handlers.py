"""What the page's events do, as plain functions over plain values: no widgets here.

A generation is `submit` (raw values -> a request and its ticket; raises `engine.InvalidRequest` or
`engine.Busy`), then `stream` (the ticket's events -> updates of the gallery, the seed and the details;
raises the engine's error when the request fails, `engine.Cancelled` when it was stopped). An update value
of None means "leave it as it is". The page (page.py) maps None to `gr.skip()` and errors to `gr.Error`.

Also here: the status and model lines, the history kept in the browser, a dropped picture's recipe, the
live mode's bookkeeping and the ControlNet's preview.
"""

from __future__ import annotations

import base64
import io
import logging
import os
import tempfile
from collections.abc import AsyncIterator, Callable
from typing import Any

from PIL import Image

import engine
from engine.compat.pnginfo import SAMPLER_NAMES, GenerationParameters, png_info, save_png, title_parts

from .callers import Caller, CallerLimits
from .pictures import ClientFiles, open_picture
from .requests import as_bool, form_fields, page_fields, parse_request, size_choices

log = logging.getLogger("jax-sd")

# The form's fields, in the order the page lists them: history entries, live drawings and PNG info use them
# (`requests.form_fields`, from `engine.request_fields`; this is the description as the server started with it).
FORM_FIELDS = form_fields()
HISTORY_LENGTH = 20


def live_pause_s(default: float = 0.3) -> float:
    """How long typing must pause before live mode draws: `JAX_SD_LIVE_PAUSE_S` seconds (0.05 to 5), else 0.3. A
    server whose cores are busy may deliver a burst of keys with gaps past a short pause, each gap then a drawing."""
    raw = os.environ.get("JAX_SD_LIVE_PAUSE_S", "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError:
        log.warning("JAX_SD_LIVE_PAUSE_S=%r is not a number of seconds; live mode pauses %g s", raw[:20], default)
        return default
    return min(max(value, 0.05), 5.0) if value == value else default


LIVE_PAUSE_S = live_pause_s()  # live mode draws once typing pauses this long
THUMBNAIL_SIDE = 96
MAX_UPSCALE = 4.0  # the page's Upscale: at most this many times a picture's sides

Update = tuple[list | None, int, str]  # (gallery, seed used, details); a None gallery is left as it is
Progress = Callable[..., Any]  # progress((step, total), desc=..., unit=...), as Gradio's tracker takes it


# ---- the lines that say what the server runs --------------------------------------------------


def model_summary(pipe: engine.EngineFace) -> str:
    """The model's family and the settings the page starts from, which follow the model (Turbo: 1 step, no guidance)."""
    d = pipe.defaults
    family = getattr(pipe, "label", None) or pipe.family
    safety = {
        "on": "the model's safety checker withholds flagged pictures",
        "off": "safety checker off (--no-safety-checker)",
        "none": "this model ships no safety checker: pictures are not filtered",
    }[getattr(pipe, "safety_mode", "none")]
    adapters = ""
    vae = getattr(pipe, "vae_name", None)
    if vae and vae != "the model's own VAE":
        adapters += f" · VAE `{vae}`"
    if getattr(pipe, "controlnet", None):
        adapters += f" · ControlNet `{pipe.controlnet}`"
    if getattr(pipe.limits, "loras", ()):
        adapters += f" · LoRAs: {', '.join(pipe.limits.loras)}"
    embeddings = getattr(getattr(pipe, "embeddings", None), "loaded", ())  # textual inversion, called by name
    if embeddings:
        adapters += f" · embeddings: {', '.join(e.name for e in embeddings)}"
    return (
        f"**{family}** · defaults: {d['width']}×{d['height']}, {d['num_inference_steps']} steps, "
        f"guidance {d['guidance_scale']:g}, {d['scheduler']} · {safety}{adapters}"
    )


def status_line(pipe: engine.EngineFace) -> str:
    """Warming up, or ready: where the model runs, how many pictures at once, how the warm-up went."""
    n = len(pipe.devices)
    unit = "core pair" if getattr(pipe, "core_pairs", False) else "device"
    where = f"`{pipe.model_name}` on {n} {unit}{'s' if n != 1 else ''} ({', '.join(pipe.devices)})"
    computed = getattr(pipe, "compute_path", None)  # "float32, XLA (avx2)": the dtype and what computes it
    where += f", computed in {computed}" if computed else ""
    slots = f"{pipe.batch_size} pictures drawn at once"
    state = pipe.warmup_state
    if not pipe.ready:
        return f"**Warming up**: compiling {where} for the default size. Requests wait until it is done."
    if state.error:
        return f"Ready: {where}, {slots}. Warm-up failed ({state.error}); the first request compiles instead."
    if state.seconds is None:
        return f"Ready: {where}, {slots}."
    return f"Ready: {where}, {slots}. Warm-up compiled in {state.seconds:.1f} s."


# ---- one generation, streamed ----------------------------------------------------------------


def describe(result: engine.GenerationResult, random_seed: bool) -> str:
    """The details line under the pictures."""
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


def with_parameters(
    image: Image.Image, request: engine.GenerationRequest, seed: int, model: str, files: ClientFiles | None = None
) -> str:
    """The picture as a PNG file that carries its recipe (A1111's "parameters" chunk): what the gallery serves,
    so a downloaded picture remembers how it was made. `files`: where it is noted as written, and deleted in time."""
    if files is not None:
        path = files.new_picture(prefix=f"seed{seed}-")
    else:
        handle, path = tempfile.mkstemp(suffix=".png", prefix=f"seed{seed}-")
        os.close(handle)
    save_png(image, path, GenerationParameters.from_request(request, seed, model))
    return path


def _placeholder(size: tuple[int, int]) -> Image.Image:
    # A plain grey picture where the safety checker withheld one; its caption says why, and its seed.
    return Image.new("RGB", size, (128, 128, 128))


def _preview_gallery(event: engine.Preview, request: engine.GenerationRequest, step: str) -> list:
    # Latent-resolution previews, scaled up so that they fill the picture's place in the gallery.
    return [
        (Image.fromarray(img).resize((request.width, request.height), Image.Resampling.BILINEAR), f"preview · {step}")
        for img in event.images
    ]


def submit(
    pipe: engine.EngineFace, raw: dict[str, Any], limits: CallerLimits | None = None, caller: Caller | None = None
) -> tuple[engine.GenerationRequest, engine.Ticket]:
    """Raw values (`parse_request`'s arguments) -> the request and its ticket, submitted as `caller` within its
    share (`limits`). Raises `engine.InvalidRequest` (a value) or `engine.Busy` (the waiting room is full, or
    `CallerBusy`: the caller's share)."""
    request = parse_request(pipe, **raw)
    limits, caller = limits or CallerLimits(), caller or Caller("")
    return request, limits.submit(pipe, request, caller)


async def stream(
    pipe: engine.EngineFace,
    request: engine.GenerationRequest,
    ticket: engine.Ticket,
    random_seed: Any = False,
    progress: Progress | None = None,
    files: ClientFiles | None = None,
) -> AsyncIterator[Update]:
    """The ticket's events as updates: queue position, previews, then the pictures with "device · seed"
    captions (PNG files with their recipe, noted in `files` as written here, so that a client may hand them
    back). Raises the request's error if it fails (`engine.Cancelled`: stopped)."""
    step = "starting"
    async for event in ticket.aevents():
        if isinstance(event, engine.Queued):
            yield None, request.seed, f"Waiting for a free slot: number {event.position} in line."
        elif isinstance(event, engine.Loading):
            yield None, request.seed, f"Loading the model {event.model}: drawing starts once it is in memory."
        elif isinstance(event, engine.Progress):
            step = f"step {event.step}/{event.total}"
            if progress is not None:
                progress((event.step, event.total), desc="Denoising", unit="steps")
        elif isinstance(event, engine.Preview):
            yield _preview_gallery(event, ticket.request, step), request.seed, f"Drawing: {step}"
        elif isinstance(event, engine.Failed):
            raise event.error
        elif isinstance(event, engine.Finished):
            result = event.result
            flagged = result.nsfw_content_detected or [False] * len(result.images)
            gallery = []
            for image, device, seed, withheld in zip(result.images, result.devices, result.seeds, flagged, strict=True):
                if withheld:
                    gallery.append((_placeholder(image.size), f"filtered by the safety checker · seed {seed}"))
                    continue
                path = with_parameters(image, result.request, seed, pipe.model_name, files)
                drawn_by = f"{title_parts(result.request.model)[0]} · " if result.request.model else ""
                gallery.append((path, f"{drawn_by}{device} · seed {seed}"))
            yield gallery, request.seed, describe(result, as_bool(random_seed))


# ---- a dropped picture's recipe ---------------------------------------------------------------


def read_png_info(pipe: engine.EngineFace, image: Any, files: ClientFiles) -> list:
    """A dropped picture's recipe: the form's values (FORM_FIELDS), then random_seed, then a note.
    `image`: the uploaded file (Gradio's file data or its path), opened only as `files` allows.
    None leaves a field as it is. Raises `engine.InvalidRequest` for a file it may not or cannot read."""
    if isinstance(image, dict) and not image.get("path"):
        image = None
    form = form_fields()
    params = png_info(files.picture(image, "The dropped picture")) if image is not None else None
    if params is None:
        note = "That picture carries no generation parameters." if image is not None else None
        return [None] * (len(form) + 1) + [note]
    fields = params.request_fields()
    size = f"{params.width}x{params.height}" if params.width and params.height else None
    offered = size_choices(pipe)
    scheduler = params.scheduler
    if scheduler is not None and scheduler not in pipe.limits.schedulers:  # "Euler" on a flow model: its own Euler
        same = [kind for kind in pipe.limits.schedulers if SAMPLER_NAMES.get(kind) == SAMPLER_NAMES[scheduler]]
        scheduler = same[0] if same else scheduler
    described = page_fields()
    values = {name: fields.get(described[name].name) for name in form if name in described}
    values.update(
        negative_prompt=params.negative_prompt,
        scheduler=scheduler,
        size=size if size and (offered is None or size in offered) else None,
        images_per_device=None,
    )
    notes = [f"Read from the picture: {params.sampler or 'sampler'}, seed {params.seed}."]
    if size and values["size"] is None:
        notes.append(f"Its size {size} is not offered here; the size is unchanged.")
    if params.scheduler is None:
        notes.append("Its sampler is not one of ours; the scheduler is unchanged.")
    return [*(values[name] for name in form), False, " ".join(notes)]


# ---- history (kept in the browser) ------------------------------------------------------------


def thumbnail(picture: Image.Image | str) -> str:
    """A small PNG of one of this server's own results (a PIL picture, or a file the server wrote), as base64."""
    with Image.open(picture) if isinstance(picture, str) else picture.copy() as image:
        image.thumbnail((THUMBNAIL_SIDE, THUMBNAIL_SIDE))
        buffer = io.BytesIO()
        image.convert("RGB").save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def _shown(entry: Any) -> Image.Image:
    # A thumbnail from the browser's storage, which a client may have written: a small PNG or a grey square.
    try:
        data = base64.b64decode(entry["thumbnail"], validate=True)
        return open_picture(data, "A history thumbnail", THUMBNAIL_SIDE * THUMBNAIL_SIDE)
    except (TypeError, KeyError, ValueError, engine.InvalidRequest):
        return _placeholder((THUMBNAIL_SIDE, THUMBNAIL_SIDE))


def show_history(history: list[dict] | None) -> list:
    """The history's thumbnails, captioned with their seeds."""
    entries = history if isinstance(history, list) else []
    return [(_shown(entry), f"seed {entry.get('seed') if isinstance(entry, dict) else '?'}") for entry in entries]


class LastResults:
    """The thumbnail of each browser tab's last finished generation, kept by the server: a history entry is
    made from it, never from a picture the client names."""

    def __init__(self, capacity: int = 1000):
        self.capacity = capacity
        self._thumbnails: dict[str, str] = {}

    def keep(self, session: str | None, picture: Image.Image | str) -> None:
        if not session:
            return
        self._thumbnails.pop(session, None)
        self._thumbnails[session] = thumbnail(picture)
        while len(self._thumbnails) > self.capacity:  # one entry per browser tab; the oldest go first
            self._thumbnails.pop(next(iter(self._thumbnails)))

    def take(self, session: str | None) -> str | None:
        return self._thumbnails.pop(session, None) if session else None


def remember(history: list[dict] | None, picture: str | None, *form) -> tuple[list[dict], list]:
    """Puts the finished generation first in the browser's history: its settings and `picture`, the thumbnail
    the server kept of it (`LastResults`); without one the history stays as it is."""
    history = history if isinstance(history, list) else []
    if not picture:
        return history, show_history(history)
    entry = dict(zip(form_fields(), form, strict=True), thumbnail=picture)
    history = [entry, *history][:HISTORY_LENGTH]
    return history, show_history(history)


def restore(history: list[dict], index: int) -> list:
    """The settings of the generation at `index`, for the form (its seed fixed, so it draws the same)."""
    entry, described = history[index], page_fields()
    # An entry saved before a field existed restores that field's default.
    return [entry[name] if name in entry else described[name].default for name in form_fields()] + [False]


# ---- live mode and the ControlNet's preview -------------------------------------------------


class LiveTexts:
    """The latest text typed in each browser tab: a live drawing runs only if its text is still the latest,
    so a burst of typing makes one picture, for its end."""

    def __init__(self, capacity: int = 1000):
        self.capacity = capacity
        self._latest: dict[str, str] = {}

    def note(self, session: str, text: str) -> None:
        self._latest[session] = text
        while len(self._latest) > self.capacity:  # one entry per browser tab; the oldest go first
            self._latest.pop(next(iter(self._latest)))

    def is_latest(self, session: str, text: str) -> bool:
        return self._latest.get(session) == text


def live_values(*form: Any) -> dict[str, Any]:
    """A live drawing's raw values: the form's, with its seed as it stands."""
    return dict(zip(form_fields(), form, strict=True), random_seed=False)


def upscale_picture(pipe: engine.EngineFace, picture: Image.Image | None, scale: Any, upscaler: Any) -> Image.Image:
    """The page's Upscale: a picture `scale` times larger through one of the server's upscalers (Extras' work)."""
    if picture is None:
        raise engine.InvalidRequest("Upload a picture to upscale first.")
    try:
        factor = float(scale)
    except (TypeError, ValueError):
        raise engine.InvalidRequest(f"Upscale by must be a number, not {scale!r}.") from None
    if not 1 <= factor <= MAX_UPSCALE:
        raise engine.InvalidRequest(f"Upscale by must be from 1 to {MAX_UPSCALE:g}, not {factor:g}.")
    width, height = (round(side * factor) for side in picture.size)
    return pipe.upscale(picture.convert("RGB"), width, height, str(upscaler))


def control_preview(pipe: engine.EngineFace, picture: Image.Image | None, canny: bool) -> Image.Image | None:
    """What the ControlNet will see: the picture, or its Canny edge map."""
    if picture is None:
        return None
    return pipe.canny_image(picture) if canny else picture
