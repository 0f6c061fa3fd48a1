"""Start-up compilation: the default request's programs before Ready, the rest in the background.

The default request's plan at its own width first (Ready then), and after Ready the same size with guidance
the other way (so the guidance slider crossing 1 compiles nothing) and the whole batch's width of both, one at a
time, each once no request has waited or drawn for `QUIET_S` seconds (and not before `QUIET_S` after Ready:
`Idleness.wait`), on threads of the lowest priority (`Programs.request(background=True)`). XLA's compiler also
works on its CPU client's own threads, which no priority reaches, and tracing holds Python's lock: on a Zen 3 core
pair a picture asked for at Ready took 13.5 s while these compiled beside it, 5.6 s once they were done.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError

from PIL import Image

from ..request import GenerationRequest, Limits
from ..sampling.pipeline import Plan
from .jobs import Jobs
from .programs import Programs, lane_widths

log = logging.getLogger("jax-sd")

QUIET_S = 2.0  # the warm-up's plans after Ready wait until no request has waited or drawn for this long


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
    programs: Programs,
    plans: list[Plan],
    images_per_device: int,
    num_images: int | None,
    wait_for_all: bool,
    wait_until_idle: Callable[[float], bool] | None = None,
) -> float:
    """Compiles the first plan's programs at the width the default request takes (kept for good) and returns the
    seconds that took. The rest on a thread of its own, one at a time, each when the engine is idle
    (`wait_until_idle(QUIET_S)`, False: the engine closed): the other plan, then the whole batch's width of both
    (`wait_for_all` compiles them here, without waiting for idleness)."""
    start, (default, other) = time.perf_counter(), plans
    n = images_per_device if num_images is None else -(-num_images // default.devices)
    widths = lane_widths(default.slots_per_device)
    own = min(w for w in widths if w >= min(n, default.slots_per_device))
    # One plan at a time until Ready: XLA's CPU compiler already keeps two cores busy.
    programs.request(default, own, pin=True).result()
    seconds = time.perf_counter() - start
    rest = [(other, own, True), (default, widths[-1], False), (other, widths[-1], False)]
    if wait_for_all:
        for future in [programs.request(plan, width, pin=pin) for plan, width, pin in rest]:
            future.result()  # asked for at once, compiled two at a time, as before Ready's plan
        return seconds

    def later() -> None:
        time.sleep(QUIET_S)  # a visitor who came for Ready is served first
        try:
            for plan, width, pin in rest:
                if wait_until_idle is not None and not wait_until_idle(QUIET_S):
                    return  # the engine closed
                programs.request(plan, width, pin=pin, background=True).result()
        except CancelledError:  # the engine closed while it waited
            return
        except Exception:  # a request compiles what it needs; the engine serves on
            log.exception("the warm-up's later plans failed")

    threading.Thread(target=later, name="jax-sd-warmup-later", daemon=True).start()
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
