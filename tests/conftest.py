"""Shared test set-up: tests run on the CPU in f32, from the repo root."""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# f32 means f32 on every backend (a GPU would otherwise multiply f32 matrices in TF32).
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# The suite compares f32 pictures with diffusers' f32: no host's bf16 default (tests that want bf16 ask for it).
os.environ.setdefault("JAX_SD_DTYPE", "float32")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


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
