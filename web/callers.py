"""Who is calling, and how much each caller may have waiting: fair sharing between callers at every door.

A caller is its credential (an `--auth` user, "key 2": set by the APIs' gate or Gradio's login), else its page
session, else its address. The address is the connection's; `X-Forwarded-For` is read only from a proxy the
operator names (`--forwarded-allow-ips`, as uvicorn names it: `ForwardedFor`). Anonymous callers behind a proxy
that is not trusted cannot be told apart: they are one caller, marked `shared` (A1111's progress then shows no
preview, which might be another's picture).

`CallerLimits` holds each caller to at most `max_requests` requests and `max_work` images x steps in the engine
at once, across the page, both REST APIs and MCP; beyond that `CallerBusy` (429 with Retry-After, the page's
"busy" message) at once. A caller's first request is always taken, whatever its size (the engine's limits
bound it). The engine then serves callers in turn (engine/serving/batcher.py: `in_turns`).
"""

from __future__ import annotations

import ipaddress
import threading
from collections import defaultdict
from dataclasses import dataclass

import engine

DEFAULT_MAX_REQUESTS = 8  # a caller's requests in the engine at once (waiting or drawing)
DEFAULT_MAX_WORK = 2400  # a caller's images x steps in the engine at once: 8 images of 50 steps, three times over
RETRY_AFTER_S = 5


@dataclass(frozen=True)
class Caller:
    name: str  # "ann", "key 2", "session 3f2a...", "address 203.0.113.7"
    shared: bool = False  # anonymous behind a proxy that is not trusted: everyone there is this one caller


def _state(scope) -> dict:
    return scope.get("state") or {}


def caller_of(scope, session: str | None = None, user: str | None = None) -> Caller:
    """The caller of an ASGI scope: its credential (`user`: Gradio's login), else `session` (the page's), else
    its address (`ForwardedFor` has put a trusted proxy's client there)."""
    name = user or _state(scope).get("api_caller")
    if name:
        return Caller(str(name))
    if session:
        return Caller(f"session {session}")
    client = scope.get("client")
    address = client[0] if client else "unknown"
    return Caller(f"address {address}", shared=bool(_state(scope).get("forwarded_untrusted")))


def page_caller(request) -> Caller:
    """The caller of a page event or an MCP call (a `gr.Request`, or None when called directly)."""
    http = getattr(request, "request", None)
    scope = getattr(http, "scope", None) or {}
    return caller_of(scope, getattr(request, "session_hash", None), getattr(request, "username", None))


# ---- X-Forwarded-For from trusted proxies only ----------------------------------------------------------------


def read_forwarded_allow_ips(value: str | None) -> tuple[str, ...]:
    """`--forwarded-allow-ips`: comma-separated addresses or networks of trusted proxies, or "*" (any)."""
    items = tuple(item.strip() for item in (value or "").split(",") if item.strip())
    for item in items:
        if item != "*":
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise ValueError(f"--forwarded-allow-ips: {item!r} is not an address or a network") from None
    return items


def _trusted(address: str, allowed: tuple[str, ...]) -> bool:
    if "*" in allowed:
        return True
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in ipaddress.ip_network(item, strict=False) for item in allowed)


class ForwardedFor:
    """ASGI middleware: a connection from a trusted proxy takes the client address its `X-Forwarded-For` names
    (the last one not itself a trusted proxy); from anyone else the header is ignored, and the request is marked
    `forwarded_untrusted` (its callers cannot be told apart)."""

    def __init__(self, app, allowed: tuple[str, ...] = ()):
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            values = [v.decode("latin-1") for k, v in scope.get("headers", []) if k.lower() == b"x-forwarded-for"]
            hops = [hop.strip() for value in values for hop in value.split(",") if hop.strip()]
            client = scope.get("client")
            if hops and client and _trusted(client[0], self.allowed):
                outside = [hop for hop in hops if not _trusted(hop, self.allowed)]
                scope = dict(scope, client=(outside[-1] if outside else hops[0], 0))
            elif hops:
                scope = dict(scope, state={**_state(scope), "forwarded_untrusted": True})
        return await self.app(scope, receive, send)


# ---- how much a caller may have waiting -------------------------------------------------------------------


class CallerBusy(engine.Busy):
    """A caller over its share: answered 429 with Retry-After (the page: a "busy" message)."""

    retry_after_s = RETRY_AFTER_S


def work_of(pipe: engine.EngineFace, request: engine.GenerationRequest) -> int:
    """Images x steps, as asked (the model's defaults for what is left out)."""
    images = request.num_images or len(pipe.devices)
    steps = request.num_inference_steps or pipe.defaults["num_inference_steps"]
    return int(images) * int(steps)


class CallerLimits:
    """Each caller's requests and work in the engine (see the module's docstring). Thread-safe."""

    def __init__(self, max_requests: int = DEFAULT_MAX_REQUESTS, max_work: int = DEFAULT_MAX_WORK):
        if max_requests < 1 or max_work < 1:
            raise ValueError("a caller's limits must be at least 1")
        self.max_requests, self.max_work = max_requests, max_work
        self._held: dict[str, list[int]] = defaultdict(list)  # caller -> the work of each request it holds
        self._lock = threading.Lock()

    def held(self, caller: Caller) -> tuple[int, int]:
        """(requests, work) the caller has in the engine."""
        with self._lock:
            works = self._held.get(caller.name, [])
            return len(works), sum(works)

    def submit(self, pipe: engine.EngineFace, request: engine.GenerationRequest, caller: Caller) -> engine.Ticket:
        """`pipe.submit` as `caller`, within its share; raises CallerBusy beyond it (or what the engine raises)."""
        work = work_of(pipe, request)
        with self._lock:
            works = self._held[caller.name]
            if works and (len(works) >= self.max_requests or sum(works) + work > self.max_work):
                raise CallerBusy(
                    f"busy with your requests: you have {len(works)} ({sum(works)} images x steps) waiting or drawing, this "
                    f"server's share per caller is {self.max_requests} ({self.max_work}); try again when one is done"
                )
            works.append(work)  # held before the engine sees it, so that two at once cannot both slip in
        try:
            ticket = pipe.submit(request, caller=caller.name)
        except BaseException:
            self._release(caller.name, work)
            raise
        ticket.subscribe(lambda event: self._release(caller.name, work) if _final(event) else None)
        return ticket

    def _release(self, name: str, work: int) -> None:
        with self._lock:
            works = self._held.get(name)
            if works is not None and work in works:
                works.remove(work)
                if not works:
                    del self._held[name]  # bounded: only callers with requests in the engine


def _final(event: engine.Event) -> bool:
    return isinstance(event, engine.Finished | engine.Failed)
