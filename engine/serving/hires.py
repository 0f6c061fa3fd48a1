"""Hires fix as one request: the first pass at the request's size, then each picture drawn again larger.

As A1111's `StableDiffusionProcessingTxt2Img.sample_hr_pass`: the first pass's latents are resized (a latent
upscaler, `sampling/hires.py`) or its pictures are upscaled (Lanczos, Nearest or a network, `sampling/upscale.py`)
to `hires_size()`, and each image is drawn again there as image to image at `strength` from its own seed's fresh
noise, for `hires_steps` (0: the first pass's). Each pass is an ordinary request to the engine: the second pass of
each image is batched with whatever else runs at its size. One `Ticket` carries both: queue position, one progress
bar over the two passes, previews of either, and the second pass's pictures; Stop stops whichever pass runs.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import numpy as np

from ..errors import Cancelled
from ..request import GenerationRequest, GenerationResult
from ..sampling.hires import LATENT_UPSCALERS, hires_steps, upscale_latents
from .ticket import Failed, Finished, Preview, Progress, Queued, Ticket

Submit = Callable[[GenerationRequest, str], Ticket]
Upscale = Callable[..., object]  # (picture, width, height, upscaler name) -> picture: `Engine.upscale`


def first_pass(r: GenerationRequest) -> GenerationRequest:
    """The request without its hires fix, handing back its latents where a latent upscaler needs them."""
    return dataclasses.replace(
        r,
        hires_scale=0.0,
        hires_width=None,
        hires_height=None,
        hires_steps=0,
        strength=None,
        return_latents=r.hires_upscaler in LATENT_UPSCALERS,
        hires_scheduler=None,
        hires_prompt=None,
        hires_negative_prompt=None,
        hires_strength=None,
        resize_mode=0,
    )


def second_passes(r: GenerationRequest, first: GenerationResult, upscale: Upscale) -> list[GenerationRequest]:
    """One image-to-image request per picture of the first pass, at the hires size, from its own seed, with the
    second pass's sampler and prompts where the request gives them. `r` is resolved: its strength is set (0.7 where
    none was given). With both hires sides given, the pictures (or latents) are upscaled to cover them at the first
    pass's aspect and cut to them in the middle, on latent cells as A1111 cuts its latents."""
    width, height = r.hires_size()
    cover_width, cover_height = r.hires_cover()
    base = dataclasses.replace(
        first_pass(r),
        width=width,
        height=height,
        num_images=1,
        num_inference_steps=hires_steps(r.num_inference_steps, r.hires_steps),
        strength=r.strength,
        latents=None,
        return_latents=False,
        scheduler=r.hires_scheduler or r.scheduler,
        prompt=r.prompt if r.hires_prompt is None else r.hires_prompt,
        negative_prompt=r.negative_prompt if r.hires_negative_prompt is None else r.hires_negative_prompt,
    )
    if r.hires_upscaler in LATENT_UPSCALERS:
        factor = r.height // first.latents.shape[1]
        latents = upscale_latents(first.latents, cover_height // factor, cover_width // factor, r.hires_upscaler)
        top, left = ((cover - side) // factor // 2 for cover, side in ((cover_height, height), (cover_width, width)))
        latents = latents[:, top : top + height // factor, left : left + width // factor]
        return [
            dataclasses.replace(base, seed=seed, image_latents=latents[k : k + 1]) for k, seed in enumerate(first.seeds)
        ]
    factor = 8  # A1111's opt_f: it cuts the encoded picture's latents, so the cut falls on 8-pixel cells
    top, left = (
        (cover - side) // factor // 2 * factor for cover, side in ((cover_height, height), (cover_width, width))
    )
    box = (left, top, left + width, top + height)
    pictures = [upscale(image, cover_width, cover_height, r.hires_upscaler).crop(box) for image in first.images]
    return [
        dataclasses.replace(base, seed=seed, image=picture) for seed, picture in zip(first.seeds, pictures, strict=True)
    ]


def _joined(r: GenerationRequest, first: GenerationResult, results: list[GenerationResult]) -> GenerationResult:
    timings = {
        key: first.timings.get(key, 0.0) + sum(x.timings.get(key, 0.0) for x in results) for key in first.timings
    }
    return GenerationResult(
        images=[image for x in results for image in x.images],
        seeds=[seed for x in results for seed in x.seeds],
        devices=[device for x in results for device in x.devices],
        timings=timings,
        compiled=first.compiled or any(x.compiled for x in results),
        warnings=list(dict.fromkeys([*first.warnings, *(w for x in results for w in x.warnings)])),
        arrays=np.concatenate([x.arrays for x in results]) if all(x.arrays is not None for x in results) else None,
        request=r,
        nsfw_content_detected=[flag for x in results for flag in x.nsfw_content_detected],
    )


class HiresFix:
    """Runs one resolved hires request's two passes in a thread of its own, and tells the request's `ticket` what
    happens: `submit` queues a second pass (with the caller), `upscale` upscales a picture (the engine's, one at a
    time)."""

    def __init__(self, r: GenerationRequest, ticket: Ticket, submit: Submit, upscale: Upscale):
        self.r, self.ticket, self.submit, self.upscale = r, ticket, submit, upscale
        self._running: list[Ticket] = []
        self._lock = threading.Lock()
        self.second_steps = max(int(hires_steps(r.num_inference_steps, r.hires_steps) * r.strength), 1)
        self.total = int(r.num_inference_steps) + self.second_steps
        ticket._on_cancel = self._cancel

    def _cancel(self) -> None:
        with self._lock:
            running = list(self._running)
        for inner in running:
            inner.cancel()

    def _start(self, request: GenerationRequest) -> Ticket:
        with self._lock:
            if self.ticket.cancel_requested:
                raise Cancelled("stopped before it finished")
            inner = self.submit(request, self.ticket.caller)
            self._running.append(inner)
        return inner

    def start(self, first: Ticket) -> None:
        """Runs the passes from `first` (the first pass's ticket, already submitted) on a thread of its own."""
        self._running.append(first)
        threading.Thread(target=self._run, args=(first,), name="jax-sd-hires", daemon=True).start()

    def _forward(self, inner: Ticket, share: float, done: dict) -> None:
        """Passes `inner`'s queue position (first pass), previews and progress on: the outer bar counts the first
        pass's steps, then each picture's share of the second pass's."""

        def listen(event) -> None:
            if isinstance(event, Queued) and not done:
                self.ticket.emit(event)
            elif isinstance(event, Progress) and event.total:
                done[id(inner)] = share * event.step / event.total
                self.ticket.emit(Progress(min(round(sum(done.values())), self.total), self.total))
            elif isinstance(event, Preview):
                self.ticket.emit(event)

        inner.subscribe(listen)

    def _run(self, first_ticket: Ticket) -> None:
        done: dict[int, float] = {}
        try:
            self._forward(first_ticket, float(self.r.num_inference_steps), done)
            first = first_ticket.result()
            requests = second_passes(self.r, first, self.upscale)
            tickets = []
            for request in requests:
                inner = self._start(request)
                self._forward(inner, self.second_steps / len(requests), done)
                tickets.append(inner)
            results = [inner.result() for inner in tickets]
            self.ticket.emit(Finished(_joined(self.r, first, results)))
        except BaseException as error:  # the first failure or Stop ends the request; the others are stopped
            self._cancel()
            self.ticket.emit(Failed(error))
