"""The REST APIs' gate: who may call them, how big a body may be, and how each API says no.

`ApiGate` is an ASGI middleware in front of the app. For a path of one of the APIs (A1111's `/sdapi/`,
OpenAI's `/v1/`, ComfyUI's `/prompt`, `/history`, `/view`, ... and its `/ws` socket, each also under `/api/`, and Gradio's
MCP server under `/gradio_api/mcp/`, which Gradio's login does not cover) it checks the caller's credentials before anything is read, refuses a body whose
Content-Length is over the limit at once (413) and counts the bytes of one that does not say (chunked), so
that an oversized body is never held in memory; other paths (the page) pass untouched.

Access (`ApiAccess`): with neither `--auth` nor `--api-key` the APIs are open and any Authorization header is
ignored (SillyTavern and Open WebUI send an empty one). Otherwise every call must carry one of:
- HTTP Basic with an `--auth` user and password (A1111's own `--api-auth` way);
- HTTP Basic with any user name and an API key as the password (for A1111 clients that only know Basic);
- `Authorization: Bearer KEY` with an `--api-key` key (OpenAI's way), or `Bearer user:password` of an
  `--auth` user (so an OpenAI client reaches a server started with `--auth` only).
The PNG links of OpenAI's `response_format=url` (/v1/images/files/...) are open: their unguessable name is the
credential, as a signed URL's is. A wrong credential is a failed login (throttle.py): slowed after a few from one
address, then that address is refused (429) for a while.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import engine

from .callers import CallerBusy
from .throttle import REFUSED, LoginThrottle, address_of

log = logging.getLogger("jax-sd")

A1111_PREFIX = "/sdapi/"
OPENAI_PREFIX = "/v1/"
FILES_PREFIX = "/v1/images/files/"
MCP_PREFIX = "/gradio_api/mcp"  # Gradio's MCP server: /schema, /sse, /messages/ and the streamable HTTP route
# ComfyUI's routes (comfy.py), each also under /api; /history/ID and /object_info/NODE below theirs.
COMFY_PATHS = ("/prompt", "/history", "/view", "/object_info", "/system_stats", "/queue", "/interrupt", "/upload/image")
COMFY_PATHS += ("/ws",)
DEFAULT_MAX_BODY_MB = 20.0


def door_of(path: str) -> str | None:
    """Which API a path belongs to: "a1111", "openai", "comfy", or None (the page)."""
    if path.startswith(A1111_PREFIX):
        return "a1111"
    if path.startswith(OPENAI_PREFIX):
        return "openai"
    own = path.removeprefix("/api") if path.startswith("/api/") else path
    if own in COMFY_PATHS or own.startswith(("/history/", "/object_info/")):
        return "comfy"
    return None


def _guarded(path: str) -> str | None:
    """The door the gate keeps for a path: an API's, "mcp", or None (the page, whose login is Gradio's)."""
    return door_of(path) or ("mcp" if path == MCP_PREFIX or path.startswith(MCP_PREFIX + "/") else None)


# ---- errors, in each API's own shape ------------------------------------------------------------


class ApiError(HTTPException):
    """A refusal with a message for the caller; `code` and `param` fill OpenAI's error fields."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None, headers=None):
        super().__init__(status_code=status, detail=message, headers=headers)
        self.code = code
        self.param = param


def incident(error: BaseException, where: str) -> str:
    """Logs a failure with its details under a new id, and says what the caller is told: "internal error" and
    the id, never the error's own text (it may name paths or the server's insides)."""
    ident = secrets.token_hex(6)
    log.error("internal error %s (%s): %s: %s", ident, where, type(error).__name__, error, exc_info=error)
    return f"internal error {ident}"


def internal_error(error: BaseException, where: str) -> ApiError:
    """A 500 whose message is `incident`'s."""
    return ApiError(500, incident(error, where), code="internal_error")


OPENAI_TYPES = {401: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


def error_response(path: str, status: int, message: str, *, code=None, param=None, headers=None) -> JSONResponse:
    """OpenAI's `{"error": {message, type, param, code}}` on /v1/, ComfyUI's `{"error": {type, message, details,
    extra_info}, "node_errors"}` on its paths, else A1111's `{error, detail, body, errors}`."""
    if door_of(path) == "comfy":
        error = {"type": code or "invalid_prompt", "message": message, "details": "", "extra_info": {}}
        content = {"error": error, "node_errors": {}}
    elif door_of(path) == "openai":
        kind = OPENAI_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        content: dict[str, Any] = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    else:
        content = {"error": code or "HTTPException", "detail": message, "body": "", "errors": message}
    return JSONResponse(status_code=status, content=content, headers=headers)


def _validation_message(error: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for item in error.errors():
        where = ".".join(str(p) for p in item.get("loc", ()) if p not in ("body", "query"))
        param = param or where or None
        parts.append(f"{where}: {item.get('msg')}" if where else str(item.get("msg")))
    return "; ".join(parts) or "the request could not be read", param


def install_error_handlers(app) -> None:
    """The APIs' refusals in their own shapes; the page's paths keep FastAPI's. A bad value
    (`engine.InvalidRequest`) is A1111's 422 or OpenAI's 400; a full queue (`engine.Busy`) a 503 at once, and a
    caller over its share (`CallerBusy`) a 429 with Retry-After."""
    from fastapi.exception_handlers import http_exception_handler, request_validation_exception_handler

    async def on_http(request: Request, error: StarletteHTTPException):
        if door_of(request.url.path) is None:
            return await http_exception_handler(request, error)
        return error_response(
            request.url.path,
            error.status_code,
            str(error.detail),
            code=getattr(error, "code", None),
            param=getattr(error, "param", None),
            headers=getattr(error, "headers", None),
        )

    async def on_invalid(request: Request, error: RequestValidationError):
        path = request.url.path
        if door_of(path) is None:
            return await request_validation_exception_handler(request, error)
        message, param = _validation_message(error)
        if door_of(path) == "comfy":
            return error_response(path, 400, message, code="invalid_prompt")
        if door_of(path) == "openai":
            return error_response(path, 400, message, code="invalid_value", param=param)
        return JSONResponse(
            status_code=422,
            content={
                "error": "ValidationError",
                "detail": message,
                "body": "",
                "errors": jsonable_encoder(error.errors()),
            },
        )

    async def on_invalid_request(request: Request, error: engine.InvalidRequest):
        if door_of(request.url.path) in ("openai", "comfy"):
            return error_response(request.url.path, 400, str(error), code="invalid_value")
        return error_response(request.url.path, 422, str(error), code="InvalidRequest")

    async def on_busy(request: Request, error: engine.Busy):
        code = "server_busy" if door_of(request.url.path) == "openai" else "Busy"
        return error_response(request.url.path, 503, str(error), code=code, headers={"Retry-After": "2"})

    async def on_caller_busy(request: Request, error: CallerBusy):
        seconds = {"Retry-After": str(error.retry_after_s)}
        return error_response(request.url.path, 429, str(error), code="rate_limit_exceeded", headers=seconds)

    async def on_crash(request: Request, error: Exception):
        if door_of(request.url.path) is None:
            raise error  # the page's: Gradio's and Starlette's own
        return error_response(request.url.path, 500, incident(error, request.url.path), code="internal_error")

    app.add_exception_handler(Exception, on_crash)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(RequestValidationError, on_invalid)
    app.add_exception_handler(engine.InvalidRequest, on_invalid_request)
    app.add_exception_handler(engine.Busy, on_busy)
    app.add_exception_handler(CallerBusy, on_caller_busy)


# ---- who may call --------------------------------------------------------------------------------


def read_auth(value: str | None) -> list[tuple[str, str]] | None:
    """`--auth`: "user:password", several comma-separated, or a file with one pair per line."""
    if not value:
        return None
    text = Path(value).read_text() if Path(value).is_file() else value
    pairs = []
    for item in text.replace(",", "\n").splitlines():
        item = item.strip()
        if not item or item.startswith("#"):
            continue
        user, sep, password = item.partition(":")
        if not sep or not user or not password:
            raise ValueError(f"--auth: {item!r} is not user:password")
        pairs.append((user, password))
    if not pairs:
        raise ValueError("--auth: no user:password pair given")
    return pairs


def read_api_keys(value: str | None) -> list[str] | None:
    """`--api-key`: "KEY", several comma-separated, or "@FILE" with one key per line (# starts a comment)."""
    if not value:
        return None
    text = Path(value[1:]).read_text() if value.startswith("@") else value
    keys = [item.strip() for item in text.replace(",", "\n").splitlines()]
    keys = [key for key in keys if key and not key.startswith("#")]
    if not keys:
        raise ValueError("--api-key: no key given")
    if any(len(key) < 8 or any(c.isspace() for c in key) for key in keys):
        raise ValueError("--api-key: a key must be at least 8 characters, without spaces")
    return keys


@dataclass(frozen=True)
class ApiAccess:
    users: tuple[tuple[str, str], ...] = ()  # --auth
    keys: tuple[str, ...] = ()  # --api-key

    @property
    def closed(self) -> bool:
        return bool(self.users or self.keys)

    def _user(self, user: str, password: str) -> str | None:
        found = None
        for name, secret in self.users:  # every pair compared, in constant time each
            if secrets.compare_digest(user.encode(), name.encode()) & secrets.compare_digest(
                password.encode(), secret.encode()
            ):
                found = name
        return found

    def _key(self, key: str) -> str | None:
        found = None
        for index, secret in enumerate(self.keys):
            if secrets.compare_digest(key.encode(), secret.encode()):
                found = f"key {index + 1}"  # who called, for their progress and interrupt; never the key
        return found

    def identify(self, authorization: str) -> str | None:
        """The caller's name for a valid Authorization header ("ann", "key 2"), else None."""
        scheme, _, value = authorization.strip().partition(" ")
        value = value.strip()
        if scheme.lower() == "basic":
            try:
                user, sep, password = base64.b64decode(value, validate=True).decode().partition(":")
            except (binascii.Error, UnicodeDecodeError):
                return None
            if not sep:
                return None
            return self._user(user, password) or self._key(password)
        if scheme.lower() == "bearer" and value:
            user, sep, password = value.partition(":")
            return self._key(value) or (self._user(user, password) if sep else None)
        return None


# ---- the middleware --------------------------------------------------------------------------------


class BodyTooLarge(ApiError):
    def __init__(self, limit: int):
        super().__init__(
            413,
            f"the request body is over this server's limit of {limit / 2**20:g} MB (--max-body-mb)",
            code="request_too_large",
            headers={"Connection": "close"},
        )


class ApiGate:
    """ASGI middleware: the APIs' credentials and body limit (see the module's docstring)."""

    def __init__(self, app, access: ApiAccess, max_body_bytes: int, throttle: LoginThrottle | None = None):
        self.app = app
        self.access = access
        self.max_body_bytes = max_body_bytes
        self.throttle = LoginThrottle() if throttle is None else throttle  # shared with the page's login form

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        door = _guarded(path)
        if scope["type"] == "websocket" and door == "comfy":
            return await self._socket(scope, receive, send)
        if scope["type"] != "http" or door is None:
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.access.closed and not path.startswith(FILES_PREFIX):
            address = address_of(scope)
            seconds = self.throttle.retry_after(address)
            if seconds is not None:
                message = REFUSED.format(seconds=seconds)
                response = error_response(
                    path, 429, message, code="rate_limit_exceeded", headers={"Retry-After": str(seconds)}
                )
                return await response(scope, receive, send)
            given = headers.get("authorization", "")
            caller = self.access.identify(given)
            if caller is None and given.strip():  # a wrong credential, not a missing one, counts as a failed login
                await asyncio.sleep(self.throttle.failed(address))
            elif caller is not None:
                self.throttle.succeeded(address)
            if caller is None and door == "mcp":
                response = JSONResponse(
                    status_code=401,
                    content={"error": "send HTTP Basic with an --auth user, or Authorization: Bearer KEY"},
                    headers={"WWW-Authenticate": 'Basic realm="jax-sd", Bearer'},
                )
                return await response(scope, receive, send)
            if caller is None:
                message = {
                    "openai": "Incorrect API key provided: send Authorization: Bearer KEY with a key of this server's --api-key",
                    "comfy": "Incorrect credentials: send Authorization: Bearer KEY with a key of this server's --api-key, "
                    "or HTTP Basic with an --auth user",
                }.get(
                    door,
                    "Incorrect username or password: send HTTP Basic with an --auth user (or any name and an API key)",
                )
                challenge = {"WWW-Authenticate": 'Basic realm="jax-sd"' if door != "openai" else "Bearer"}
                response = error_response(path, 401, message, code="invalid_api_key", headers=challenge)
                return await response(scope, receive, send)
            scope.setdefault("state", {})["api_caller"] = caller
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            refusal = BodyTooLarge(self.max_body_bytes)
            response = error_response(path, 413, refusal.detail, code=refusal.code, headers=refusal.headers)
            return await response(scope, receive, send)
        return await self.app(scope, self._counted(receive), send)

    async def _socket(self, scope, receive, send):
        """ComfyUI's progress socket: the same credentials as its routes, else closed before it opens (403)."""
        if self.access.closed:
            address = address_of(scope)
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            given = headers.get("authorization", "")
            caller = None if self.throttle.retry_after(address) is not None else self.access.identify(given)
            if caller is None:
                if given.strip():
                    await asyncio.sleep(self.throttle.failed(address))
                await receive()  # its connect
                return await send({"type": "websocket.close", "code": 1008})
            self.throttle.succeeded(address)
            scope.setdefault("state", {})["api_caller"] = caller
        return await self.app(scope, receive, send)

    def _counted(self, receive):
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)  # FastAPI passes an HTTPException from reading on
            return message

        return counted
