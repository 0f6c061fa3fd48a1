"""The host's memory as a CPU server uses it (engine.keep_freed_memory): XLA's CPU programs allocate their
temporaries at every call, and glibc must hand back the block it kept, not map fresh pages for the kernel to zero."""

from __future__ import annotations

import pytest
from multidevice import run_with_devices

PROGRAM = """
    import os, resource
    os.environ["JAX_SD_KEEP_FREED_MEMORY"] = {switch!r}
    from engine import keep_freed_memory
    kept = keep_freed_memory()  # before JAX starts its backend
    import jax, jax.numpy as jnp
    a, b = jnp.ones((4096, 8)), jnp.ones((8, 4096))
    run = jax.jit(lambda a, b: jnp.sum((a @ b) @ b.T))  # a 64 MB temporary: the [4096, 4096] product
    for _ in range(2):
        run(a, b).block_until_ready()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        run(a, b).block_until_ready()
    print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.parametrize("switch", ["1", "0"])
def test_a_cpu_program_reuses_its_temporaries_where_freed_memory_is_kept(tmp_path, switch):
    kept, faults = run_with_devices(1, PROGRAM.format(switch=switch), tmp_path).split()[-2:]
    if switch == "1":
        assert kept == "True" and int(faults) < 1000  # the block of the calls before
    else:  # as glibc does by itself: the 64 MB mapped afresh, 16,384 pages a call
        assert kept == "False" and int(faults) > 3 * 10_000


def test_once_jax_has_started_it_is_too_late_and_says_so():
    import jax

    from engine import keep_freed_memory

    jax.devices()
    assert keep_freed_memory() is False
