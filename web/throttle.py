"""Failed logins, counted per address: slowed after a few, then refused for a while (429 with Retry-After).

One `LoginThrottle` counts the failures of every door that checks a password or key: Gradio's `/login` form
(`LoginGuard`, which watches its answers) and HTTP Basic or Bearer at the APIs' gate (api_gate.py). From one
address, the failures within `window_s` are counted; beyond the first `slow_after` each failed answer waits
longer (doubling, up to `max_delay_s`), and at `max_failures` the address is refused every attempt, right or
wrong, for `lockout_s` (so a guess cannot be confirmed while it is refused). A success forgets the address.
At most `capacity` addresses are remembered, the longest quiet forgotten first, so memory stays bounded.

The address is the connection's (callers.py's `ForwardedFor` reads X-Forwarded-For only from the proxies of
--forwarded-allow-ips): behind any other proxy every caller shares the proxy's, and one caller's failures lock
the others' logins too.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from fastapi.responses import JSONResponse

LOGIN_PATHS = ("/login", "/login/")  # Gradio's login form posts here (with --auth)
REFUSED = "too many failed logins from this address; try again in {seconds} s"


@dataclass
class _Record:
    first_s: float  # when the window of counted failures began
    failures: int = 0
    locked_until_s: float = 0.0


class LoginThrottle:
    """The failures of each address (see the module's docstring). `clock`: seconds, monotonic."""

    def __init__(
        self,
        *,
        slow_after: int = 3,
        max_failures: int = 10,
        window_s: float = 300.0,
        lockout_s: float = 300.0,
        delay_s: float = 0.5,
        max_delay_s: float = 4.0,
        capacity: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.slow_after = slow_after
        self.max_failures = max_failures
        self.window_s = window_s
        self.lockout_s = lockout_s
        self.delay_s = delay_s
        self.max_delay_s = max_delay_s
        self.capacity = capacity
        self.clock = clock
        self._records: OrderedDict[str, _Record] = OrderedDict()

    @property
    def remembered(self) -> int:
        """Addresses with failures on record."""
        return len(self._records)

    def retry_after(self, address: str) -> int | None:
        """Whole seconds until `address` may try again, or None when it may try now."""
        record = self._records.get(address)
        if record is None:
            return None
        left = record.locked_until_s - self.clock()
        return math.ceil(left) if left > 0 else None

    def failed(self, address: str) -> float:
        """Counts a failure; returns how long its answer should wait (seconds)."""
        now = self.clock()
        record = self._records.pop(address, None)
        if record is None or now - record.first_s > self.window_s:
            record = _Record(first_s=now)
        record.failures += 1
        if record.failures >= self.max_failures:
            record.locked_until_s = now + self.lockout_s
            record.first_s, record.failures = now, 0  # after the lockout, a fresh window
        self._records[address] = record  # the most recent last
        while len(self._records) > self.capacity:
            self._records.popitem(last=False)
        beyond = record.failures - self.slow_after - 1  # the first slow_after are answered at once
        return 0.0 if record.locked_until_s > now or beyond < 0 else min(self.delay_s * 2**beyond, self.max_delay_s)

    def succeeded(self, address: str) -> None:
        record = self._records.get(address)
        if record is not None and record.locked_until_s <= self.clock():
            del self._records[address]


def address_of(scope) -> str:
    client = scope.get("client")
    return client[0] if client else "unknown"


def refusal(seconds: int, content: dict | None = None) -> JSONResponse:
    """The 429 an address gets while refused (`content`: the door's own error shape)."""
    message = REFUSED.format(seconds=seconds)
    return JSONResponse(status_code=429, content=content or {"detail": message}, headers={"Retry-After": str(seconds)})


class LoginGuard:
    """ASGI middleware over Gradio's `/login`: a refused address gets 429 at once; a failed login (Gradio answers
    400) is counted and its answer waits as the throttle says; a successful one forgets the address."""

    def __init__(self, app, throttle: LoginThrottle):
        self.app = app
        self.throttle = throttle

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in LOGIN_PATHS:
            return await self.app(scope, receive, send)
        address = address_of(scope)
        seconds = self.throttle.retry_after(address)
        if seconds is not None:
            return await refusal(seconds)(scope, receive, send)

        async def watched(message):
            if message["type"] == "http.response.start":
                if message["status"] == 400:  # Gradio's "Incorrect credentials."
                    await asyncio.sleep(self.throttle.failed(address))
                elif message["status"] == 200:
                    self.throttle.succeeded(address)
            await send(message)

        return await self.app(scope, receive, watched)
