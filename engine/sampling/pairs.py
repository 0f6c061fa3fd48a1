"""Core pairs: on a CPU host, each image's work split over two XLA CPU devices.

At Stable Diffusion's shapes one XLA CPU device does not keep two cores busy (measured, below); two
devices, each given half of an image's work, do. The engine's mesh then
has a second axis, `pair` (`Engine(core_pairs=True)`): slots are sharded over `data` as always and
replicated over `pair`, and the programs split the heavy calls across the pair with sharding
constraints, which XLA's SPMD partitioner carries through the network:

- the UNet batch, by rows, when each device's rows are even (a guided image's two halves, on
  different devices); otherwise by latent rows (`split_rows`);
- the VAE decode, by latent rows: convolutions exchange their edge rows, GroupNorm sums across both.

Measured on 2 Zen 4 cores, SD 1.5's layout at a quarter width, 256x256: the guided UNet call 204-213
-> 152-168 ms; one image's VAE decode 279 -> 242 ms; a batch-1 UNet 132 -> 122 ms; in the engine a
guided step 238 -> 156-182 ms, a guidance-off step level (125-148 against 121-153 ms). What is not
split (the text encoders at admission, the scheduler's arithmetic) runs whole on both devices.

`pair_cores()` asks XLA for the two devices; it must run before JAX starts its backend (the app and
the command line call it first thing). Without it, or off the CPU, nothing here changes a program. Where the
networks run in bf16 through oneDNN (`engine/nn/onednn.py`), or the denoiser in its int8 kernels (`--quantize
w8a8`, engine/nn/int8.py), it asks for none: oneDNN keeps every core busy within each call, and XLA would run the
replicated custom calls once on each device of a pair.
"""

from __future__ import annotations

import os

import jax
from jax.sharding import PartitionSpec as P

from .. import cpus
from ..nn import onednn

DATA, PAIR = "data", "pair"  # the mesh's axes: slots over data groups, a group's core pair
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
SWITCH = "JAX_SD_CORE_PAIRS"  # "0": never; "1": on (set by pair_cores, inherited by child processes)


def pair_cores(dtype: str | None = None, int8: bool = False) -> bool:
    """Asks XLA for two CPU devices where that helps: a host with 2 or more cores, the CPU platform, no
    device count chosen already, JAX_SD_CORE_PAIRS not "0", and networks that XLA runs itself (`dtype`, the
    engine's: None for JAX_SD_DTYPE or the host's choice; bf16 through oneDNN takes no pair, nor a denoiser
    computing in oneDNN's int8 kernels, `int8`: `--quantize w8a8`, whose calls keep every core busy as well). Call before JAX
    starts its backends: it also sizes the process's thread pools to its CPU quota first (`cpus.fit_threads`).
    Returns whether this process runs core pairs (`asked()`)."""
    if not backends_started():
        cpus.fit_threads()
    flags = os.environ.get("XLA_FLAGS", "")
    platforms = os.environ.get("JAX_PLATFORMS") or "cpu"
    if os.environ.get(SWITCH) == "0" or DEVICE_COUNT_FLAG in flags or "cpu" not in platforms.split(","):
        return asked()
    dtype = dtype or os.environ.get("JAX_SD_DTYPE") or onednn.cpu_dtype()
    if onednn.kernels_for(dtype) or (int8 and onednn.handlers() is not None):
        return False
    if cpus.usable_cpus() < 2 or backends_started():
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {DEVICE_COUNT_FLAG}=2".strip()
    os.environ[SWITCH] = "1"
    return True


def asked() -> bool:
    """This process (or the one that started it) asked for core pairs: engines pair their CPU devices."""
    return os.environ.get(SWITCH) == "1"


def backends_started() -> bool:
    """Whether JAX has started its backends: past that, XLA's flags and the host's setup are fixed."""
    from jax._src import xla_bridge  # no public way to ask without starting them

    return bool(xla_bridge._backends)


def paired(devices: list[jax.Device]) -> bool:
    """Whether `devices` should run as core pairs: two or more CPU devices, an even count, none else."""
    return len(devices) >= 2 and len(devices) % 2 == 0 and all(d.platform == "cpu" for d in devices)


def active() -> bool:
    """The program being traced runs on a mesh with a `pair` axis (`jax.set_mesh` around the lowering)."""
    return PAIR in jax.sharding.get_abstract_mesh().axis_names


def split_batch(x: jax.Array) -> jax.Array:
    """`x` [batch, ...] with each data group's rows split over its pair: by rows when they are even, else
    by the second axis (latent rows of an NHWC batch). Unchanged off a paired mesh."""
    if not active():
        return x
    groups = jax.sharding.get_abstract_mesh().shape[DATA]
    if (x.shape[0] // groups) % 2 == 0:
        return jax.lax.with_sharding_constraint(x, P((DATA, PAIR)))
    return split_rows(x)


def split_rows(x: jax.Array) -> jax.Array:
    """`x` [batch, rows, ...] split over the pair by its second axis; unchanged off a paired mesh."""
    if not active():
        return x
    return jax.lax.with_sharding_constraint(x, P(DATA, PAIR))
