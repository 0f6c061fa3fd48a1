"""The names this server answers to: a request whose Host header names another is refused (400).

A server on the loopback address is out of the network's reach, but not out of a web page's: a page on another
site can point its own name at 127.0.0.1 (DNS rebinding) and then call the server from the browser as if it were
that site, and read the answers. Its requests carry the page's name in Host, so a server on loopback answers only
to its own names (127.0.0.1, localhost, [::1]) and to those the operator adds (`--allowed-hosts`). The port is not
compared: the page cannot choose the name, and a forwarded port (Docker's `-p 8080:7860`) keeps working.
A server that listens on the network (0.0.0.0, a LAN address) is reached under names it cannot know, so it is not
checked unless `--allowed-hosts` names them.
"""

from __future__ import annotations

import ipaddress

from fastapi.responses import PlainTextResponse

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
REFUSED = (
    "This server answers only to its own names ({names}); the Host of this request is another. "
    "A name is added with --allowed-hosts (the cluster's allowed_hosts)."
)


def _is_loopback(server_name: str) -> bool:
    if server_name.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(server_name.strip("[]")).is_loopback
    except ValueError:
        return False


def read_allowed_hosts(value: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """`--allowed-hosts`: names, comma-separated (or a list), lowercased; "[::1]" as "::1". Raises ValueError."""
    if not value:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    names = []
    for item in items:
        if not isinstance(item, str):
            raise ValueError("--allowed-hosts: names, comma-separated")
        name = item.strip().lower().rstrip(".")
        name = name[1:-1] if name.startswith("[") and name.endswith("]") else name
        if not name:
            continue
        if any(c.isspace() or c in "/@?#" for c in name) or (":" in name and not _is_ip(name)):
            raise ValueError(f"--allowed-hosts: {item.strip()!r} is not a host name (give names without ports)")
        names.append(name)
    return tuple(dict.fromkeys(names))


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def allowed_hosts(server_name: str, extra: tuple[str, ...] = ()) -> frozenset[str] | None:
    """The names a server listening on `server_name` answers to, or None for any (see the module's docstring)."""
    if _is_loopback(server_name):
        return frozenset(LOOPBACK_NAMES + (server_name.lower().strip("[]"),) + tuple(extra))
    if extra:
        return frozenset(LOOPBACK_NAMES + tuple(extra))
    return None


def host_name(header: str) -> str:
    """The name in a Host header: "[::1]:7860" -> "::1", "LocalHost:7860" -> "localhost"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    if header.count(":") == 1:
        header = header.split(":", 1)[0]
    return header.rstrip(".")


class HostCheck:
    """ASGI middleware: a request (or websocket) whose Host names none of `allowed` gets 400 and nothing else."""

    def __init__(self, app, allowed: frozenset[str]):
        self.app = app
        self.allowed = allowed
        order = {name: k for k, name in enumerate(LOOPBACK_NAMES)}
        shown = sorted(allowed, key=lambda n: (order.get(n, len(order)), n))
        self.message = REFUSED.format(names=", ".join(f"[{n}]" if ":" in n else n for n in shown))

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        header = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"host"), "")
        if host_name(header) in self.allowed:
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await receive()  # its connect
            return await send({"type": "websocket.close", "code": 1008})
        return await PlainTextResponse(self.message, status_code=400)(scope, receive, send)
