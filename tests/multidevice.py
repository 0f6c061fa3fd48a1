"""Runs test code under N simulated CPU devices.

XLA reads the device count once, when JAX starts, so a test that needs 8 devices runs its code in
a fresh interpreter with `--xla_force_host_platform_device_count`. The code writes what it
computed under `OUT` (a folder), and the test compares that with what it computed itself.
`start_with_devices` runs it in the background, so that it compiles while the tests before it run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

from engine.sampling.pairs import DEVICE_COUNT_FLAG

ROOT = Path(__file__).resolve().parents[1]


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a child process: this suite's own (conftest's compile flags), with `devices` CPU devices if
    given and never the device count this process may have chosen for itself."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    return " ".join(flags + ([f"{DEVICE_COUNT_FLAG}={devices}"] if devices else []))


def start_with_devices(n: int, code: str, out: Path, timeout: float = 300) -> Callable[[], str]:
    """Starts `code` (which sees `OUT`, a pathlib.Path to `out`) with n CPU devices; returns a wait for its stdout."""
    out.mkdir(parents=True, exist_ok=True)
    prelude = f"import pathlib, sys\nsys.path.insert(0, {str(ROOT)!r})\nOUT = pathlib.Path({str(out)!r})\n"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(n))
    process = subprocess.Popen(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def wait() -> str:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            raise AssertionError(f"the {n}-device run took more than {timeout} s") from None
        if process.returncode:
            raise AssertionError(f"the {n}-device run failed:\n{stderr[-4000:]}")
        return stdout

    return wait


def run_with_devices(n: int, code: str, out: Path, timeout: float = 300) -> str:
    """`start_with_devices`, waited for."""
    return start_with_devices(n, code, out, timeout)()
