"""oneDNN's bf16 matrix products, convolutions and attention on the CPU, as XLA custom calls.

XLA's CPU backend runs bf16 dots and convolutions no faster than f32 (Zen 4/5, 2 cores: a 4096x1280x1280
matmul 324 GFLOP/s in bf16 against 448 in f32); oneDNN runs them on the CPU's native bf16 instructions
(AVX512-BF16, AMX) at 942, and a 64x64 320->320 3x3 convolution at 1042 against XLA's 405 (f32). Where a
layer's kernel is bf16 on the CPU and oneDNN `serves` it, `layers.Linear` and `layers.Conv` call `matmul` and
`conv` here: the kernel stays bf16, the activations are cast to bf16 on the way in and come out in the dtype
the layer would give (f32 from an f32 input), with f32 accumulation and an f32 bias, as oneDNN computes.
bf16 attention on the CPU is `attention` here (nn/attention.py's "onednn" kind). Two elementwise calls of our own
stand where XLA's bf16 passes are slowest: `group_norm` (GroupNorm + SiLU, the ResNet blocks') and `geglu` (the
transformer blocks' exact-GELU gate). `upsample_conv` runs a nearest 2x upsampling and its 3x3 convolution as four
2x2 convolutions over the small input (`layers.Conv.upsampled`). A server `pin`s its params: their kernels are then
reordered into oneDNN's layout once, at their first call, instead of at every call.

The handlers (`onednn.cc`, `kept.cc`, `attention.cc`, `cpu_loops.cc`, `int8.cc`) are built by `kernel_build.py` (once per
source, jaxlib, oneDNN and compiler, into JAX_SD_KERNEL_DIR) and loaded here. ONEDNN_MAX_CPU_ISA caps the instructions oneDNN
uses, and what this module takes the CPU to have (`vector_isa`, `native_bf16`): capped to AVX2, an AVX-512 machine
runs as the AVX2 class does. They are built where a network would use them
(`wanted`): a CPU with native bf16, or JAX_SD_ONEDNN=1, which sends f32 layers' products to oneDNN's f32 kernels too
(on a Zen 3 with AVX2 they measured no faster than XLA's own, bench/kernels_f32.py, so not by default). Where the
CPU has no native bf16 (oneDNN 2.x refuses every bf16 primitive on AVX2), there is no compiler or no oneDNN, or
JAX_SD_ONEDNN=0, the layers keep XLA's own dots and convolutions (bf16 asked for on such a CPU runs in XLA, slowly
but right); the log says why once, at WARNING where the kernels would have served, with the command that fixes it.
`compute_path` says in one line what computes a network's products here.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from .. import cpus
from .kernel_build import FIX, build, find_onednn

log = logging.getLogger(__name__)

SWITCH = "JAX_SD_ONEDNN"  # "0": never use oneDNN, whatever the host has; "1": f32 layers through it too
MATMUL, CONV, ATTENTION = "jax_sd_onednn_matmul", "jax_sd_onednn_conv", "jax_sd_onednn_attention"
GROUP_NORM, GEGLU = "jax_sd_onednn_group_norm", "jax_sd_onednn_geglu"
UPSAMPLE_CONV = "jax_sd_onednn_upsample_conv"
INT8_CONV = "jax_sd_onednn_int8_conv"


NO_NATIVE_BF16 = (
    "this CPU computes no bf16 natively (no AVX512-BF16 or AMX-BF16), and oneDNN 2.x makes no bf16 kernels for it"
)


def cpu_flags() -> set[str]:
    """This host's CPU feature flags, from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


ISA_CAP = "ONEDNN_MAX_CPU_ISA"  # oneDNN's own cap on the instructions it dispatches to (DNNL_MAX_CPU_ISA before)
LEVELS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # the classes that matter here, narrowest first
_CAPS = {  # a oneDNN cap's value -> the widest of LEVELS it allows ("" below AVX2)
    "SSE41": "",
    "AVX": "",
    "AVX2": "avx2",
    "AVX2_VNNI": "avx2",
    "AVX2_VNNI_2": "avx2",
    "AVX512_CORE": "avx512f",
    "AVX512_CORE_VNNI": "avx512f",
    "AVX512_CORE_BF16": "avx512_bf16",
    "AVX512_CORE_FP16": "avx512_bf16",
}


def isa_cap() -> str | None:
    """The widest of LEVELS that ONEDNN_MAX_CPU_ISA (or its old name DNNL_MAX_CPU_ISA) lets oneDNN use: "" where it
    allows less than AVX2, None where it is unset, ALL, or a name not known here (AMX's: no cap among LEVELS)."""
    value = (os.environ.get(ISA_CAP) or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()
    return _CAPS.get(value)


def native_bf16() -> bool:
    """Whether this host's CPU computes in bf16 natively (AVX512-BF16 or AMX-BF16), from /proc/cpuinfo, as far as
    ONEDNN_MAX_CPU_ISA lets oneDNN use it (capped to AVX2, a Zen 4 measures the AVX2 class: f32 and int8)."""
    return vector_isa() in ("avx512_bf16", "amx_bf16")


def vector_isa() -> str:
    """The widest vector instructions this CPU has, as oneDNN's kernels would use them under ONEDNN_MAX_CPU_ISA:
    "amx_bf16", "avx512_bf16", "avx512f", "avx2", or "" (none of those, or not x86)."""
    flags, cap = cpu_flags(), isa_cap()
    allowed = LEVELS if cap is None else LEVELS[: LEVELS.index(cap) + 1] if cap else ()
    return next((isa for isa in reversed(allowed) if isa in flags), "")


def _cpu_runtime(lib: Path) -> None:
    """Points the OpenCL loader at the CPU runtime beside a oneDNN built on SYCL (Intel's `onednn` wheel, which
    brings it as `intel-opencl-rt`), where nothing else names one: its CPU engine is a SYCL CPU device, and without
    the runtime every primitive fails with "could not create an engine". A oneDNN on OpenMP has none: nothing set."""
    runtime = lib / "libintelocl.so"
    if runtime.exists():
        os.environ.setdefault("OCL_ICD_FILENAMES", str(runtime))


def wanted() -> bool:
    """Whether this host's networks would run through the kernels: a CPU with native bf16, or JAX_SD_ONEDNN=1
    (f32 layers too). Without native bf16, oneDNN's f32 kernels measured no faster than XLA's own at SD-Turbo's
    shapes on a Zen 3 (bench/kernels_f32.py), and building them costs a start 20 s: they are not built unasked."""
    return os.environ.get(SWITCH) == "1" or native_bf16()


@functools.cache
def handlers() -> ctypes.CDLL | None:
    """The handlers' library, built and loaded (once per process) whatever the CPU; None, said once in the log,
    where it cannot be or JAX_SD_ONEDNN=0. A host that wants it (`wanted`) and cannot have it gets a WARNING naming
    why and what fixes it. Sets OMP_NUM_THREADS (oneDNN's threads), where unset, to the CPUs this process may use
    (`cpus.usable_cpus`: the cgroup's quota, not the host's count). Registers nothing with XLA: safe to ask before
    JAX starts its backends."""
    if os.environ.get(SWITCH) == "0":
        log.info("oneDNN kernels off: %s=0", SWITCH)
        return None
    try:
        os.environ.setdefault("OMP_NUM_THREADS", str(cpus.usable_cpus()))
        library = build()
        _cpu_runtime(find_onednn()[1])
        return ctypes.cdll.LoadLibrary(str(library))
    except (RuntimeError, OSError) as err:
        if wanted() and platform.system() == "Linux" and platform.machine() == "x86_64":
            log.warning(
                "oneDNN kernels off, so XLA's own kernels run (on a CPU with native bf16, about 3x slower): %s. "
                "To fix: %s, then restart (or %s=0 to run without them)",
                err,
                getattr(err, "fix", FIX),
                SWITCH,
            )
        else:
            log.info("oneDNN kernels off: %s", err)
        return None


@functools.cache
def library() -> ctypes.CDLL | None:
    """`handlers()` where this host wants them (`wanted`); else None, said once in the log."""
    if os.environ.get(SWITCH) != "0" and not wanted():
        log.info(
            "oneDNN kernels off: %s; f32 runs in XLA's own kernels, as fast here (%s=1 runs f32 in oneDNN anyway)",
            NO_NATIVE_BF16,
            SWITCH,
        )
        return None
    return handlers()


@functools.cache
def registered() -> bool:
    """Whether the handlers are loaded and registered with XLA's CPU backend, whatever the CPU: what the custom
    calls below need (the layers ask `serves`)."""
    found = handlers()
    if found is None:
        return False
    jax.ffi.register_ffi_target(MATMUL, jax.ffi.pycapsule(found.OnednnMatmul), platform="cpu")
    jax.ffi.register_ffi_target(CONV, jax.ffi.pycapsule(found.OnednnConv), platform="cpu")
    jax.ffi.register_ffi_target(UPSAMPLE_CONV, jax.ffi.pycapsule(found.OnednnUpsampleConv), platform="cpu")
    jax.ffi.register_ffi_target(ATTENTION, jax.ffi.pycapsule(found.OnednnAttention), platform="cpu")
    jax.ffi.register_ffi_target(GROUP_NORM, jax.ffi.pycapsule(found.OnednnGroupNorm), platform="cpu")
    jax.ffi.register_ffi_target(GEGLU, jax.ffi.pycapsule(found.OnednnGeglu), platform="cpu")
    jax.ffi.register_ffi_target(INT8_CONV, jax.ffi.pycapsule(found.OnednnInt8Conv), platform="cpu")
    return True


def loaded() -> bool:
    """Whether the handlers are already loaded and registered in this process, because a network asked for them
    (bf16 layers, `--quantize w8a8`'s int8 products, JAX_SD_ONEDNN=1); never builds them."""
    return registered.cache_info().currsize > 0 and registered()


@functools.cache
def available() -> bool:
    """Whether this host wants the oneDNN handlers and has them loaded and registered with XLA's CPU backend."""
    if library() is None or not registered():
        return False
    kinds = "bf16" + (" and f32" if os.environ.get(SWITCH) == "1" else "")
    log.info("oneDNN kernels on: %s matrix products and convolutions on the CPU (%s)", kinds, vector_isa())
    return True


def kernels_for(dtype: str) -> bool:
    """Whether layers of this dtype run in oneDNN on this host's CPU: bf16 with native bf16, f32 with
    JAX_SD_ONEDNN=1; the kernels built. Safe to ask before JAX starts its backends."""
    if dtype == "bfloat16":
        return native_bf16() and handlers() is not None
    return dtype == "float32" and os.environ.get(SWITCH) == "1" and handlers() is not None


def cpu_dtype() -> str:
    """The dtype a network runs in on this host's CPU: bf16 where the CPU computes in bf16 natively and the
    oneDNN kernels are here (measured: SD-Turbo's 512x512 picture with TAESD 3.6 s in f32 -> 1.56 s on 2 Zen cores),
    else f32."""
    return "bfloat16" if native_bf16() and library() is not None else "float32"


def serves(kernel_dtype) -> bool:
    """Whether a layer with a kernel of this dtype calls oneDNN here: on the CPU backend, `kernels_for` its dtype
    (matrix products and convolutions; the bf16-only calls ask for bf16 themselves)."""
    if jax.default_backend() != "cpu":
        return False
    name = "bfloat16" if kernel_dtype == jnp.bfloat16 else "float32" if kernel_dtype == jnp.float32 else ""
    return kernels_for(name) and registered()


def serves_pointwise(kernel_dtype) -> bool:
    """Whether an f32 1x1 convolution calls oneDNN where `serves` leaves f32 layers to XLA: wherever the kernels are
    already loaded in this process (by a w8a8 denoiser's int8 products, whose ResNet shortcuts stay f32), the rule
    long f32 self-attention follows. oneDNN's 1x1 kernel ran SD-Turbo's 64x64 640->320 shortcut 2.0x XLA's (149 against 73
    GFLOP/s) on a Zen 3 core pair; its 3x3 ones only 1.0-1.3x, so those stay in XLA (bench/kernels_f32.py)."""
    return jax.default_backend() == "cpu" and kernel_dtype == jnp.float32 and loaded()


def compute_path(dtype: str, backend: str | None = None, int8: bool = False) -> str:
    """For people: the networks' dtype and what computes their products on this host, in one line, such as
    "bfloat16, oneDNN's bf16 kernels (avx512_bf16)", "float32, XLA (avx2)" or "bfloat16, XLA (avx2, no native bf16:
    slower than float32 here)". `backend`: JAX's default backend (asked of JAX when None). `int8`: the denoiser
    computes in int8 (`--quantize w8a8`), which the line names first: "float32, the denoiser's products in int8
    (w8a8) by oneDNN's int8 kernels (avx2)", or "... by XLA" where the kernels are not loaded."""
    backend = backend or jax.default_backend()
    if int8:
        by = (
            f"oneDNN's int8 kernels ({vector_isa() or platform.machine()})"
            if backend == "cpu" and registered()
            else "XLA"
        )
        return f"{dtype}, the denoiser's products in int8 (w8a8) by {by}"
    if backend != "cpu":
        return f"{dtype}, XLA on {backend}"
    isa = vector_isa() or platform.machine()
    if dtype == "bfloat16" and serves(jnp.bfloat16):
        return f"bfloat16, oneDNN's bf16 kernels ({isa})"
    if dtype == "float32" and serves(jnp.float32):
        return f"float32, oneDNN's f32 kernels ({isa})"
    if slow_half(dtype, backend):
        return f"{dtype}, XLA ({isa}, no native {dtype}: slower than float32 here)"
    return f"{dtype}, XLA ({isa})"


def slow_half(dtype: str, backend: str) -> bool:
    """Whether `dtype` is a half precision that this host's CPU computes slower than f32: one it has no
    instructions for (XLA widens every operation to f32 and back). Asked for by hand (`--dtype bfloat16`), it
    runs correctly, in XLA."""
    return backend == "cpu" and dtype in ("bfloat16", "float16") and not native_bf16()


class Pinned:
    """The bf16 convolution kernels of a param tree, held alive while oneDNN keeps them reordered (`pin`)."""

    def __init__(self, arrays: list[jax.Array], buffers: list[int]):
        self.arrays, self.buffers = arrays, buffers

    def release(self) -> None:
        """Frees the reordered kernels; the arrays go back to their owner's keeping. Idempotent."""
        if self.buffers:
            n = len(self.buffers)
            handlers().OnednnUnpin((ctypes.c_void_p * n)(*self.buffers), ctypes.c_int64(n))
        self.arrays, self.buffers = [], []


def pin(params, dtypes: tuple | None = None, int8_values: list | tuple = ()) -> Pinned:
    """Has oneDNN keep each kernel of `params` that it serves (or of `dtypes`) (a param tree on CPU devices; convolutions' HWIO and linear
    layers' [in, out]) in its own layout from its first call on, instead of reordering it at every call (measured on
    2 Zen 4 cores: SD-Turbo's UNet step 1.21 -> 1.10 s from the convolutions, a 77-token linear layer of the text
    encoder 0.78 -> 0.63 ms). The returned `Pinned` holds the arrays, so that no other array can take their buffers
    while oneDNN trusts them; `release()` it when the params are no longer served. The reordered copies cost as much
    memory as the kernels (SD-Turbo's UNet: 1.7 GB). `int8_values`, the int8 values of the tree's
    `int8.QuantizedKernel`s (`int8.kernel_values(params)`), are pinned too, wherever the handlers load (int8.py computes with them on any x86-64 CPU; SD-Turbo's 16x16 1280->1280
    convolution 136 -> 87 ms on 2 loaded Zen 3 cores). A tree with no such kernel, or where oneDNN is off, pins
    nothing."""
    values = [leaf for leaf in int8_values if isinstance(leaf, jax.Array)]
    served = [
        leaf
        for leaf in jax.tree.leaves(params)
        if isinstance(leaf, jax.Array)
        and leaf.ndim in (2, 4)
        and (leaf.dtype in dtypes if dtypes is not None else serves(leaf.dtype))
    ]
    if jax.default_backend() != "cpu":
        return Pinned([], [])
    kernels = (values if values and registered() else []) + (served if served and available() else [])
    if not kernels:
        return Pinned([], [])
    shards = [shard.data for array in kernels for shard in array.addressable_shards if shard.device.platform == "cpu"]
    buffers = [shard.unsafe_buffer_pointer() for shard in shards]
    sizes = [shard.nbytes for shard in shards]
    n = len(buffers)
    handlers().OnednnPin((ctypes.c_void_p * n)(*buffers), (ctypes.c_int64 * n)(*sizes), ctypes.c_int64(n))
    return Pinned(kernels, buffers)


def attention_on_amx() -> bool:
    """Whether bf16 attention (`attention`) computes its two products on AMX tiles here (attention_amx.cc): the CPU
    has AMX, ONEDNN_MAX_CPU_ISA lets oneDNN use it and Linux granted the tiles; elsewhere oneDNN's matmuls do."""
    found = handlers()
    if found is None:
        return False
    found.OnednnAttentionOnAmx.restype = ctypes.c_int64
    return bool(found.OnednnAttentionOnAmx())


def reordered_bytes() -> int:
    """Bytes of reordered kernels oneDNN keeps for pinned params (0 where the kernels are off)."""
    found = handlers()
    if found is None:
        return 0
    found.OnednnPackedBytes.restype = ctypes.c_int64
    return int(found.OnednnPackedBytes())


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


# The activations a matmul applies to its f32 sums as a post-op (onednn.cc's `Activation`), by layers.ACTIVATIONS' names.
ACTIVATION_CODES = {None: 0, "gelu": 1, "gelu_tanh": 2, "quick_gelu": 3, "silu": 4}


def matmul(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    out_dtype,
    activation: str | None = None,
    times: jax.Array | None = None,
) -> jax.Array:
    """activation(x [..., K] @ kernel [K, N] + bias [N]) * times -> [..., N] in out_dtype; x is cast to the kernel's
    dtype. `activation`: one of ACTIVATION_CODES' names, and `times` (of the output's shape, bf16 or f32) a factor,
    both applied to the f32 sums as post-ops before their rounding to out_dtype."""
    k, n = kernel.shape
    flat = x.reshape(-1, k).astype(kernel.dtype)
    call = jax.ffi.ffi_call(MATMUL, jax.ShapeDtypeStruct((flat.shape[0], n), out_dtype), vmap_method="sequential")
    code = np.int64(ACTIVATION_CODES[activation])
    operands = [flat, kernel, _bias(bias, n)]
    if times is not None:
        if times.shape != (*x.shape[:-1], n):
            raise ValueError(f"a matmul's multiplier has its output's shape {(*x.shape[:-1], n)}, not {times.shape}")
        factor_dtype = times.dtype if times.dtype in (jnp.bfloat16, jnp.float32) else jnp.float32
        operands.append(times.reshape(-1, n).astype(factor_dtype))
    return call(*operands, activation=code).reshape(*x.shape[:-1], n)


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, causal: bool = False, key_mask: jax.Array | None = None
) -> jax.Array:
    """softmax(q k^T / sqrt(d)) v over [batch, tokens, heads, head_dim] in one call (`AttentionImpl`): per image,
    head and block of 256 queries, the logits (oneDNN's; in f32 with AVX2 our own kernel), their softmax in f32
    (AVX-512 exponentials for bf16, AVX2 for f32), the weights in q's precision into oneDNN's second product. f32 q,
    k and v stay f32; any other dtype is cast to bf16. The output is q's dtype. `causal`: query i sees keys 0..i
    only (as many keys as queries). `key_mask` [batch, tokens_k] (bool, not with `causal`): True where a key may be
    attended, the others weigh nothing; an image whose mask allows none gets uniform weights over all its keys, as the
    plain formulation gives."""
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal attention takes as many keys as queries, not {k.shape[1]} for {q.shape[1]}")
    if key_mask is not None and (causal or key_mask.shape != (k.shape[0], k.shape[1])):
        raise ValueError(f"a key mask is [batch, tokens_k] {k.shape[:2]}, not {key_mask.shape}, and not with causal")
    given = jnp.float32 if q.dtype == jnp.float32 else jnp.bfloat16
    call = jax.ffi.ffi_call(ATTENTION, jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential")
    operands = [a.astype(given) for a in (q, k, v)] + ([key_mask.astype(bool)] if key_mask is not None else [])
    return call(*operands, scale=np.float32(q.shape[-1] ** -0.5), causal=causal)


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


def int8_conv(q: jax.Array, values: jax.Array, strides: tuple[int, int]) -> jax.Array:
    """The exact int32 sums of u8 NHWC q (padded already) times an s8 HWIO kernel with values in [-63, 63], no
    padding (`Int8ConvImpl`; int8.py quantizes and pads around it)."""
    b, h, w, _ = q.shape
    kh, kw, _, out = values.shape
    shape = (b, (h - kh) // strides[0] + 1, (w - kw) // strides[1] + 1, out)
    call = jax.ffi.ffi_call(INT8_CONV, jax.ShapeDtypeStruct(shape, jnp.int32), vmap_method="sequential")
    return call(q, values, strides=np.asarray(strides, np.int64))
