"""The cluster's one settings record: what the replicas load, and how the page in front of them queues and whom
it serves.

The Serve config's `args` (serve_config.yaml) fill it; where replicas run and how many there are is Ray
Serve's own part of that config (`deployments:`), not ours. The page's doors (`auth`, `api_keys`,
`max_body_mb`, `max_picture_pixels`, `mcp`, `allowed_hosts`) and each caller's share (`max_caller_requests`,
`max_caller_work`, `forwarded_allow_ips`) mean what app.py's flags of those names mean, and reach the same
`web.build_app` (`web_options`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine import DEFAULT_MAX_BATCH_SIZE


@dataclass(frozen=True)
class ClusterSettings:
    model: str | None = None  # Hub id or folder on every replica host; None: the embedded model
    dtype: str | None = None  # None: the host's best (engine.serving.start.default_dtype)
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE  # pictures one replica draws at once
    sizes: str | tuple[tuple[int, int], ...] = "common"  # "common", or ((width, height), ...): the sizes offered
    images_per_device: int = 1  # the page's default; the warm-up compiles its width
    chunk_steps: int = 1  # denoising steps between the engine's progress reports
    queue_size: int = 48  # requests waiting in the page's Gradio queue; more are refused at once
    concurrency: int = 64  # requests the page hands the replicas at once (Serve queues what they cannot take)
    retries: int = 1  # a request whose replica dies is drawn again on another replica this many times
    controlnet: str | None = None  # a ControlNet folder or Hub id on every replica host, as app.py's --controlnet
    vae: str | None = None  # a VAE folder or Hub id in place of the model's own, as app.py's --vae
    t5: str = "device"  # where SD3's and FLUX.1's T5 runs: device, host or off, as app.py's --t5
    quantize: str | None = None  # "int8": the denoiser's kernels as int8, as app.py's --quantize
    loras: tuple[tuple[str, str], ...] = ()  # (name, path or Hub id) pairs, as app.py's --lora NAME=PATH
    # Who may call, as app.py's --auth and --api-key: (user, password) pairs for the page, its APIs and MCP; keys
    # for the REST APIs and MCP. Kept out of the repr, which Serve may log.
    auth: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    max_body_mb: float = 20.0  # the APIs' bodies and the page's uploads at most, as --max-body-mb (web's default)
    max_picture_pixels: int | None = None  # a picture sent in over this is refused from its header; None: web's
    mcp: bool = False  # also serve /generate as an MCP tool, as --mcp (behind auth and api_keys like the APIs)
    # The Host names the page answers to besides loopback's, as --allowed-hosts; () checks none: the page cannot
    # tell where Serve's proxy listens (http_options.host).
    allowed_hosts: tuple[str, ...] = ()
    # Each caller's share of the replicas, page, APIs and MCP together, as --max-caller-requests and
    # --max-caller-work (web's defaults): requests, and images x steps, waiting or drawing at once; beyond them 429.
    max_caller_requests: int = 8
    max_caller_work: int = 2400
    # The proxies whose X-Forwarded-For names the client, as --forwarded-allow-ips (addresses, networks or "*");
    # () trusts none: every anonymous caller behind a proxy is then the proxy's one caller.
    forwarded_allow_ips: tuple[str, ...] = ()

    def __post_init__(self):
        number = int | float
        if not isinstance(self.max_body_mb, number) or isinstance(self.max_body_mb, bool) or self.max_body_mb <= 0:
            raise ValueError(f"max_body_mb must be a number above 0, not {self.max_body_mb!r}")
        pixels = self.max_picture_pixels
        if pixels is not None and (not isinstance(pixels, int) or isinstance(pixels, bool) or pixels <= 0):
            raise ValueError(f"max_picture_pixels must be a whole number above 0, or null, not {pixels!r}")
        if not isinstance(self.mcp, bool):
            raise ValueError(f"mcp must be true or false, not {self.mcp!r}")
        for name in ("max_caller_requests", "max_caller_work"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a whole number of at least 1, not {value!r}")

    @classmethod
    def from_args(cls, args: dict | None) -> ClusterSettings:
        """The Serve config's `args`; an unknown key is refused by name, as a typo would otherwise be ignored."""
        args = dict(args or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"unknown settings {unknown}; the known ones are {sorted(known)}")
        sizes = args.get("sizes")
        if isinstance(sizes, str) and sizes != "common":  # "512x512,768x512", as app.py's --sizes
            sizes = [item.strip().lower().split("x") for item in sizes.split(",")]
        if isinstance(sizes, list | tuple):
            args["sizes"] = tuple(tuple(int(v) for v in pair) for pair in sizes)
        loras = args.get("loras")
        if isinstance(loras, dict):  # {name: path} in the YAML
            args["loras"] = tuple((str(k), str(v)) for k, v in loras.items())
        elif isinstance(loras, list | tuple):
            args["loras"] = tuple(tuple(pair) for pair in loras)
        if "auth" in args:
            args["auth"] = _credentials(args["auth"], "auth", _read_auth)
        if "allowed_hosts" in args:
            args["allowed_hosts"] = _read_allowed_hosts(args["allowed_hosts"])
        if "api_keys" in args:
            args["api_keys"] = _credentials(args["api_keys"], "api_keys", _read_api_keys)
        if "forwarded_allow_ips" in args:
            args["forwarded_allow_ips"] = _read_forwarded_allow_ips(args["forwarded_allow_ips"])
        return cls(**args)

    def web_options(self) -> dict:
        """The keyword arguments of `web.build_app` for the page: the same app, and doors, as `python app.py`."""
        from web import allowed_hosts  # on the ingress, which serves the web layer

        return dict(
            images_per_device=self.images_per_device,
            concurrency=self.concurrency,
            queue_size=self.queue_size,
            auth=list(self.auth) or None,
            api_keys=list(self.api_keys) or None,
            max_body_mb=self.max_body_mb,
            max_picture_pixels=self.max_picture_pixels,
            mcp=self.mcp,
            allowed_hosts=allowed_hosts("0.0.0.0", self.allowed_hosts),
            max_caller_requests=self.max_caller_requests,
            max_caller_work=self.max_caller_work,
            forwarded_allow_ips=self.forwarded_allow_ips,
        )

    def engine_sizes(self) -> str | list[tuple[int, int]]:
        return self.sizes if isinstance(self.sizes, str) else [tuple(pair) for pair in self.sizes]


def _credentials(value, name: str, read) -> tuple:
    """`auth` / `api_keys` from the config: null, the flag's string ("a,b", a file), or a list of such strings."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(item, str) for item in items):
        raise ValueError(f"{name} must be a string or a list of strings, as app.py's flag takes")
    found = []
    for item in items:
        found += read(item) or []
    if items and not found:
        raise ValueError(f"{name}: nothing given")
    return tuple(found)


# The flags' own readers. Imported when the config is read, not with this module: the replicas, which import it
# too, need no web layer.
def _read_auth(value: str) -> list[tuple[str, str]] | None:
    from web import read_auth

    return read_auth(value)


def _read_api_keys(value: str) -> list[str] | None:
    from web import read_api_keys

    return read_api_keys(value)


def _read_allowed_hosts(value) -> tuple[str, ...]:
    from web import read_allowed_hosts

    return read_allowed_hosts(value)


def _read_forwarded_allow_ips(value) -> tuple[str, ...]:
    """null, the flag's string ("10.0.0.0/8,192.0.2.7", "*"), or a list of such strings; each read by the flag's
    reader, which refuses what is not an address or a network."""
    from web import read_forwarded_allow_ips

    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(item, str) for item in items):
        raise ValueError("forwarded_allow_ips must be a string or a list of strings, as app.py's flag takes")
    return tuple(dict.fromkeys(ip for item in items for ip in read_forwarded_allow_ips(item)))
