"""A1111's image to image around one request: the picture and its mask made ready at the request's size
(`sampling/inpaint.py`: resize mode, mask blur, "only masked" crop, fill), drawn as an ordinary request, and each
picture of its result laid under the picture again (pasted into its box of the whole picture for "only masked").

The request drawn has the prepared picture and mask and none of these options, so it is batched with any other
request at its size; its ticket's queue position, progress and previews pass through, Stop reaches it, and the
finished pictures are composited before the caller sees them (a picture the safety checker withheld stays as it is).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from ..request import GenerationRequest, GenerationResult
from ..sampling.inpaint import Prepared, prepare
from .ticket import Failed, Finished, Ticket

Submit = Callable[[GenerationRequest, str], Ticket]


def needs_preparing(r: GenerationRequest) -> bool:
    """What the program's own resize (0, and 3 here) and binary mask do not do: the other resize modes, and a mask
    blurred, laid back, drawn only where it is, or filled from around it (A1111 fills for every start but "original")."""
    if r.image is None:
        return False
    masked = r.mask_image is not None and (r.mask_blur is not None or r.inpaint_full_res or r.inpainting_fill != 1)
    return r.resize_mode in (1, 2) or masked


def prepared(r: GenerationRequest) -> tuple[GenerationRequest, Prepared]:
    """The request the engine draws (the prepared picture and mask at its size) and what finishes its pictures."""
    ready = prepare(
        r.image,
        r.mask_image,
        int(r.width),
        int(r.height),
        resize_mode=int(r.resize_mode),
        mask_blur=r.mask_blur,
        inpaint_full_res=bool(r.inpaint_full_res),
        padding=int(r.inpaint_full_res_padding),
        inpainting_fill=int(r.inpainting_fill),
    )
    inner = dataclasses.replace(
        r,
        image=ready.image,
        mask_image=ready.mask,
        resize_mode=0,
        mask_blur=None,
        inpaint_full_res=False,
        inpainting_fill=r.inpainting_fill if r.inpainting_fill in (2, 3) else 1,  # latent starts: the program's
    )
    return inner, ready


def finished(r: GenerationRequest, result: GenerationResult, ready: Prepared) -> GenerationResult:
    """The result with each picture laid under the picture again; `arrays` then read from the composites."""
    if ready.layer is None:
        return dataclasses.replace(result, request=r)
    withheld = result.nsfw_content_detected or [False] * len(result.images)
    images = [image if hidden else ready.finish(image) for image, hidden in zip(result.images, withheld, strict=True)]
    arrays = np.stack([np.asarray(image, np.float32) / 255.0 for image in images]) if images else result.arrays
    return dataclasses.replace(result, images=images, arrays=arrays, request=r)


def submit_prepared(r: GenerationRequest, submit: Submit, caller: str) -> Ticket:
    """Queues the prepared request; the returned ticket tells its events and its finished, composited pictures."""
    inner_request, ready = prepared(r)
    inner = submit(inner_request, caller)
    ticket = Ticket(r, inner.warnings, caller)
    ticket._on_cancel = inner.cancel

    def listen(event) -> None:
        if isinstance(event, Finished):
            try:
                event = Finished(finished(r, event.result, ready))
            except Exception as error:  # noqa: BLE001 - the caller hears it as the request's failure
                event = Failed(error)
        ticket.emit(event)

    inner.subscribe(listen)
    return ticket
