"""Several models on one server: a models folder's checkpoints, loaded on demand within a budget, one `Engine` each.

`ModelPool` has the engine's face (`EngineFace`), so the page and the APIs serve it as they serve one `Engine`; its
`submit` routes each request to the engine of the model it names (`GenerationRequest.model`, matched as A1111 matches
a checkpoint's name: `loading/models_folder.py`; None: the default, which `ServedModels.set_default` changes as
A1111's `POST /options {"sd_model_checkpoint": ...}` does). Each engine batches only its own model's requests, so a
switch never mixes anyone's pictures, and the engines' internals stay as they are.

- At most `max_loaded` engines are held. A request for a model that is not loaded waits (its ticket says
  `Loading(model)`) while the model loads; with no room, the least recently used engine is closed as soon as it is
  idle (no request of its own running), and meanwhile new requests for that engine wait too, so a busy model cannot
  starve the others. Requests for loaded models are served on as before.
- A model that fails to load is marked unusable in the folder's list (with why); its waiting requests are refused
  by name and the server goes on serving the others.
- A LoRA of the folder's `Lora/` is read, matched against a model and added to its engine at the first request
  that calls it (`<lora:name:w>`), with no restart; on that model every folder LoRA a request does not call weighs
  0, as in A1111 (LoRAs given at start, `--lora`, keep diffusers' 1.0).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from PIL import Image

from ..errors import Cancelled, ConfigError, InvalidRequest, SourceError, WeightsError
from ..loading.models_folder import Checkpoint, ModelsFolder
from ..loading.upscaler_folder import UpscalerFolder
from ..request import GenerationRequest, GenerationResult
from ..sampling.images import canny_image
from ..sampling.upscale import upscale_to
from .engine import Engine
from .folder_loras import FolderLoRAs
from .ticket import Failed, Finished, Loading, Progress, Ticket
from .warmup import Warmup

log = logging.getLogger("jax-sd")

DEFAULT_MAX_LOADED = 1  # A1111's own default (sd_checkpoints_limit): one model in memory at a time

# What the doors read of the default model's engine, kept after it is closed (a snapshot holds no weights).
FACE = (
    "family",
    "devices",
    "batch_size",
    "defaults",
    "limits",
    "label",
    "variant",
    "controlnet",
    "vae_name",
    "safety_mode",
    "core_pairs",
    "dtype",
    "compute_path",
    "example_prompts",
    "embeddings",
    "images_per_device",
)


class ModelPool:
    """The engines of a models folder's checkpoints; an `EngineFace`. `load(checkpoint)` builds one `Engine`."""

    def __init__(
        self,
        folder: ModelsFolder,
        load: Callable[[Checkpoint], Engine],
        default: str | None = None,
        max_loaded: int = DEFAULT_MAX_LOADED,
        upscalers: UpscalerFolder | None = None,
    ):
        if max_loaded < 1:
            raise ConfigError(f"max_loaded must be at least 1, not {max_loaded}")
        if not folder.usable():
            raise ConfigError(f"{folder.root}: no usable checkpoint in its Stable-diffusion/ folder")
        self.folder = folder
        self.max_loaded = max_loaded
        self.upscalers = upscalers or UpscalerFolder()  # the server's, shared by every model's engine
        self._load = load
        self._engines: OrderedDict[str, Engine] = OrderedDict()  # title -> engine, least recently used first
        self._loading: set[str] = set()
        self._running: Counter[str] = Counter()  # requests in each engine, not yet finished
        self._waiting: Counter[str] = Counter()  # requests waiting in the pool for each model
        self._faces: dict[str, SimpleNamespace] = {}
        self._loras = FolderLoRAs(folder)  # the folder's LoRAs, added to each engine at their first call
        self._cond = threading.Condition()
        self._upscaling = threading.Lock()
        self._closed = False
        self._warming: set[str] = set()  # models whose engine was warmed up (start_warmup)
        self._threads: list[threading.Thread] = []
        self.models = ServedModels(self)
        self.default = (folder.match(default) if default else folder.usable()[0]).title
        self.loads = 0  # models loaded so far (the first included): a switch's cost, for tests and logs

    # -- the face ---------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name in FACE:
            return getattr(self._face(), name)
        raise AttributeError(f"ModelPool has no {name!r}")

    def _face(self) -> Any:
        with self._cond:
            engine = self._engines.get(self.default)
            if engine is not None:
                return engine
            face = self._faces.get(self.default) or next(reversed(self._faces.values()), None)
        if face is None:  # nothing loaded yet: load the default now (the server's start does)
            self.load(self.default)
            return self._face()
        return face

    @property
    def model_name(self) -> str:
        """The default model's title: what a request without a model draws with."""
        return self.default

    @property
    def loaded(self) -> list[str]:
        """The titles of the models in memory, least recently used first."""
        with self._cond:
            return list(self._engines)

    @property
    def ready(self) -> bool:
        with self._cond:
            engine = self._engines.get(self.default)
        return engine.ready if engine is not None else True

    @property
    def warmup_state(self) -> Warmup:
        with self._cond:
            engine = self._engines.get(self.default)
        if engine is not None:
            return engine.warmup_state
        done = Warmup()
        done.done.set()
        return done

    def start_warmup(self, num_images: int | None = None) -> ModelPool:
        """Loads the default model (if it is not) and warms its engine up, as `Engine.start_warmup`."""
        self.load(self.default).start_warmup(num_images)
        self._warming.add(self.default)
        return self

    # -- work -------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest, caller: str = "") -> Ticket:
        """Routes the request to its model's engine. Returns at once: that engine's ticket, or one that says
        `Loading(model)` until it is loaded; raises InvalidRequest (an unknown or unusable model) or the engine's."""
        if not isinstance(request, GenerationRequest):
            raise InvalidRequest(f"expected a GenerationRequest, got {type(request).__name__}")
        checkpoint = self.folder.match(request.model or self.default)
        request = dataclasses.replace(request, model=checkpoint.title)
        title = checkpoint.title
        with self._cond:
            engine = self._engines.get(title)
            ready = engine is not None and self._victim() != title and self._loras.present(engine, request)
            if ready:
                self._engines.move_to_end(title)
                self._running[title] += 1
        if ready:
            try:
                inner = engine.submit(self._loras.weighed(title, request), caller)
            except BaseException:
                self._finished(title)
                raise
            inner.subscribe(lambda event: self._finished(title) if isinstance(event, Finished | Failed) else None)
            return inner
        ticket = Ticket(request, [], caller)
        self._start(_run_when_loaded, self, checkpoint, request, ticket)
        return ticket

    def generate(self, prompt: str, progress: Callable[[int, int], None] | None = None, **fields) -> GenerationResult:
        """One request, waited for, as `Engine.generate` (`model=` names the model)."""
        ticket = self.submit(GenerationRequest(prompt, **fields))
        if progress is not None:
            ticket.subscribe(lambda e: progress(e.step, e.total) if isinstance(e, Progress) else None)
        return ticket.result()

    def canny_image(self, image: Image.Image, low: int = 100, high: int = 200) -> Image.Image:
        return canny_image(image, low, high)

    def upscale(self, picture: Image.Image, width: int, height: int, upscaler: str) -> Image.Image:
        """As `Engine.upscale`, one at a time over every model (the networks are the server's, not a model's)."""
        with self._upscaling:
            return upscale_to(picture, width, height, self.upscalers.get(upscaler))

    def load(self, name: str) -> Engine:
        """The named model's engine, loaded now if it is not (waiting for room as a request would)."""
        checkpoint = self.folder.match(name)
        engine = self._engine_for(checkpoint, lambda: False)
        self._finished(checkpoint.title)
        return engine

    def _start(self, target: Callable, *args) -> None:
        """Runs `target(*args)` on a thread of the pool's own, which `close` waits for."""
        thread = threading.Thread(target=target, args=args, name="jax-sd-model", daemon=True)
        with self._cond:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def close(self) -> None:
        """Waits for the loads under way (nothing runs on into the process's exit), then closes every engine."""
        with self._cond:
            self._closed = True  # requests still waiting for a model are stopped
            threads = list(self._threads)
            self._cond.notify_all()
        for thread in threads:
            thread.join(timeout=300)
        with self._cond:
            engines = list(self._engines.values())
            self._engines.clear()
        for engine in engines:
            engine.close()

    # -- routing (under self._cond) -----------------------------------------------------------
    def _victim(self) -> str | None:
        """The engine to close for a model waiting for room (LRU, idle first; new requests for it wait): or None."""
        hungry = any(n for t, n in self._waiting.items() if t not in self._engines and t not in self._loading)
        if not hungry or len(self._engines) + len(self._loading) < self.max_loaded or not self._engines:
            return None
        idle = [t for t in self._engines if self._idle(t)]
        return idle[0] if idle else next(iter(self._engines))

    def _idle(self, title: str) -> bool:
        """No request of its own runs, nor a warm-up (`start_warmup`'s: closing it would cut the compile short)."""
        return not self._running[title] and (title not in self._warming or self._engines[title].ready)

    def _finished(self, title: str) -> None:
        """One request of `title` is done; idle engines past a lowered budget close (on a thread: this may be theirs)."""
        with self._cond:
            self._running[title] -= 1
            excess = len(self._engines) + len(self._loading) - self.max_loaded
            idle = [t for t in self._engines if self._idle(t)][: max(excess, 0)]
            closing = [self._evict(t) for t in idle]
            self._cond.notify_all()
        if closing:
            threading.Thread(target=lambda: [e.close() for e in closing], name="jax-sd-model", daemon=True).start()

    def _evict(self, title: str) -> Engine:
        """Takes `title`'s engine out of the pool (for the caller to close): its face is kept, its LoRAs go with it."""
        engine = self._engines.pop(title)
        self._faces[title] = _snapshot(engine)
        self._loras.forget(title)
        self._warming.discard(title)
        return engine

    def _engine_for(self, checkpoint: Checkpoint, cancelled: Callable[[], bool]) -> Engine:
        """The model's engine, running one more request: loaded (closing an idle one if full), or waited for."""
        title = checkpoint.title
        with self._cond:
            self._waiting[title] += 1
            try:
                while True:
                    if cancelled() or self._closed:
                        raise Cancelled("stopped before it finished")
                    current = self.folder.checkpoints.get(title)
                    if current is None or current.problem:
                        raise InvalidRequest(self._unusable(title, current))
                    engine = self._engines.get(title)
                    victim = self._victim()
                    if engine is not None and victim != title:
                        self._engines.move_to_end(title)
                        self._running[title] += 1
                        return engine
                    if engine is None and title not in self._loading:
                        if len(self._engines) + len(self._loading) < self.max_loaded:
                            self._loading.add(title)
                            closing = None
                            break
                        if victim is not None and self._idle(victim):
                            log.info("closing %s to make room for %s", victim, title)
                            closing = self._evict(victim)
                            self._loading.add(title)
                            break
                    self._cond.wait(timeout=1.0)
            finally:
                self._waiting[title] -= 1
        return self._load_now(checkpoint, closing)

    def _load_now(self, checkpoint: Checkpoint, closing: Engine | None) -> Engine:
        title = checkpoint.title
        try:
            if closing is not None:
                closing.close()
                del closing
            started = time.perf_counter()
            engine = self._load(checkpoint)
            log.info("loaded %s in %.1f s", title, time.perf_counter() - started)
        except BaseException as err:
            reason = self.folder.public(str(err)) if isinstance(err, SourceError | WeightsError | ConfigError) else ""
            log.exception("loading %s failed", title)
            self.folder.mark_unusable(title, reason or f"it failed to load ({type(err).__name__})")
            with self._cond:
                self._loading.discard(title)
                self._cond.notify_all()
            raise InvalidRequest(self._unusable(title, self.folder.checkpoints.get(title))) from err
        with self._cond:
            self._loading.discard(title)
            self._engines[title] = engine
            self._faces[title] = _snapshot(engine)
            self._running[title] += 1
            self.loads += 1
            self._cond.notify_all()
        return engine

    def _unusable(self, title: str, checkpoint: Checkpoint | None) -> str:
        if checkpoint is None:
            offered = ", ".join(repr(c.title) for c in self.folder.usable()) or "none"
            return f"model {title!r} is no longer in the models folder; this server offers {offered}"
        return f"model {checkpoint.name!r} cannot be used: {self.folder.public(checkpoint.problem or '')}"


def _run_when_loaded(pool: ModelPool, checkpoint: Checkpoint, request: GenerationRequest, ticket: Ticket) -> None:
    """A request whose model is not ready (on a thread of its own): waits for it, saying so, then hands its engine's
    events on; Stop stops it wherever it is."""
    title = checkpoint.title
    inner: list[Ticket] = []

    def cancel() -> None:
        for running in inner:
            running.cancel()
        with pool._cond:
            pool._cond.notify_all()

    ticket._on_cancel = cancel
    ticket.emit(Loading(checkpoint.name))
    try:
        engine = pool._engine_for(checkpoint, lambda: ticket.cancel_requested)
    except BaseException as err:
        ticket.emit(Failed(err))
        return
    try:
        pool._loras.add(title, engine, request)
        if ticket.cancel_requested:
            raise Cancelled("stopped before it finished")
        inner.append(engine.submit(pool._loras.weighed(title, request), ticket.caller))
        ticket.warnings.extend(inner[0].warnings)  # the prompt's notes (a prompt cut short, ...)
    except BaseException as err:
        pool._finished(title)
        ticket.emit(Failed(err))
        return

    def forward(event) -> None:
        if isinstance(event, Finished | Failed):
            pool._finished(title)
        ticket.emit(event)

    inner[0].subscribe(forward)
    if ticket.cancel_requested:
        inner[0].cancel()


def _snapshot(engine: Engine) -> SimpleNamespace:
    return SimpleNamespace(**{name: getattr(engine, name, None) for name in FACE}, model_name=engine.model_name)


class ServedModels:
    """What the doors read and change of a pool's models (`EngineFace.models`): A1111's lists and options."""

    def __init__(self, pool: ModelPool):
        self._pool = pool

    @property
    def default(self) -> str:
        return self._pool.default

    def titles(self) -> list[str]:
        return [c.title for c in self._pool.folder.usable()]

    def match(self, name: str) -> str:
        """The title of the model a client names; InvalidRequest listing the offered ones if none is."""
        return self._pool.folder.match(name).title

    def set_default(self, name: str) -> str:
        """The model a request without one draws with, from now on (A1111's `sd_model_checkpoint` option); its
        loading starts in the background. Returns its title."""
        title = self.match(name)
        self._pool.default = title
        self._pool._start(self._preload, title)
        return title

    def _preload(self, title: str) -> None:
        try:
            self._pool.load(title)
        except Exception:  # logged and marked unusable by the pool; a request for it is refused by name
            pass

    def refresh(self) -> None:
        """Reads the models folder again (A1111's refresh-checkpoints and refresh-loras)."""
        self._pool.folder.scan()

    def a1111(self) -> list[dict]:
        """A1111's /sdapi/v1/sd-models: every usable checkpoint."""
        return [c.a1111() for c in self._pool.folder.usable()]

    def unusable(self) -> dict[str, str]:
        """The folder's checkpoints that cannot be used -> why."""
        folder = self._pool.folder
        return {c.name: folder.public(c.problem) for c in folder.checkpoints.values() if c.problem}

    def loras(self) -> list[dict]:
        return self._pool.folder.lora_items()

    def vaes(self) -> list[dict]:
        return self._pool.folder.vae_items()

    @property
    def loaded(self) -> list[str]:
        return self._pool.loaded
