"""`RemoteEngine`: the engine's public face over a Ray Serve deployment of engine replicas.

The web layer takes any object with the engine's face (`web.EngineFace`: defaults, limits, devices,
batch_size, names, `ready`, `submit(GenerationRequest) -> Ticket`, ...), so the web app in front of a
cluster is the one of `python app.py`, unchanged. `submit` checks the request against the replicas'
published `Limits` at once (the same messages as one machine), then streams one replica's events into a
local `Ticket`: `handle.options(stream=True).generate.remote(...)`. Cancelling the ticket (Stop, a closed
tab) cancels that call, and Serve cancels the request on its replica.

A replica that dies mid-request (its process or host lost) ends the stream with `ActorDiedError`; the
request is then drawn again from the start on another replica, once by default (`retries`). Why retry
rather than fail: a request is a pure function of its values (the seed fixes the noise), so the second
replica draws the very pictures the first would have, and the user loses only the time already spent;
Serve's router drops the dead replica at once, so the retry goes to a live one. If that fails too, the
request fails with a message that says a replica stopped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from dataclasses import dataclass, field

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

import engine
from engine import cancelled

from .replica import Description

log = logging.getLogger("ray.serve")  # Serve's logger: the replica's log files, with its name

LOST = (ActorDiedError, ActorUnavailableError, RayActorError)  # the replica's process or host is gone


@dataclass
class ClusterWarmup:
    """`Engine.warmup_state`'s fields, for the page: the replicas were warm before the page could start."""

    seconds: float | None
    error: str | None
    done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        self.done.set()


class RemoteTicket(engine.Ticket):
    """A ticket fed from a replica's stream; cancelling it cancels the remote call."""

    def __init__(self, request: engine.GenerationRequest, caller: str = ""):
        super().__init__(request, [], caller)  # the prompt's warnings come back in the result
        self.call: concurrent.futures.Future | None = None

    def cancel(self) -> None:
        if not self.done:
            super().cancel()
            if self.call is not None:
                self.call.cancel()  # cancels the streaming task, which cancels the call on its replica
            self.emit(engine.Failed(cancelled()))  # ended for the caller now; the replica stops at its next step


class RemoteEngine:
    """Submits to the replicas of one Serve deployment (`EngineReplica`); safe to call from many threads.
    It has the engine face the web layer reads (`web.EngineFace`)."""

    def __init__(
        self,
        handle: DeploymentHandle,
        description: Description,
        model: str | None = None,
        retries: int = 1,
    ):
        """`description`: one replica's `describe()`; all replicas run the same settings."""
        self.handle = handle.options(stream=True)
        self.model = model  # each call names it: a replica serving another model refuses
        self.retries = retries
        d = description
        self.model_name = d.model_name
        self.family = d.family
        self.variant = d.variant
        self.controlnet = d.controlnet
        self.vae_name = d.vae_name
        self.safety_mode = d.safety_mode
        self.core_pairs = d.core_pairs  # the replicas' devices are core pairs
        self.dtype = d.dtype
        self.compute_path = d.compute_path  # one replica's, as all run the same settings
        self.label = f"{d.label} · Ray Serve cluster"
        self.defaults = dict(d.defaults)
        self.guided = d.guided
        self.limits = d.limits
        self.devices = list(d.devices)  # one replica's: a request is drawn on one replica
        self.batch_size = d.batch_size  # pictures one replica draws at once
        self.example_prompts = list(d.example_prompts)
        self.images_per_device = d.images_per_device
        self.warmup_state = ClusterWarmup(d.warmup_seconds, d.warmup_error)
        self.calls_retried = 0  # counters for tests and benchmarks
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    @classmethod
    def connect(cls, handle: DeploymentHandle, model: str | None = None, retries: int = 1) -> RemoteEngine:
        """From plain (not async) code: asks one replica for its description, waiting until one is up."""
        return cls(handle, handle.describe.remote().result(), model=model, retries=retries)

    def canny_image(self, image, low: int = 100, high: int = 200):
        """The Canny edge map the page shows and sends as the control picture: computed here, next to the page."""
        return engine.canny_image(image, low, high)

    @property
    def ready(self) -> bool:
        return True  # built from a live replica's description, and replicas are warm before they take traffic

    @property
    def schedulers(self) -> tuple[str, ...]:
        return self.limits.schedulers

    @property
    def max_steps(self) -> int:
        return self.limits.max_steps

    def submit(self, request: engine.GenerationRequest, caller: str = "") -> engine.Ticket:
        """Returns at once with the request's Ticket; raises InvalidRequest as the engine would. `caller`: who asks,
        passed on, so that a replica serves callers in turn as the engine does."""
        if not isinstance(request, engine.GenerationRequest):
            raise engine.InvalidRequest(f"expected a GenerationRequest, got {type(request).__name__}")
        r = self.limits.resolve(request, self.defaults, self.images_per_device)
        ticket = RemoteTicket(r, caller)
        ticket.call = asyncio.run_coroutine_threadsafe(self._stream(ticket, r), self._event_loop())
        return ticket

    def close(self) -> None:
        with self._lock:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._loop = None

    # -- the streaming side: one task per request on the adapter's own event loop ---------------
    def _event_loop(self) -> asyncio.AbstractEventLoop:
        # A loop of our own, so that `submit` works the same from Gradio's loop, a thread or a script.
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="jax-sd-remote", daemon=True).start()
            return self._loop

    async def _stream(self, ticket: RemoteTicket, request: engine.GenerationRequest) -> None:
        for attempt in range(self.retries + 1):
            call = None
            try:
                call = self.handle.generate.remote(request, self.model, ticket.caller)
                async for event in call:
                    ticket.emit(event)
                if not ticket.done:
                    ticket.emit(
                        engine.Failed(engine.GenerationFailed("the replica ended the request without pictures"))
                    )
                return
            except asyncio.CancelledError:
                if call is not None:
                    call.cancel()
                raise
            except LOST as e:
                if attempt < self.retries and not ticket.cancel_requested:
                    self.calls_retried += 1
                    log.warning("a replica stopped while drawing a request (%s); drawing it again", type(e).__name__)
                    continue
                message = "the replica drawing this request stopped (its process or host was lost)"
                if self.retries:
                    message += f", and so did the {self.retries} other{'s' if self.retries > 1 else ''} tried"
                ticket.emit(engine.Failed(engine.GenerationFailed(message + "; try again in a moment")))
            except BackPressureError:
                ticket.emit(
                    engine.Failed(engine.Busy("the cluster is busy (its queue is full); try again in a moment"))
                )
            except Exception as e:  # anything else from Ray: the request ends with a message, never hangs
                log.exception("a cluster call failed")
                ticket.emit(engine.Failed(engine.GenerationFailed(f"the cluster failed: {type(e).__name__}: {e}")))
            return
