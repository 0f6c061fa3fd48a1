"""A request's handle while the engine works on it: its events (queue position, progress, previews, the
result), and Stop.

The scheduler thread emits events; a caller reads them blocking (`events`, `result`) or from asyncio
(`aevents`, for Gradio's async handlers, which then hold no thread while they wait).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

import numpy as np

from ..errors import Cancelled
from ..request import GenerationRequest, GenerationResult


@dataclass(frozen=True)
class Queued:
    position: int  # 1: next to start


@dataclass(frozen=True)
class Loading:
    model: str  # the model the request waits for: being loaded, or waiting for room to load it (serving/model_pool.py)


@dataclass(frozen=True)
class Progress:
    step: int  # loop steps done, averaged over the request's images
    total: int


@dataclass(frozen=True)
class Preview:
    # uint8 per image that has started: [h/8, w/8, 3] from the latents, or [h, w, 3] decoded by a tiny VAE
    images: list[np.ndarray]


@dataclass(frozen=True)
class Finished:
    result: GenerationResult


@dataclass(frozen=True)
class Failed:
    error: BaseException


Event = Queued | Loading | Progress | Preview | Finished | Failed


class Ticket:
    """One submitted request. Thread-safe; every reader sees every event from the start."""

    def __init__(self, request: GenerationRequest, warnings: list[str], caller: str = ""):
        self.request = request  # complete: every default filled in
        self.warnings = warnings
        self.caller = caller  # who asked (a credential, a page session, an address): the batcher serves callers in turn
        self._history: list[Event] = []
        self._listeners: list[Callable[[Event], None]] = []
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._cancel = threading.Event()
        self._on_cancel: Callable[[], None] = lambda: None

    # -- the engine's side ------------------------------------------------------------------
    def emit(self, event: Event) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._history.append(event)
            listeners = list(self._listeners)
            if isinstance(event, Finished | Failed):
                self._done.set()
        for listener in listeners:
            listener(event)

    @property
    def cancel_requested(self) -> bool:
        return self._cancel.is_set()

    # -- the caller's side -------------------------------------------------------------------
    def cancel(self) -> None:
        """Stops the request: its slots are freed at the next chunk; the others are untouched."""
        if not self._done.is_set():
            self._cancel.set()
            self._on_cancel()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def subscribe(self, listener: Callable[[Event], None]) -> None:
        """Calls `listener(event)` for every event so far, then for each new one (from the engine's thread)."""
        with self._lock:
            past = list(self._history)
            self._listeners.append(listener)
        for event in past:
            listener(event)

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """Every event, blocking, ending with Finished or Failed. `timeout` bounds each wait."""
        inbox: queue.Queue = queue.Queue()
        self.subscribe(inbox.put)
        while True:
            event = inbox.get(timeout=timeout)
            yield event
            if isinstance(event, Finished | Failed):
                return

    async def aevents(self) -> AsyncIterator[Event]:
        """`events` for asyncio; leaving the loop early (a closed tab) cancels the request."""
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()
        self.subscribe(lambda event: loop.call_soon_threadsafe(inbox.put_nowait, event))
        try:
            while True:
                event = await inbox.get()
                yield event
                if isinstance(event, Finished | Failed):
                    return
        finally:
            self.cancel()

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Waits for the pictures; raises the request's error (InvalidRequest, Cancelled, GenerationFailed, ...)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"no result within {timeout} s")
        last = self._history[-1]
        if isinstance(last, Failed):
            raise last.error
        return last.result


def cancelled() -> Cancelled:
    return Cancelled("stopped before it finished")
