"""One engine replica of the cluster: a Ray Serve deployment that holds one warmed-up `engine.Engine`.

A replica owns the accelerators Ray gives it (`ray_actor_options`: GPUs, TPU chips or CPUs) and batches
every request routed to it on them, as `python app.py` does on one machine. Its constructor returns only
once the warm-up has compiled the default shapes, and Serve routes no request to a replica before its
constructor returns, so a new or replacing replica takes traffic only when warm; `check_health` says the
same afterwards.

`generate` streams the engine's own ticket events (Queued, Progress, Preview, Finished, Failed) back to
the caller; the pictures' `devices` name the replica (its Serve rank) as well as the device.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from ray import serve

import engine
from engine import Event

from .settings import ClusterSettings

log = logging.getLogger("ray.serve")  # Serve's logger: the replica's log files, with its name


@dataclass(frozen=True)
class Description:
    """A replica's public face, as the page reads it (`RemoteEngine` serves it on the ingress)."""

    model: str | None  # the model id it was configured with
    model_name: str
    family: str
    label: str
    defaults: dict
    limits: engine.Limits
    devices: list[str]
    batch_size: int
    example_prompts: list[str]
    images_per_device: int
    warmup_seconds: float | None
    warmup_error: str | None
    replica: str  # "replica 1"
    pid: int
    variant: engine.Variant | None = None  # what the model is: the picture inputs it takes
    controlnet: str | None = None  # the ControlNet's source, when the replicas loaded one
    vae_name: str = "the model's own VAE"  # which VAE the replicas draw with
    safety_mode: str = "none"  # "on", "off" or "none" (the model ships no safety checker)
    core_pairs: bool = False  # each device is a pair of XLA CPU devices
    dtype: str = "float32"  # the networks' dtype
    compute_path: str = ""  # the dtype and what computes the products ("float32, XLA (avx2)"), for people
    guided: bool = True  # False: a step-distilled model, which ignores the guidance scale


def served_name(model: str | None) -> str:
    """How a model id is compared: None and "" are the embedded model."""
    return model or "embedded default"


@serve.deployment(
    ray_actor_options={"num_cpus": 1},
    max_ongoing_requests=16,
    health_check_period_s=10,
    graceful_shutdown_timeout_s=5,
)
class EngineReplica:
    def __init__(self, settings: ClusterSettings | None = None):
        self.settings = settings = settings or ClusterSettings()
        context = serve.get_replica_context()
        # Serve's rank is a small number that a replacement inherits; the unique id is in the log.
        self.name = f"replica {context.rank.rank}"
        started = time.perf_counter()
        engine.enable_compile_cache()  # replicas of one host share the disk cache: a replacement loads, not compiles
        self.engine = engine.load_pipeline(
            settings.model,
            dtype=settings.dtype,
            max_batch_size=settings.max_batch_size,
            sizes=settings.engine_sizes(),
            chunk_steps=settings.chunk_steps,
            controlnet=settings.controlnet,
            vae=settings.vae,
            quantize=settings.quantize,
            t5=settings.t5,
            loras=dict(settings.loras) or None,
        )
        n = settings.images_per_device * len(self.engine.devices)
        self.engine.start_warmup(num_images=n)
        self.engine.warmup_state.done.wait()  # traffic only once warm: Serve routes after the constructor
        self._tickets: list[engine.Ticket] = []  # the requests in its engine now
        self.stopped = 0  # requests whose caller went away or pressed Stop while they were drawn
        log.info(
            "%s (%s, pid %d) ready on %s in %.1f s",
            self.name,
            context.replica_tag,
            os.getpid(),
            self.engine.devices,
            time.perf_counter() - started,
        )

    def check_health(self) -> None:
        """Serve calls this every `health_check_period_s`; an exception marks the replica unhealthy."""
        if not self.engine.ready:
            raise RuntimeError(f"{self.name} is still warming up")

    def describe(self) -> Description:
        e = self.engine
        return Description(
            model=self.settings.model,
            model_name=e.model_name,
            family=e.family,
            label=e.label,
            defaults=dict(e.defaults),
            limits=e.limits,
            devices=list(e.devices),
            batch_size=e.batch_size,
            example_prompts=list(e.example_prompts),
            images_per_device=self.settings.images_per_device,
            warmup_seconds=e.warmup_state.seconds,
            warmup_error=e.warmup_state.error,
            replica=self.name,
            pid=os.getpid(),
            variant=e.variant,
            controlnet=e.controlnet,
            vae_name=e.vae_name,
            safety_mode=e.safety_mode,
            core_pairs=e.core_pairs,
            dtype=e.dtype,
            compute_path=e.compute_path,
            guided=e.guided,
        )

    def activity(self) -> dict:
        """What this replica is doing: requests its engine is drawing, and those stopped by their callers."""
        self._tickets = [t for t in self._tickets if not t.done]
        return {"replica": self.name, "pid": os.getpid(), "drawing": len(self._tickets), "stopped": self.stopped}

    async def generate(
        self, request: engine.GenerationRequest, model: str | None = None, caller: str = ""
    ) -> AsyncIterator[Event]:
        """The request's events, streamed; cancelling the call (the caller's Stop) cancels the request. `caller`:
        who asks, as the engine's `submit` takes it."""
        if model is not None and served_name(model) != served_name(self.settings.model):
            yield engine.Failed(
                engine.InvalidRequest(
                    f"model {model!r} is not served by this cluster; it serves {served_name(self.settings.model)!r}"
                )
            )
            return
        try:
            ticket = self.engine.submit(request, caller)
        except (engine.InvalidRequest, engine.Busy) as e:
            yield engine.Failed(e)
            return
        self._tickets = [t for t in self._tickets if not t.done] + [ticket]
        try:
            # aevents cancels the ticket when this generator is closed early: Serve cancels it with the call.
            async for event in ticket.aevents():
                if isinstance(event, engine.Finished):
                    event = engine.Finished(self._labelled(event.result))
                yield event
        finally:
            self.stopped += ticket.cancel_requested

    def _labelled(self, result: engine.GenerationResult) -> engine.GenerationResult:
        # The page captions each picture with its device: naming the replica there needs no change to the page.
        # The float arrays stay here: the 8-bit pictures are what travels.
        return replace(result, devices=[f"{self.name} · {d}" for d in result.devices], arrays=None)

    def __del__(self):
        engine_ = getattr(self, "engine", None)
        if engine_ is not None:
            engine_.close()
