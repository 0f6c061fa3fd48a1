"""Start-up compilation: the default request's programs before Ready, the rest in the background.

The default request's plan at its own width first (Ready then), and after Ready the same size with guidance
the other way (so the guidance slider crossing 1 compiles nothing) and the whole batch's width of both, at the
lowest priority: a first request drawing meanwhile keeps the cores (`Programs.request(background=True)`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from PIL import Image

from ..request import GenerationRequest, Limits
from ..sampling.pipeline import Plan
from .jobs import Jobs
from .programs import Programs, lane_widths

log = logging.getLogger("jax-sd")


@dataclasses.dataclass
class Warmup:
    """The start-up compilation of the default shapes, which runs in the background."""

    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    seconds: float | None = None
    error: str | None = None


def warmup_plans(
    jobs: Jobs, limits: Limits, defaults: dict, images_per_device: int, num_images: int | None
) -> list[Plan]:
    """The default request's plan, then the same with guidance on or off the other way: moving the guidance
    slider across 1 compiles nothing once the second one is done."""
    g = defaults["guidance_scale"]
    # A model that only edits is asked with the pictures it needs, at the default size (FLUX.1 Kontext)
    references = (Image.new("RGB", (defaults["width"], defaults["height"])),) * limits.min_references
    plans = []
    for guidance in (g, 1.0 if g > 1 else 7.5):
        request = GenerationRequest("", guidance_scale=guidance, num_images=num_images, references=references)
        r = limits.resolve(request, defaults, images_per_device)
        plans.append(jobs.plan(r))
    return plans


def warmup(
    programs: Programs, plans: list[Plan], images_per_device: int, num_images: int | None, wait_for_all: bool
) -> float:
    """Compiles the first plan's programs at the width the default request takes (kept for good) and returns the
    seconds that took. The rest in the background: the other plan, then the whole batch's width of both
    (`wait_for_all` waits for them too)."""
    start, (default, other) = time.perf_counter(), plans
    n = images_per_device if num_images is None else -(-num_images // default.devices)
    widths = lane_widths(default.slots_per_device)
    own = min(w for w in widths if w >= min(n, default.slots_per_device))
    # One plan at a time until Ready: XLA's CPU compiler already keeps two cores busy.
    programs.request(default, own, pin=True).result()
    seconds = time.perf_counter() - start
    rest = [programs.request(other, own, pin=True, background=True)]
    rest += [programs.request(plan, widths[-1], background=True) for plan in (default, other)]
    if wait_for_all:
        for future in rest:
            future.result()
    return seconds


def start_in_background(state: Warmup, run_warmup) -> None:
    """`run_warmup()` on a thread of its own; `state` says how it went (an error leaves the engine serving)."""

    def run() -> None:
        try:
            state.seconds = run_warmup()
            log.info("warm-up finished in %.1f s", state.seconds)
        except Exception as e:  # the first request compiles instead; the engine stays up
            state.error = f"{type(e).__name__}: {e}"
            log.exception("warm-up failed")
        finally:
            state.done.set()

    threading.Thread(target=run, name="jax-sd-warmup", daemon=True).start()
