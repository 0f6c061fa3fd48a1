"""Helpers for the REST API tests: a stand-in engine, the app served by uvicorn on a free 127.0.0.1 port in a
thread (bounded start and stop), and pictures made on purpose (a PNG that claims a huge size)."""

from __future__ import annotations

import base64
import io
import socket
import struct
import threading
import time
import zlib

import numpy as np
import uvicorn
from PIL import Image

import engine
import web
from engine.serving.warmup import Warmup

START_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServedApp:
    """`with ServedApp(app) as url:` the app on http://127.0.0.1:PORT until the block ends."""

    def __init__(self, app):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", timeout_graceful_shutdown=2, proxy_headers=False
        )  # as web.serve: X-Forwarded-For is the app's to read
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the API test server did not start")
            time.sleep(0.05)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


class HeldTicket(engine.Ticket):
    """A ticket that stays running until it is cancelled (then fails as the engine's do)."""

    def cancel(self) -> None:
        if not self.done:
            super().cancel()
            self.emit(engine.Failed(engine.cancelled()))


class FakeEngine:
    """The engine's public face, answering at once: progress, a preview, then plain pictures whose colour
    encodes the seed. `hold`: tickets stay at step 1 until cancelled; `error`: raised or failed with."""

    defaults = {"num_inference_steps": 4, "guidance_scale": 7.5, "height": 64, "width": 64, "scheduler": "ddim"}
    family = "fake"
    variant = engine.VARIANTS[0]
    model_name = "fake/model"
    devices = ["cpu:0"]
    batch_size = 4
    ready = True
    warmup_state = Warmup(seconds=1.0)
    example_prompts = ["a red circle"]
    limits = engine.Limits(
        schedulers=("pndm", "ddim", "euler", "euler_a", "dpm++2m", "dpm++2m_karras", "lcm"),
        side_multiple=8,
        max_side=1024,
        max_clip_skip=1,
        devices=1,
        sizes=((64, 64), (88, 64)),
        max_steps=50,
        max_images=8,
        loras=("style",),
        max_deep_cache=10,
        max_token_merging=0.75,
    )

    def __init__(self, error: Exception | None = None, hold: bool = False):
        self.error = error
        self.hold = hold
        self.calls: list[engine.GenerationRequest] = []
        self.tickets: list[engine.Ticket] = []

    def canny_image(self, image):
        return image

    def submit(self, request, caller=""):
        request = self.limits.resolve(request, self.defaults)
        if isinstance(self.error, engine.InvalidRequest | engine.Busy):
            raise self.error
        self.calls.append(request)
        ticket = HeldTicket(request, [], caller)
        self.tickets.append(ticket)
        steps = request.num_inference_steps
        ticket.emit(engine.Queued(1))
        ticket.emit(engine.Progress(1, steps))
        ticket.emit(engine.Preview([np.full((request.height // 8, request.width // 8, 3), 200, np.uint8)]))
        if self.hold:
            return ticket
        if self.error is not None:
            ticket.emit(engine.Failed(self.error))
            return ticket
        images = [Image.new("RGB", (request.width, request.height), picture_colour(s)) for s in request.image_seeds()]
        result = engine.GenerationResult(
            images=images,
            seeds=request.image_seeds(),
            devices=["cpu:0"] * len(images),
            timings={"queue_s": 0.0, "compile_s": 0.0, "run_s": 0.0, "total_s": 0.0},
            compiled=False,
            request=request,
        )
        ticket.emit(engine.Finished(result))
        return ticket


def picture_colour(seed: int) -> tuple[int, int, int]:
    return (seed % 256, (seed // 256) % 256, 7)


def fake_app(pipe: FakeEngine | None = None, **options):
    return web.build_app(pipe or FakeEngine(), **options)


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def b64png(image: Image.Image, data_url: bool = False) -> str:
    text = base64.b64encode(png(image)).decode()
    return "data:image/png;base64," + text if data_url else text


def png_claiming(width: int, height: int) -> bytes:
    """A valid PNG header that claims width x height pixels, with almost no pixel data behind it."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


def decode_png(text: str) -> Image.Image:
    image = Image.open(io.BytesIO(base64.b64decode(text)))
    image.load()
    return image


def shared_engine(request, tmp_path_factory) -> engine.Engine:
    """The session's one embedded-model engine for the API tests (both files), with the session's compile cache
    so that a second engine (the busy test's) loads the same programs from disk."""
    config = request.config
    pipe = getattr(config, "_jax_sd_api_engine", None)
    if pipe is None:
        engine.enable_compile_cache()
        pipe = engine.load_pipeline(max_batch_size=2)
        config._jax_sd_api_engine = pipe
        config.add_cleanup(pipe.close)
    return pipe


def max_pixel_difference(a: Image.Image, b: Image.Image) -> int:
    assert a.size == b.size, (a.size, b.size)
    return int(np.abs(np.asarray(a.convert("RGB"), np.int16) - np.asarray(b.convert("RGB"), np.int16)).max())


def raw_http(port: int, head: str, body_parts=(), timeout: float = 20) -> tuple[int, str]:
    """Sends a request by hand (a head, then body parts as given) and reads the answer: (status, text)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head.encode("latin-1"))
        for part in body_parts:
            s.sendall(part)
        data = b""
        while b"\r\n\r\n" not in data or len(data) < _answer_length(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1].decode("utf-8", "replace")


def _answer_length(data: bytes) -> int:
    head, _, _ = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(head) + 4 + int(line.split(b":", 1)[1])
    return len(data) + 1
