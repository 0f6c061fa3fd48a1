"""What the REST APIs share: pictures in (base64 or uploads, their size checked before their pixels are read) and
out (PNG with A1111's "parameters" chunk), and the requests the APIs are running (`ApiJobs`).

Each API request is submitted to the engine and awaited on the event loop (`Ticket.aevents`, never a blocked
thread). The running ones are kept by caller (callers.py: the credential, else the address), so that A1111's `/progress`
and `/interrupt` answer about and stop the caller's own requests only; anonymous callers behind a proxy that is not
trusted are one caller, and their progress shows no preview. Each caller's share of the engine is held by
`CallerLimits`. A request whose client hangs up is stopped, waiting or drawing.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from fastapi import Request
from PIL import Image

import engine
from engine.compat.pnginfo import GenerationParameters, save_png

from .callers import Caller, CallerLimits
from .callers import caller_of as _caller_of
from .pictures import open_picture

DISCONNECT_POLL_S = 0.5
PLACEHOLDER_GREY = (128, 128, 128)  # a picture the safety checker withheld, as the page shows it


def _refuse(message: str) -> engine.InvalidRequest:
    return engine.InvalidRequest(message)


# ---- pictures in ------------------------------------------------------------------------------------


def decode_base64(text: object, what: str) -> bytes:
    """The bytes of a base64 picture, with or without a `data:image/...;base64,` prefix."""
    if not isinstance(text, str) or not text.strip():
        raise _refuse(f"{what} must be a base64-encoded picture")
    text = text.strip()
    if text.startswith("data:"):
        _, sep, text = text.partition(",")
        if not sep:
            raise _refuse(f"{what} is a data URL without data")
    text = "".join(text.split())
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise _refuse(f"{what} is not valid base64") from None


def read_picture(data: bytes, what: str, max_pixels: int) -> Image.Image:
    """A picture from its file's bytes: a PNG, JPEG or WebP whose pixel count, read from its header, is at most
    `max_pixels` (the server's `--max-picture-pixels`), checked before the pixels are decoded."""
    return open_picture(data, what, max_pixels)


def opaque(image: Image.Image) -> Image.Image:
    """The picture to draw from: its colours, any transparency dropped."""
    return image.convert("RGB")


def reference_count(pipe: engine.EngineFace) -> tuple[int, int]:
    """(fewest, most) reference pictures the model edits from (`Limits.min_references`, `max_references`); (0, 0) for a
    model that does not edit, which draws from an API's picture as image to image instead."""
    limits = pipe.limits
    return getattr(limits, "min_references", 0), getattr(limits, "max_references", 0)


def read_references(
    pipe: engine.EngineFace, pictures: list[bytes], field: str, max_pixels: int
) -> tuple[Image.Image, ...]:
    """Every picture an API request sends in `field` (file bytes), each a reference to edit from for a model that
    edits: their count checked before any is decoded, each one's size from its header (`read_picture`), its colours
    only."""
    most = reference_count(pipe)[1]
    if not pictures:
        raise _refuse(f"send the picture to edit in {field}")
    if len(pictures) > most:
        raise _refuse(f"{len(pictures)} pictures in {field} are too many: this model edits from at most {most}")
    return tuple(opaque(read_picture(data, f"{field}[{k}]", max_pixels)) for k, data in enumerate(pictures))


# ---- pictures out -----------------------------------------------------------------------------------


def png_bytes(image: Image.Image, params: GenerationParameters | None = None) -> bytes:
    """PNG file bytes; with `params`, A1111's "parameters" chunk (the picture's recipe)."""
    buffer = io.BytesIO()
    if params is None:
        image.save(buffer, format="PNG")
    else:
        save_png(image, buffer, params)
    return buffer.getvalue()


def result_pngs(result: engine.GenerationResult, model: str) -> list[tuple[bytes, int, bool]]:
    """(PNG bytes, seed, withheld) per picture; a picture the safety checker withheld is a grey placeholder."""
    flagged = result.nsfw_content_detected or [False] * len(result.images)
    out = []
    for image, seed, withheld in zip(result.images, result.seeds, flagged, strict=True):
        if withheld:
            out.append((png_bytes(Image.new("RGB", image.size, PLACEHOLDER_GREY)), seed, True))
        else:
            out.append((png_bytes(image, GenerationParameters.from_request(result.request, seed, model)), seed, False))
    return out


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


# ---- the APIs' running requests -----------------------------------------------------------------------


def caller_of(http: Request) -> Caller:
    """Who is calling: the credential's name (set by `ApiGate`), else the client's address."""
    return _caller_of(http.scope)


@dataclass(eq=False)
class ApiJob:
    """One API request in the engine: its ticket and what its events said so far."""

    caller: Caller
    ticket: engine.Ticket
    started: float = field(default_factory=time.time)
    position: int | None = None  # in the engine's queue, while it waits
    loading: str | None = None  # the model it waits for, while that model loads (a server of several models)
    step: int = 0
    total: int = 0
    preview: np.ndarray | None = None  # the first picture's latest preview
    result: engine.GenerationResult | None = None
    error: BaseException | None = None  # the request's error: InvalidRequest, Cancelled, GenerationFailed, ...

    @property
    def request(self) -> engine.GenerationRequest:
        return self.ticket.request  # complete: the model's defaults filled in

    def note(self, event: engine.Event) -> None:
        if isinstance(event, engine.Queued):
            self.position, self.loading = event.position, None
        elif isinstance(event, engine.Loading):
            self.loading = event.model
        elif isinstance(event, engine.Progress):
            self.position, self.loading, self.step, self.total = None, None, event.step, event.total
        elif isinstance(event, engine.Preview) and event.images:
            self.preview = event.images[0]
        elif isinstance(event, engine.Finished):
            self.result = event.result
        elif isinstance(event, engine.Failed):
            self.error = event.error

    async def wait(self, http: Request | None, heard: Callable[[engine.Event], None] | None = None) -> None:
        """Follows the ticket to its end; `heard` is told each event (ComfyUI's socket)."""
        watcher = asyncio.create_task(_stop_when_gone(http, self.ticket)) if http is not None else None
        try:
            async for event in self.ticket.aevents():
                self.note(event)
                if heard is not None:
                    heard(event)
        finally:
            if watcher is not None:
                watcher.cancel()


async def _stop_when_gone(http: Request, ticket: engine.Ticket) -> None:
    while not ticket.done:
        if await http.is_disconnected():
            ticket.cancel()
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


class ApiJobs:
    """The requests the APIs are running, by caller. Used on the event loop only."""

    def __init__(self, limits: CallerLimits | None = None):
        self._running: list[ApiJob] = []
        self.limits = limits or CallerLimits()  # each caller's share, at every door

    async def run(self, pipe: engine.EngineFace, request: engine.GenerationRequest, http: Request) -> ApiJob:
        """Submits and awaits a request; raises `engine.InvalidRequest` or `engine.Busy` (`CallerBusy` beyond the
        caller's share) at once. The job comes back with its `result`, or its `error`."""
        job = self.start(pipe, request, caller_of(http))
        await self.follow(job, http)
        return job

    def start(self, pipe: engine.EngineFace, request: engine.GenerationRequest, caller: Caller) -> ApiJob:
        """Submits a request as `caller`, to be followed with `follow` (ComfyUI's prompts outlive their HTTP call);
        raises as `run` does."""
        job = ApiJob(caller, self.limits.submit(pipe, request, caller))
        self._running.append(job)
        return job

    async def follow(self, job: ApiJob, http: Request | None = None, heard=None) -> None:
        """Awaits a started job to its end (stopped if `http`'s client hangs up); `heard`: told each event."""
        try:
            await job.wait(http, heard)
        finally:
            self._running.remove(job)

    def of(self, caller: Caller) -> list[ApiJob]:
        return [job for job in self._running if job.caller.name == caller.name]

    def interrupt(self, caller: Caller) -> int:
        """Stops the caller's running requests; how many."""
        mine = self.of(caller)
        for job in mine:
            job.ticket.cancel()
        return len(mine)

    def __len__(self) -> int:
        return len(self._running)


def preview_png(job: ApiJob) -> bytes | None:
    """The job's latest preview at the request's size (previews come at the latents' size)."""
    if job.preview is None:
        return None
    r = job.request
    image = Image.fromarray(np.asarray(job.preview, dtype=np.uint8))
    if r.width and r.height and image.size != (r.width, r.height):
        image = image.resize((r.width, r.height), Image.Resampling.BILINEAR)
    return png_bytes(image)
