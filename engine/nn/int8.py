"""int8 compute for convolutions and linear layers on the CPU: weights int8 per output channel, activations quantized
inside the program (per tensor, or per token for a linear layer), the products summed exactly in int32 by oneDNN's
int8 kernels (`int8.cc`).

Why: a CPU without native bf16 (AVX2: Zen 2/3, Intel Core) computes f32 products at a fraction of what its int8
instructions do (AVX2's vpmaddubsw: 32 u8 x s8 products a cycle into s16 pairs, twice f32's FMA rate, on a quarter
of the bytes). Measured on 2 shared Zen 3 cores (bench/kernels_int8.py, best of 3, quantization passes included,
kernels pinned as an Engine pins them), against XLA's f32: SD-Turbo's 3x3 convolutions at 64x64 2.4-2.6x, 32x32
2.6x, 16x16 1.7-2.5x, 8x8 3.0-3.3x; its linear layers 1.2x (64x64's GEGLU projection, bound by its 4096x2560
output) to 2.2x.
XLA's own int8 (`lax.conv_general_dilated`/`dot_general` on s8) ran 1.1x: it is the fallback only.

The arithmetic, for a kernel w [..., in, out] and activations x:
- weights (at load, `quantize_kernel`): `scale[o] = max |w[..., o]| / 63`, `values = round(w / scale)` in [-63, 63]
  (7 bits: AVX2's u8 x s8 pair sums then never saturate s16, so the int32 sums are exact on every CPU), and
  `sums[o]`, the sum of a channel's values, kept for the zero point below.
- activations (per call, `quantize_activations`): asymmetric u8 over the range of the whole tensor (a
  convolution's input) or of each token (a linear layer's), with 0 inside it,
  `x ~ (q - zero) * step`, q = clip(round(x / step) + zero, 0, 255); a convolution's padding is filled with `zero`,
  so that it stands for 0.0 as XLA's zero padding does.
- output: `(acc - zero * sums[o]) * step * scale[o] + bias[o]`, acc the exact int32 sum of q times values.
The rule, from those measurements: the int32 sum is oneDNN's (`onednn.int8_conv`; a linear layer as a 1x1
convolution over its tokens) wherever its kernels are registered, at every shape; else XLA's own, exactly equal
(`s8 x s8 -> s32` on q - 128, plus 128 * sums).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import onednn

WEIGHT_LEVELS = 63  # |values| <= 63: 2 * 255 * 63 < 2^15, no saturation in vpmaddubsw's s16 pair sums


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedKernel:
    """A linear ([in, out]) or convolution (HWIO) kernel for int8 compute: `values * scale` ~ the kernel, per output
    channel; `sums[o]`, the sum of channel o's values (what a zero point of the activations costs each output)."""

    values: Any  # int8, the kernel's shape, within [-63, 63]
    scale: Any  # f32 [out]
    sums: Any  # int32 [out]
    # an upsampling 3x3 convolution's four phase kernels (`quantize_upsampling_kernel`), (py, px) in row order
    phases: tuple[QuantizedKernel, ...] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    def dequantize(self) -> jax.Array:
        return self.values.astype(jnp.float32) * self.scale


def kernel_values(params: Any) -> list:
    """The int8 values of every `QuantizedKernel` in a param tree, its phase kernels' too: what
    `onednn.pin(int8_values=)` keeps reordered."""
    quantized = lambda leaf: isinstance(leaf, QuantizedKernel)  # noqa: E731
    kernels = [leaf for leaf in jax.tree.leaves(params, is_leaf=quantized) if quantized(leaf)]
    return [k.values for kernel in kernels for k in (kernel, *(kernel.phases or ()))]


def quantize_kernel(kernel: Any) -> QuantizedKernel:
    """w [..., in, out] (numpy or jax, any float dtype) -> QuantizedKernel with every |values * scale - w| <= scale/2
    (a channel of zeros: scale 0, values 0). A `jax.ShapeDtypeStruct` gives the shapes alone."""
    if isinstance(kernel, jax.ShapeDtypeStruct):
        out = kernel.shape[-1:]
        return QuantizedKernel(
            jax.ShapeDtypeStruct(kernel.shape, np.int8),
            jax.ShapeDtypeStruct(out, np.float32),
            jax.ShapeDtypeStruct(out, np.int32),
        )
    w = np.asarray(kernel, np.float32)
    flat = w.reshape(-1, w.shape[-1])
    # In place where it can be, without a widened copy for the sums: a load quantizes a whole UNet with this
    scale = (np.maximum(flat.max(axis=0), -flat.min(axis=0)) / WEIGHT_LEVELS).astype(np.float32)
    steps = flat / np.where(scale == 0, 1, scale)
    np.clip(np.rint(steps, out=steps), -WEIGHT_LEVELS, WEIGHT_LEVELS, out=steps)
    values = steps.astype(np.int8)
    return QuantizedKernel(values.reshape(w.shape), scale, values.sum(axis=0, dtype=np.int32))


def phase_kernels(kernel: np.ndarray) -> list[np.ndarray]:
    """A 3x3 HWIO kernel -> the four 2x2 kernels that its convolution (padding 1) over a nearest 2x upsampled x is
    over x itself, one per output phase (py, px) in row order. Output row 2i + py reads upsampled rows 2i + py - 1
    .. 2i + py + 1, which are x's rows i - 1, i, i (py 0: taps 1 and 2 fall on one row, summed) or i, i, i + 1
    (py 1: taps 0 and 1 summed); columns likewise."""
    rows = ((kernel[0], kernel[1] + kernel[2]), (kernel[0] + kernel[1], kernel[2]))
    out = []
    for top, bottom in rows:
        r = np.stack([top, bottom])  # [2, 3, in, out]
        for left, right in ((r[:, 0], r[:, 1] + r[:, 2]), (r[:, 0] + r[:, 1], r[:, 2])):
            out.append(np.stack([left, right], axis=1))
    return out


def quantize_upsampling_kernel(kernel: Any) -> QuantizedKernel:
    """`quantize_kernel` of a 3x3 convolution that follows a nearest 2x upsampling, with its four phase kernels
    (`phase_kernels` of the float kernel, each quantized per output channel as a kernel of its own), which
    `upsample_conv` computes with; the kernel itself stays for any other size (a UNet's upsampling to an odd skip)."""
    whole = quantize_kernel(kernel)
    if isinstance(kernel, jax.ShapeDtypeStruct):
        phase = jax.ShapeDtypeStruct((2, 2, *kernel.shape[2:]), kernel.dtype)
        return dataclasses.replace(whole, phases=tuple(quantize_kernel(phase) for _ in range(4)))
    phases = phase_kernels(np.asarray(kernel, np.float32))
    return dataclasses.replace(whole, phases=tuple(quantize_kernel(p) for p in phases))


def quantize_activations(x: jax.Array, per_token: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x (any float) -> (q u8, step f32, zero int32) with x ~ (q - zero) * step: 255 steps over [min(x, 0),
    max(x, 0)], so that 0.0 is exactly `zero`; over the whole tensor (step and zero scalars), or over each token's
    features (`per_token`: step and zero [..., 1]). Traceable; one reduction and one elementwise pass."""
    xf = x.astype(jnp.float32)
    axis, keep = (-1, True) if per_token else (None, False)
    lo = jnp.minimum(jnp.min(xf, axis=axis, keepdims=keep), 0.0)
    hi = jnp.maximum(jnp.max(xf, axis=axis, keepdims=keep), 0.0)
    step = jnp.where(hi > lo, (hi - lo) / 255.0, 1.0)
    zero = jnp.clip(jnp.round(-lo / step), 0, 255)
    q = jnp.clip(jnp.round(xf / step) + zero, 0, 255).astype(jnp.uint8)
    return q, step, zero.astype(jnp.int32)


def int_conv(q: jax.Array, values: jax.Array, sums: jax.Array, strides: tuple[int, int]) -> jax.Array:
    """The exact int32 sums of u8 q (NHWC, padded already) times int8 values (HWIO), unpadded: oneDNN's int8
    kernels where registered on the CPU, else XLA's s8 x s8 convolution on q - 128, plus 128 * sums."""
    if jax.default_backend() == "cpu" and onednn.registered():
        return onednn.int8_conv(q, values, strides)
    shifted = (q.astype(jnp.int16) - 128).astype(jnp.int8)
    acc = lax.conv_general_dilated(
        shifted, values, strides, "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"),
        preferred_element_type=jnp.int32,
    )  # fmt: skip
    return acc + 128 * sums


def _dequantize(acc, step, zero, kernel: QuantizedKernel, bias, out_dtype) -> jax.Array:
    y = (acc - zero * kernel.sums).astype(jnp.float32) * (step * kernel.scale)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype)


def conv(
    x: jax.Array,
    kernel: QuantizedKernel,
    bias: jax.Array | None,
    strides: tuple[int, int],
    padding: tuple[tuple[int, int], tuple[int, int]],
) -> jax.Array:
    """NHWC x, a quantized HWIO kernel, explicit ((top, bottom), (left, right)) padding -> NHWC in x's dtype."""
    q, step, zero = quantize_activations(x)
    q = lax.pad(q, zero.astype(jnp.uint8), ((0, 0, 0), *((lo, hi, 0) for lo, hi in padding), (0, 0, 0)))
    acc = int_conv(q, kernel.values, kernel.sums, strides)
    return _dequantize(acc, step, zero, kernel, bias, x.dtype)


def upsample_conv(x: jax.Array, kernel: QuantizedKernel, bias: jax.Array | None) -> jax.Array:
    """Nearest 2x upsampling of NHWC x [b, h, w, in], then a 3x3 convolution with padding 1 (a kernel with `phases`)
    -> [b, 2h, 2w, out] in x's dtype, as four 2x2 int8 convolutions over x itself, one per output phase: 16/36 of
    the products, and the upsampled x is never quantized or written. x's quantization is the upsampled x's (the same
    values). Measured on a Zen 3 core pair (AVX2, oneDNN): SD-Turbo's 32x32 640 -> 64x64 640 107 -> 42 ms, TAESD's
    256 -> 512 at 64 channels 159 -> 117 ms."""
    b, h, w, _ = x.shape
    q, step, zero = quantize_activations(x)
    q = lax.pad(q, zero.astype(jnp.uint8), ((0, 0, 0), (1, 1, 0), (1, 1, 0), (0, 0, 0)))
    phases = []
    for index, phase in enumerate(kernel.phases):
        py, px = divmod(index, 2)
        acc = int_conv(q[:, py : py + h + 1, px : px + w + 1], phase.values, phase.sums, (1, 1))
        phases.append(_dequantize(acc, step, zero, phase, bias, x.dtype))
    y = jnp.stack(phases, axis=3).reshape(b, h, w, 2, 2, -1)  # [b, h, w, py, px, out]
    return y.transpose(0, 1, 3, 2, 4, 5).reshape(b, 2 * h, 2 * w, -1)


def matmul(x: jax.Array, kernel: QuantizedKernel, bias: jax.Array | None) -> jax.Array:
    """x [..., in] @ a quantized [in, out] kernel + bias -> [..., out] in x's dtype, each token quantized over its
    own range (a token's features, such as a text encoder's, can differ in size by far more than 255 steps): a 1x1
    convolution over the tokens (oneDNN's int8 1x1 kernel, faster on AVX2 than its int8 matmul)."""
    k, n = kernel.shape
    q, step, zero = quantize_activations(x, per_token=True)
    acc = int_conv(q.reshape(1, -1, 1, k), kernel.values.reshape(1, 1, k, n), kernel.sums, (1, 1))
    return _dequantize(acc.reshape(*x.shape[:-1], n), step, zero, kernel, bias, x.dtype)
