"""Runs the real `app.py` in a child process on a free 127.0.0.1 port, for end-to-end tests.

One server per test session is shared by the API and browser tests (`shared_app`), since
loading and warming up the engine is the slow part. Everything stays on this machine: the
server binds 127.0.0.1, the Hub is offline, and the compile and Gradio caches live under the
session's temporary folder.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.multidevice import xla_flags

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 300  # import JAX, load the embedded model; warm-up goes on in the background
QUEUE_SIZE = 2  # small, so that a test can fill the queue with a handful of requests
MAX_BATCH_SIZE = 2  # two pictures drawn at once; the page hands the engine twice that many requests
CONCURRENCY = 2 * MAX_BATCH_SIZE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AppServer:
    def __init__(self, workdir: Path, *args: str, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.log_path = workdir / f"app-{self.port}.log"
        self.cache_dir = Path(os.environ.get("JAX_SD_CACHE_DIR") or workdir / "xla-cache")  # the session's (conftest)
        environment = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "JAX_SD_CACHE_DIR": str(self.cache_dir),
            "GRADIO_TEMP_DIR": str(workdir / "gradio"),
            "GRADIO_ANALYTICS_ENABLED": "False",
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
        for name in ("MODEL_ID", "GRADIO_SERVER_NAME", "GRADIO_SERVER_PORT"):
            environment.pop(name, None)  # the server's setup comes from this helper only
        environment["XLA_FLAGS"] = xla_flags()  # the suite's compile flags, no device count of this process's
        environment.update(env or {})
        command = [sys.executable, str(ROOT / "app.py"), "--host", "127.0.0.1", "--port", str(self.port), *args]
        self._log = open(self.log_path, "w")  # closed in stop()
        self.process = subprocess.Popen(command, cwd=ROOT, env=environment, stdout=self._log, stderr=subprocess.STDOUT)

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def wait_until_up(self, timeout: float = START_TIMEOUT_S) -> AppServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"app.py exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url, timeout=5) as response:
                    if response.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"app.py did not answer within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=20)
        self._log.close()


def shared_app(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> AppServer:
    """The session's one server on the embedded model, started on first use."""
    config = request.config
    server = getattr(config, "_jax_sd_app", None)
    if server is None:
        server = AppServer(
            tmp_path_factory.mktemp("app"),
            "--queue-size",
            str(QUEUE_SIZE),
            "--max-batch-size",
            str(MAX_BATCH_SIZE),
            # live mode's pause, longer than the 0.3 s default: on the suite's loaded cores the page's keys reach the
            # server with gaps past 0.3 s, each gap then a pause with its own drawing
            env={"JAX_SD_LIVE_PAUSE_S": "0.8"},
        ).wait_until_up()
        config._jax_sd_app = server
        config.add_cleanup(server.stop)
    elif server.process.poll() is not None:
        pytest.fail(f"the shared app server died:\n{server.log_tail()}")
    return server
