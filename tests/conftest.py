"""Shared test set-up: tests run on the CPU in f32, from the repo root."""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# f32 means f32 on every backend (a GPU would otherwise multiply f32 matrices in TF32).
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# The suite compares f32 pictures with diffusers' f32: no host's bf16 default (tests that want bf16 ask for it).
os.environ.setdefault("JAX_SD_DTYPE", "float32")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# Most of the suite's time is XLA compiling small programs for the tiny models, whose runs are short. The tests and
# the processes they start compile with less of LLVM's effort: the same HLO, the same passes over it, host code that
# is less tuned (measured on 2 Zen 3 cores: test_controlnet.py 143 -> 96 s). tests/multidevice.py passes these on.
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if FAST_COMPILE_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{FAST_COMPILE_FLAGS} {os.environ.get('XLA_FLAGS', '')}".strip()
# One compile cache for the session (JAX_SD_CACHE_DIR, which `enable_compile_cache` reads): the in-process engines,
# the app servers and the cluster's replicas the tests start load what another of them compiled. Never the user's own.
# The first process of a run makes it; xdist's workers, started from that process, inherit it.
SESSION_CACHE = os.environ.get("JAX_SD_TEST_SESSION_CACHE")
OWNS_SESSION_CACHE = SESSION_CACHE is None
if OWNS_SESSION_CACHE:
    SESSION_CACHE = os.environ["JAX_SD_TEST_SESSION_CACHE"] = tempfile.mkdtemp(prefix="jax-sd-test-xla-")
os.environ["JAX_SD_CACHE_DIR"] = SESSION_CACHE


def pytest_unconfigure(config):
    if OWNS_SESSION_CACHE:
        shutil.rmtree(SESSION_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _free_each_files_programs():
    """After each test file, what it compiled and the engines it closed are freed: the whole suite runs in one
    process, whose compiled code and memory maps would otherwise only grow with every file (native crashes late in
    the suite, where the process neared its limits)."""
    yield
    import gc

    import jax

    gc.collect()
    jax.clear_caches()
