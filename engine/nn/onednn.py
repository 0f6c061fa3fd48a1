"""oneDNN's bf16 matrix products, convolutions and attention on the CPU, as XLA custom calls.

XLA's CPU backend runs bf16 dots and convolutions no faster than f32 (Zen 4/5, 2 cores: a 4096x1280x1280
matmul 324 GFLOP/s in bf16 against 448 in f32); oneDNN runs them on the CPU's native bf16 instructions
(AVX512-BF16, AMX) at 942, and a 64x64 320->320 3x3 convolution at 1042 against XLA's 405 (f32). Where a
layer's kernel is bf16 on the CPU and `available()`, `layers.Linear` and `layers.Conv` call `matmul` and
`conv` here: the kernel stays bf16, the activations are cast to bf16 on the way in and come out in the dtype
the layer would give (f32 from an f32 input), with f32 accumulation and an f32 bias, as oneDNN computes.
bf16 attention on the CPU is `attention` here (nn/attention.py's "onednn" kind). Two elementwise calls of our own
stand where XLA's bf16 passes are slowest: `group_norm` (GroupNorm + SiLU, the ResNet blocks') and `geglu` (the
transformer blocks' exact-GELU gate). `upsample_conv` runs a nearest 2x upsampling and its 3x3 convolution as four
2x2 convolutions over the small input (`layers.Conv.upsampled`). A server `pin`s its params: their kernels are then
reordered into oneDNN's layout once, at their first call, instead of at every call.

The handlers (`onednn.cc`: matmul, convolutions, pinning; `attention.cc`; `cpu_loops.cc`: our own vector loops;
`onednn.h`: what they share) are compiled once per source, jaxlib and oneDNN with the host's C++ compiler into
JAX_SD_KERNEL_DIR (default ~/.cache/jax-sd/kernels) against the system's oneDNN (Debian: `libdnnl-dev`;
DNNL_ROOT names another install). Where the CPU has no native bf16 (oneDNN 2.x refuses every bf16 primitive on
AVX2), there is no compiler or no oneDNN, or JAX_SD_ONEDNN=0, `available()` is False, says why once in the log,
and the layers keep XLA's own dots and convolutions (bf16 asked for on such a CPU runs in XLA, slowly but right).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

SWITCH = "JAX_SD_ONEDNN"  # "0": never use oneDNN, whatever the host has
SOURCES = tuple(Path(__file__).with_name(name) for name in ("onednn.cc", "attention.cc", "cpu_loops.cc"))  # one library
HEADERS = tuple(Path(__file__).with_name(name) for name in ("onednn.h", "cpu_loops.h"))
MATMUL, CONV, ATTENTION = "jax_sd_onednn_matmul", "jax_sd_onednn_conv", "jax_sd_onednn_attention"
GROUP_NORM, GEGLU = "jax_sd_onednn_group_norm", "jax_sd_onednn_geglu"
UPSAMPLE_CONV = "jax_sd_onednn_upsample_conv"


NO_NATIVE_BF16 = (
    "this CPU computes no bf16 natively (no AVX512-BF16 or AMX-BF16), and oneDNN 2.x makes no bf16 kernels for it"
)


def native_bf16() -> bool:
    """Whether this host's CPU computes in bf16 natively (AVX512-BF16 or AMX-BF16), from /proc/cpuinfo."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _onednn_roots() -> list[Path]:
    given = os.environ.get("DNNL_ROOT")
    return [Path(given)] if given else [Path(sys.prefix), Path("/usr/local"), Path("/usr")]


def _find_onednn() -> tuple[Path, Path] | None:
    """(include dir, lib dir) of a oneDNN install with its C++ header and shared library."""
    for root in _onednn_roots():
        include = root / "include"
        if not (include / "oneapi" / "dnnl" / "dnnl.hpp").is_file():
            continue
        for lib in (root / "lib", root / "lib64", root / "lib" / f"{platform.machine()}-linux-gnu"):
            if (lib / "libdnnl.so").exists():
                return include, lib
    return None


def kernel_dir() -> Path:
    return Path(os.environ.get("JAX_SD_KERNEL_DIR") or Path.home() / ".cache" / "jax-sd" / "kernels")


def build() -> Path:
    """The compiled handlers' shared library, built now if this source, jaxlib and oneDNN have none yet.
    Raises RuntimeError saying what is missing."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        raise RuntimeError(
            f"oneDNN kernels are built for Linux x86-64 only, not {platform.system()} {platform.machine()}"
        )
    found = _find_onednn()
    if found is None:
        roots = ", ".join(str(r) for r in _onednn_roots())
        raise RuntimeError(f"no oneDNN under {roots} (Debian: apt-get install libdnnl-dev; or set DNNL_ROOT)")
    include, lib = found
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) to build the oneDNN kernels with")
    import jaxlib

    version_header = include / "oneapi" / "dnnl" / "dnnl_version.h"
    stamp = hashlib.sha256(
        b"".join(f.read_bytes() for f in SOURCES + HEADERS)
        + jaxlib.__version__.encode()
        + str(lib).encode()
        + version_header.read_bytes()
    ).hexdigest()[:16]
    target = kernel_dir() / f"onednn-{stamp}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        partial = Path(scratch) / target.name
        command = [
            compiler, "-O3", "-ffast-math", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-w",
            f"-I{jax.ffi.include_dir()}", f"-I{include}", *map(str, SOURCES), "-o", str(partial),
            f"-L{lib}", f"-Wl,-rpath,{lib}", "-ldnnl",
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"building the oneDNN kernels failed: {done.stderr.strip()[-2000:]}")
        os.replace(partial, target)  # atomic: another process building the same file meanwhile is harmless
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The handlers' library, built and loaded (once per process); None, said once in the log, where it cannot
    be or JAX_SD_ONEDNN=0. Registers nothing with XLA: safe to ask before JAX starts its backends."""
    if os.environ.get(SWITCH) == "0":
        return None
    if not native_bf16():
        log.info("oneDNN kernels off: %s", NO_NATIVE_BF16)
        return None
    try:
        return ctypes.cdll.LoadLibrary(str(build()))
    except (RuntimeError, OSError) as err:
        log.info("oneDNN kernels off: %s", err)
        return None


@functools.cache
def available() -> bool:
    """Whether the oneDNN handlers are loaded and registered with XLA's CPU backend."""
    handlers = library()
    if handlers is None:
        return False
    jax.ffi.register_ffi_target(MATMUL, jax.ffi.pycapsule(handlers.OnednnMatmul), platform="cpu")
    jax.ffi.register_ffi_target(CONV, jax.ffi.pycapsule(handlers.OnednnConv), platform="cpu")
    jax.ffi.register_ffi_target(UPSAMPLE_CONV, jax.ffi.pycapsule(handlers.OnednnUpsampleConv), platform="cpu")
    jax.ffi.register_ffi_target(ATTENTION, jax.ffi.pycapsule(handlers.OnednnAttention), platform="cpu")
    jax.ffi.register_ffi_target(GROUP_NORM, jax.ffi.pycapsule(handlers.OnednnGroupNorm), platform="cpu")
    jax.ffi.register_ffi_target(GEGLU, jax.ffi.pycapsule(handlers.OnednnGeglu), platform="cpu")
    log.info("oneDNN kernels on: bf16 matrix products, convolutions and attention on the CPU")
    return True


def cpu_dtype() -> str:
    """The dtype a network runs in on this host's CPU: bf16 where the CPU computes in bf16 natively and the
    oneDNN kernels are here (measured: SD-Turbo's 512x512 picture with TAESD 3.6 s in f32 -> 1.56 s on 2 Zen cores),
    else f32, where XLA's own f32 kernels are its fastest."""
    return "bfloat16" if native_bf16() and library() is not None else "float32"


def serves(kernel_dtype) -> bool:
    """Whether a layer with a kernel of this dtype calls oneDNN here: bf16, on the CPU backend, kernels built."""
    return kernel_dtype == jnp.bfloat16 and jax.default_backend() == "cpu" and available()


class Pinned:
    """The bf16 convolution kernels of a param tree, held alive while oneDNN keeps them reordered (`pin`)."""

    def __init__(self, arrays: list[jax.Array], buffers: list[int]):
        self.arrays, self.buffers = arrays, buffers

    def release(self) -> None:
        """Frees the reordered kernels; the arrays go back to their owner's keeping. Idempotent."""
        if self.buffers:
            n = len(self.buffers)
            library().OnednnUnpin((ctypes.c_void_p * n)(*self.buffers), ctypes.c_int64(n))
        self.arrays, self.buffers = [], []


def pin(params) -> Pinned:
    """Has oneDNN keep each bf16 kernel of `params` (a param tree on CPU devices; convolutions' HWIO and linear
    layers' [in, out]) in its own layout from its first call on, instead of reordering it at every call (measured on
    2 Zen 4 cores: SD-Turbo's UNet step 1.21 -> 1.10 s from the convolutions, a 77-token linear layer of the text
    encoder 0.78 -> 0.63 ms). The returned `Pinned` holds the arrays, so that no other array can take their buffers
    while oneDNN trusts them; `release()` it when the params are no longer served. The reordered copies cost as much
    memory as the kernels (SD-Turbo's UNet: 1.7 GB). A tree with no such kernel, or where oneDNN is off, pins
    nothing."""
    kernels = [
        leaf
        for leaf in jax.tree.leaves(params)
        if isinstance(leaf, jax.Array) and leaf.ndim in (2, 4) and leaf.dtype == jnp.bfloat16
    ]
    if not kernels or jax.default_backend() != "cpu" or not available():
        return Pinned([], [])
    shards = [shard.data for array in kernels for shard in array.addressable_shards if shard.device.platform == "cpu"]
    buffers = [shard.unsafe_buffer_pointer() for shard in shards]
    sizes = [shard.nbytes for shard in shards]
    n = len(buffers)
    library().OnednnPin((ctypes.c_void_p * n)(*buffers), (ctypes.c_int64 * n)(*sizes), ctypes.c_int64(n))
    return Pinned(kernels, buffers)


def reordered_bytes() -> int:
    """Bytes of reordered kernels oneDNN keeps for pinned params (0 where the kernels are off)."""
    handlers = library()
    if handlers is None:
        return 0
    handlers.OnednnPackedBytes.restype = ctypes.c_int64
    return int(handlers.OnednnPackedBytes())


def _bias(bias: jax.Array | None, features: int) -> jax.Array:
    return jnp.zeros((features,), jnp.float32) if bias is None else bias.astype(jnp.float32)


def _residual(add: jax.Array | None, shape: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """The optional operand a convolution adds to its output inside oneDNN (a post-op): none, or `add` in its own
    float dtype (bf16 or f32), shaped as the output."""
    if add is None:
        return ()
    if add.dtype not in (jnp.bfloat16, jnp.float32):
        add = add.astype(jnp.float32)
    return (add.reshape(shape),)


def matmul(x: jax.Array, kernel: jax.Array, bias: jax.Array | None, out_dtype) -> jax.Array:
    """x [..., K] @ kernel [K, N] + bias [N] -> [..., N] in out_dtype; x is cast to the kernel's dtype."""
    k, n = kernel.shape
    flat = x.reshape(-1, k).astype(kernel.dtype)
    call = jax.ffi.ffi_call(MATMUL, jax.ShapeDtypeStruct((flat.shape[0], n), out_dtype), vmap_method="sequential")
    return call(flat, kernel, _bias(bias, n)).reshape(*x.shape[:-1], n)


def attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(d)) v over [batch, tokens, heads, head_dim] in one call (`AttentionImpl`): per image,
    head and block of 256 queries, the logits from oneDNN, their softmax in f32 (AVX-512 exponentials), the
    weights in bf16 into oneDNN's second product. q, k and v are cast to bf16; the output is q's dtype."""
    call = jax.ffi.ffi_call(ATTENTION, jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential")
    return call(*(a.astype(jnp.bfloat16) for a in (q, k, v)), scale=np.float32(q.shape[-1] ** -0.5))


def conv(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    strides: tuple[int, int],
    padding: tuple[tuple[int, int], tuple[int, int]],
    out_dtype,
    add: jax.Array | None = None,
    relu: bool = False,
) -> jax.Array:
    """NHWC x, HWIO kernel, explicit ((top, bottom), (left, right)) padding -> NHWC in out_dtype; then `add` (of the
    output's shape) added and ReLU taken where asked, inside oneDNN's kernel, rounded to out_dtype once."""
    b, h, w, _ = x.shape
    kh, kw, _, out = kernel.shape
    (top, bottom), (left, right) = padding
    out_h = (h + top + bottom - kh) // strides[0] + 1
    out_w = (w + left + right - kw) // strides[1] + 1
    shape = (b, out_h, out_w, out)
    call = jax.ffi.ffi_call(CONV, jax.ShapeDtypeStruct(shape, out_dtype), vmap_method="sequential")
    return call(
        x.astype(kernel.dtype),
        kernel,
        _bias(bias, out),
        *_residual(add, shape),
        strides=np.asarray(strides, np.int64),
        padding=np.asarray((top, left, bottom, right), np.int64),
        relu=bool(relu),
    )


def upsample_conv(x: jax.Array, kernel: jax.Array, bias: jax.Array | None, out_dtype) -> jax.Array:
    """Nearest 2x upsampling of NHWC x, then a 3x3 HWIO kernel with padding 1 -> [b, 2h, 2w, out] in out_dtype, as
    four 2x2 convolutions over x, one per output phase (`UpsampleConvImpl`): 16/36 of the products, and the
    upsampled x is never written. The phase kernels are sums of the bf16 taps rounded once to bf16."""
    b, h, w, _ = x.shape
    out = kernel.shape[-1]
    call = jax.ffi.ffi_call(
        UPSAMPLE_CONV, jax.ShapeDtypeStruct((b, 2 * h, 2 * w, out), out_dtype), vmap_method="sequential"
    )
    return call(x.astype(kernel.dtype), kernel, _bias(bias, out))


def group_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, groups: int, eps: float, silu: bool) -> jax.Array:
    """GroupNorm over channels-last x [batch, ..., channels] (bf16 or f32) with its f32 statistics, and SiLU after it
    where `silu`, in one call (`GroupNormImpl`): the same numbers as `layers.GroupNorm`, in x's dtype."""
    b, c = x.shape[0], x.shape[-1]
    flat = x.reshape(b, -1, c)
    call = jax.ffi.ffi_call(GROUP_NORM, jax.ShapeDtypeStruct(flat.shape, x.dtype), vmap_method="sequential")
    out = call(flat, scale.astype(jnp.float32), bias.astype(jnp.float32), groups=np.int64(groups),
               eps=np.float32(eps), silu=bool(silu))  # fmt: skip
    return out.reshape(x.shape)


def geglu(y: jax.Array) -> jax.Array:
    """hidden * gelu(gate) (exact GELU) over y [..., 2N], its hidden half then its gate half -> [..., N] in y's dtype,
    in one pass (`GegluImpl`) where XLA spends 5x as long on the erf: [4096, 2560] bf16 5.1 ms in XLA."""
    n = y.shape[-1] // 2
    flat = y.reshape(-1, 2 * n)
    call = jax.ffi.ffi_call(GEGLU, jax.ShapeDtypeStruct((flat.shape[0], n), y.dtype), vmap_method="sequential")
    return call(flat).reshape(*y.shape[:-1], n)
