"""Building blocks shared by the UNet and the VAE, NHWC inside.

Attribute names copy diffusers' module names (`resnets`, `attentions`, `to_q`, `to_out[0]`,
`ff.net[0].proj`) so that `weights.py` maps every parameter by its path alone.
Mirrors diffusers' `ResnetBlock2D`, `Attention`, `BasicTransformerBlock`, `Transformer2DModel`,
`Downsample2D`, `Upsample2D`, `Timesteps` and `TimestepEmbedding`.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import int8, onednn
from .attention import causal_attention, dot_product_attention, softmax_attention  # noqa: F401 - text encoders, tests
from .token_merging import bipartite_merge

_SHAPES_ONLY = contextvars.ContextVar("shapes_only", default=False)


@contextlib.contextmanager
def shapes_only():
    """Builds modules whose parameters are `jax.ShapeDtypeStruct`s: the expected tree, with no init.

    Cheaper than `nnx.eval_shape`, whose tracing cost grows with the square of the parameter
    count (over a minute for the SDXL UNet).
    """
    token = _SHAPES_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPES_ONLY.reset(token)


def _shape(key, shape, dtype=jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _inits(*names: str) -> dict:
    return dict.fromkeys(names, _shape) if _SHAPES_ONLY.get() else {}


# The activations a linear layer may apply to its output (`Linear.__call__`), as transformers names them.
ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "silu": jax.nn.silu,
}


class Linear(nnx.Linear):
    """`nnx.Linear`, whose parameters and numbers it keeps; a bf16 kernel on the CPU runs in oneDNN (onednn.py), a
    quantized one (`int8.QuantizedKernel`, `--quantize w8a8`) in int8 (int8.py)."""

    def __call__(self, x: jax.Array, activation: str | None = None, times: jax.Array | None = None) -> jax.Array:
        """x @ kernel + bias, then `activation` (an ACTIVATIONS name) and the product by `times` (an array of the
        output's shape: SwiGLU's up projection) where given: inside oneDNN's product on the bf16 CPU path (its f32
        sums, rounded once), after it elsewhere."""
        kernel = self.kernel.get_value()
        bias = self.bias[...] if self.bias is not None else None
        if isinstance(kernel, int8.QuantizedKernel):
            out = int8.matmul(x, kernel, bias)
        elif onednn.serves(kernel.dtype):
            return onednn.matmul(x, kernel, bias, jnp.result_type(x.dtype, kernel.dtype), activation, times)
        else:
            out = super().__call__(x)
        # in f32 and rounded once, as torch's kernels compute a bf16 or f16 activation
        out = ACTIVATIONS[activation](out.astype(jnp.float32)).astype(out.dtype) if activation else out
        return out * times if times is not None else out


def linear(in_features: int, out_features: int, rngs: nnx.Rngs, bias: bool = True) -> Linear:
    return Linear(in_features, out_features, use_bias=bias, rngs=rngs, **_inits("kernel_init", "bias_init"))


# CPU: a stride-1 convolution runs as one matrix product over its gathered taps (im2col) where it reads
# far more weights than pixels: over at most GATHERED_CONV_MAX_PIXELS output pixels (batch * h * w), or
# with at least GATHERED_CONV_MIN_KERNEL_BYTES_PER_PIXEL of kernel per output pixel. There XLA's
# convolution streams a kernel larger than the cache at a third of the matrix product's rate. Measured
# on 2 Zen 5 cores inside SD 1.5's UNet at 256x256, 3x3: [2, 16, 16] 1280 -> 1280 (115 KB a pixel)
# 122 -> 36 ms, 1920 -> 640 (86 KB) 54 -> 27 ms; at [2, 16, 16] 1280 -> 640 (58 KB) and [2, 32, 32]
# 1280 -> 1280 (29 KB) XLA's convolution is as fast or faster, and the gathered taps cost memory.
GATHERED_CONV_MAX_PIXELS = 256
GATHERED_CONV_MIN_KERNEL_BYTES_PER_PIXEL = 64 << 10


def gathered_conv(backend: str, pixels: int, kernel_bytes: int) -> bool:
    """Whether a stride-1 convolution over `pixels` output pixels runs as one matrix product over its taps."""
    if backend != "cpu":
        return False
    return pixels <= GATHERED_CONV_MAX_PIXELS or kernel_bytes >= GATHERED_CONV_MIN_KERNEL_BYTES_PER_PIXEL * pixels


class Conv(nnx.Conv):
    """`nnx.Conv`, whose parameters and numbers it keeps; on the CPU a bf16 kernel runs in oneDNN (onednn.py),
    an f32 one as `gathered_conv` chooses: XLA's convolution or one matrix product; a quantized one
    (`int8.QuantizedKernel`, `--quantize w8a8`; plain convolutions only) in int8 (int8.py)."""

    def __call__(self, x: jax.Array, add: jax.Array | None = None, relu: bool = False) -> jax.Array:
        """[batch, h, w, in] -> [batch, h, w, out]; then + `add` (a residual of the output's shape) and ReLU where
        asked: inside oneDNN's convolution on the bf16 CPU path, so that the output is written once (TAESD's
        blocks: its decode 0.186 -> 0.176 s at 512x512; the UNet's residual adds are faster in XLA's own fusions)."""
        out = self._conv(x, add, relu)
        if isinstance(out, tuple):  # XLA's convolution: what follows it, in XLA
            out = out[0] if add is None else out[0] + add
            out = jax.nn.relu(out) if relu else out
        return out

    def _plain(self) -> bool:
        """No dilation, no groups, explicit (low, high) padding per side: what oneDNN's convolution calls take."""
        return (
            self.kernel_dilation in (None, 1, (1, 1))
            and self.input_dilation in (None, 1, (1, 1))
            and self.feature_group_count == 1
            and isinstance(self.padding, tuple | list)
            and all(len(side) == 2 for side in self.padding)
        )

    def upsampled(self, x: jax.Array) -> jax.Array:
        """Nearest-neighbour 2x upsampling of x, then this convolution. A 3x3 one with padding 1 on the bf16 CPU path
        runs as four 2x2 convolutions over x itself (`onednn.upsample_conv`: 16/36 of the products, no upsampled x
        written; SD-Turbo's UNet step -35 ms), and so does an int8 one quantized with its phase kernels
        (`int8.upsample_conv`, `--quantize w8a8`); any other upsamples first."""
        kernel = self.kernel.get_value()
        plain = (
            self._plain()
            and self.kernel_size == (3, 3)
            and self.strides in (None, 1, (1, 1))
            and tuple(map(tuple, self.padding)) == ((1, 1), (1, 1))
        )
        bias = self.bias[...] if self.bias is not None else None
        if plain and isinstance(kernel, int8.QuantizedKernel) and kernel.phases is not None:
            return int8.upsample_conv(x, kernel, bias)  # its phase kernels, quantized at load
        bf16 = getattr(kernel, "dtype", None) == jnp.bfloat16
        if plain and bf16 and onednn.serves(kernel.dtype):  # phase kernels in bf16
            return onednn.upsample_conv(x, kernel, bias, jnp.result_type(x.dtype, kernel.dtype))
        return self(jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2))

    def _conv(self, x: jax.Array, add: jax.Array | None, relu: bool) -> jax.Array | tuple[jax.Array]:
        """oneDNN's convolution with its post-ops (an array), or XLA's alone (a 1-tuple)."""
        kh, kw = self.kernel_size
        b, h, w, c = x.shape
        strides = (1, 1) if self.strides is None else tuple(np.broadcast_to(self.strides, 2).tolist())
        if isinstance(self.kernel.get_value(), int8.QuantizedKernel):
            if not self._plain():
                raise ValueError("int8 convolutions take no dilation, groups or padding by name")
            bias = self.bias[...] if self.bias is not None else None
            return (int8.conv(x, self.kernel.get_value(), bias, strides, tuple(map(tuple, self.padding))),)
        kernel = self.kernel[...]
        pointwise = (kh, kw) == (1, 1) and onednn.serves_pointwise(kernel.dtype)
        if self._plain() and (onednn.serves(kernel.dtype) or pointwise):
            bias = self.bias[...] if self.bias is not None else None
            out_dtype = jnp.result_type(x.dtype, kernel.dtype)
            return onednn.conv(x, kernel, bias, strides, tuple(map(tuple, self.padding)), out_dtype, add, relu)
        gathered = (
            (kh, kw) != (1, 1)
            and self.strides in (None, 1, (1, 1))
            and not isinstance(self.padding, str)
            and gathered_conv(jax.default_backend(), b * h * w, kernel.size * kernel.dtype.itemsize)
        )
        if not gathered:
            return (super().__call__(x),)
        x = jnp.pad(x, ((0, 0), *self.padding, (0, 0)))
        h, w = x.shape[1] - kh + 1, x.shape[2] - kw + 1  # the output's size
        taps = [x[:, i : i + h, j : j + w] for i in range(kh) for j in range(kw)]
        cols = jnp.concatenate(taps, axis=-1)  # [batch, h, w, kh * kw * in], HWI order as the kernel
        out = jnp.einsum("bhwc,co->bhwo", cols, kernel.reshape(-1, kernel.shape[-1]))
        return (out + self.bias[...] if self.bias is not None else out,)


def conv(in_ch: int, out_ch: int, kernel: int, rngs: nnx.Rngs, stride: int = 1, padding=None) -> Conv:
    pad = kernel // 2 if padding is None else padding
    pad = ((pad, pad), (pad, pad)) if isinstance(pad, int) else pad
    inits = _inits("kernel_init", "bias_init")
    return Conv(in_ch, out_ch, (kernel, kernel), strides=(stride, stride), padding=pad, rngs=rngs, **inits)


class GroupNorm(nnx.GroupNorm):
    """`nnx.GroupNorm`'s parameters and numbers, computed as one scale and shift per (image, channel).

    Statistics in f32 from one pass over the pixels (per-channel sums of x and x^2, then summed per
    group; flax's fast variance, clipped at 0), then `x * a + b`: one elementwise pass that XLA fuses
    with the SiLU after it. On one CPU core, GroupNorm + SiLU: [2, 32, 32, 64] 0.78 -> 0.34 ms,
    [2, 16, 16, 640] 0.99 -> 0.68 ms, the VAE's [1, 256, 256, 128] 50 -> 35 ms against flax's, which
    reduces over a [batch, h, w, groups, channels/groups] view and broadcasts mean and variance back.
    """

    def __call__(self, x: jax.Array, silu: bool = False) -> jax.Array:  # [batch, ..., channels] -> the same
        """GroupNorm, then SiLU where `silu`. bf16 on the CPU is one oneDNN-side call, 4.5x XLA's passes
        (onednn.group_norm: [1, 64, 64, 320] 1.84 -> 0.41 ms on 2 Zen 4 cores)."""
        if x.dtype == jnp.bfloat16 and onednn.serves(x.dtype):  # f32: no faster than XLA's (bench/kernels_f32.py)
            return onednn.group_norm(x, self.scale[...], self.bias[...], self.num_groups, self.epsilon, silu)
        b, c = x.shape[0], x.shape[-1]
        per_group = c // self.num_groups
        xf = x.reshape(b, -1, c).astype(jnp.float32)  # [batch, pixels, channels]
        count = xf.shape[1] * per_group
        sums = jnp.stack([jnp.sum(xf, axis=1), jnp.sum(xf * xf, axis=1)])  # [2, batch, channels]
        sums = sums.reshape(2, b, self.num_groups, per_group).sum(-1) / count  # [2, batch, groups]
        mean, var = sums[0], jnp.maximum(sums[1] - sums[0] * sums[0], 0.0)
        inv = jnp.repeat(jax.lax.rsqrt(var + self.epsilon), per_group, axis=1)  # [batch, channels]
        scale = inv * self.scale[...].astype(jnp.float32)
        shift = self.bias[...].astype(jnp.float32) - jnp.repeat(mean, per_group, axis=1) * scale
        shape = (b,) + (1,) * (x.ndim - 2) + (c,)
        out = (x * scale.reshape(shape) + shift.reshape(shape)).astype(x.dtype)
        return jax.nn.silu(out) if silu else out


def group_norm(channels: int, groups: int, eps: float, rngs: nnx.Rngs) -> GroupNorm:
    return GroupNorm(channels, num_groups=groups, epsilon=eps, rngs=rngs, **_inits("scale_init", "bias_init"))


def layer_norm(channels: int, eps: float, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(channels, epsilon=eps, rngs=rngs, **_inits("scale_init", "bias_init"))


def embed(count: int, features: int, rngs: nnx.Rngs) -> nnx.Embed:
    return nnx.Embed(count, features, rngs=rngs, **_inits("embedding_init"))


class Identity(nnx.Module):
    """Stands where diffusers keeps a parameterless module (Dropout) so list indices line up."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return x


def attention(q: jax.Array, k: jax.Array, v: jax.Array, heads: int) -> jax.Array:
    """Scaled dot-product attention over [batch, tokens, heads * head_dim] inputs.

    The formulation is chosen per backend and shape (engine/nn/attention.py): cuDNN on GPU, Pallas flash
    attention on TPU for long sequences, query blocks on the CPU where the logits are large.
    """
    b, n, inner = q.shape
    head_dim = inner // heads
    q = q.reshape(b, n, heads, head_dim)  # [batch, tokens, heads, head_dim]
    k = k.reshape(b, k.shape[1], heads, head_dim)
    v = v.reshape(b, v.shape[1], heads, head_dim)
    return dot_product_attention(q, k, v).reshape(b, n, inner)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ProjectedContext:
    """The text's keys and values for every cross-attention of a network, projected once.

    `kv[i]` is the (keys, values) pair, each [batch, tokens, inner], of the attention whose `kv_index` is i
    (`UNet2DConditionModel.project_context`). A request's text is the same at every step, so a server
    projects it when the request is admitted instead of at every step; passed where the text's hidden
    states go, it gives what they give.
    """

    kv: tuple[tuple[jax.Array, jax.Array], ...]


Context = jax.Array | ProjectedContext  # what a cross-attention attends to


def as_context(encoder_hidden_states: Context, dtype) -> Context:
    """A network's text input in its dtype; a ProjectedContext as it is (it was projected in that dtype)."""
    if isinstance(encoder_hidden_states, ProjectedContext):
        return encoder_hidden_states
    return encoder_hidden_states.astype(dtype)


class Attention(nnx.Module):
    """diffusers `Attention`: self-attention when `cross_dim` is None, else cross-attention.

    A cross-attention that its network numbered (`kv_index`) also takes the context already projected.
    """

    def __init__(
        self,
        query_dim: int,
        heads: int,
        dim_head: int,
        rngs: nnx.Rngs,
        cross_dim: int | None = None,
        bias: bool = False,
    ):
        inner = heads * dim_head
        self.heads = heads
        self.to_q = linear(query_dim, inner, rngs, bias)
        self.to_k = linear(cross_dim or query_dim, inner, rngs, bias)
        self.to_v = linear(cross_dim or query_dim, inner, rngs, bias)
        self.to_out = nnx.List([linear(inner, query_dim, rngs)])
        self.kv_index: int | None = None  # its place in a ProjectedContext, set by the network that owns it

    def project(self, context: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The context's keys and values, [batch, tokens, inner] each."""
        return self.to_k(context), self.to_v(context)

    def __call__(self, x: jax.Array, context: Context | None = None) -> jax.Array:
        if isinstance(context, ProjectedContext):
            if self.kv_index is None:
                raise TypeError("this attention takes the context's hidden states, not a ProjectedContext")
            k, v = context.kv[self.kv_index]
        else:
            k, v = self.project(x if context is None else context)
        return self.to_out[0](attention(self.to_q(x), k, v, self.heads))


class GEGLU(nnx.Module):
    def __init__(self, dim: int, inner: int, rngs: nnx.Rngs):
        self.proj = linear(dim, inner * 2, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.proj(x)
        if y.dtype == jnp.bfloat16 and onednn.serves(y.dtype):
            return onednn.geglu(y)  # bf16 on the CPU: one pass, 2.6x XLA's erf
        hidden, gate = jnp.split(y, 2, axis=-1)
        return hidden * jax.nn.gelu(gate, approximate=False)


class FeedForward(nnx.Module):
    def __init__(self, dim: int, rngs: nnx.Rngs, mult: int = 4):
        # net[1] is Dropout in diffusers.
        self.net = nnx.List([GEGLU(dim, dim * mult, rngs), Identity(), linear(dim * mult, dim, rngs)])

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.net[2](self.net[0](x))


class BasicTransformerBlock(nnx.Module):
    """Self-attention, cross-attention to the text, GEGLU feed-forward; pre-LayerNorm each."""

    def __init__(self, dim: int, heads: int, dim_head: int, cross_dim: int, rngs: nnx.Rngs):
        self.norm1 = layer_norm(dim, 1e-5, rngs)
        self.attn1 = Attention(dim, heads, dim_head, rngs)
        self.norm2 = layer_norm(dim, 1e-5, rngs)
        self.attn2 = Attention(dim, heads, dim_head, rngs, cross_dim=cross_dim)
        self.norm3 = layer_norm(dim, 1e-5, rngs)
        self.ff = FeedForward(dim, rngs)
        # Token merging (nn/token_merging.py): the share of the image's tokens merged before the self-attention;
        # set on a traced copy of the network for one program (`UNet2DConditionModel.merge_tokens`), 0 in the params.
        self.merge_ratio = 0.0

    def __call__(self, x: jax.Array, context: Context, size: tuple[int, int] | None = None) -> jax.Array:
        """x [batch, tokens, dim]; `size`: the image's (h, w) in tokens, which token merging needs."""
        normed = self.norm1(x)
        if self.merge_ratio and size is not None:
            merge, unmerge = bipartite_merge(x, *size, int(x.shape[1] * self.merge_ratio))
            x = x + unmerge(self.attn1(merge(normed)))
        else:
            x = x + self.attn1(normed)
        x = x + self.attn2(self.norm2(x), context)
        return x + self.ff(self.norm3(x))


class Transformer2DModel(nnx.Module):
    """Spatial transformer: GroupNorm, project in (1x1 conv or linear), blocks, project out, residual."""

    def __init__(
        self,
        channels: int,
        heads: int,
        cross_dim: int,
        depth: int,
        use_linear_projection: bool,
        groups: int,
        rngs: nnx.Rngs,
    ):
        self.use_linear_projection = use_linear_projection
        self.norm = group_norm(channels, groups, 1e-6, rngs)
        make_proj = (
            (lambda: linear(channels, channels, rngs))
            if use_linear_projection
            else (lambda: conv(channels, channels, 1, rngs))
        )
        self.proj_in = make_proj()
        self.transformer_blocks = nnx.List(
            [BasicTransformerBlock(channels, heads, channels // heads, cross_dim, rngs) for _ in range(depth)]
        )
        self.proj_out = make_proj()

    def __call__(self, x: jax.Array, context: Context) -> jax.Array:
        b, h, w, c = x.shape
        residual = x
        x = self.norm(x)
        if self.use_linear_projection:
            x = self.proj_in(x.reshape(b, h * w, c))  # [batch, tokens, channels]
        else:
            x = self.proj_in(x).reshape(b, h * w, c)  # [batch, tokens, channels]
        for block in self.transformer_blocks:
            x = block(x, context, (h, w))
        if self.use_linear_projection:
            x = self.proj_out(x).reshape(b, h, w, c)
        else:
            x = self.proj_out(x.reshape(b, h, w, c))
        return x + residual


class ResnetBlock2D(nnx.Module):
    """GroupNorm-SiLU-conv twice, with the time embedding added between; 1x1 shortcut on a width change."""

    def __init__(
        self,
        in_ch: int,
        out_ch: int,
        temb_ch: int | None,
        groups: int,
        eps: float,
        rngs: nnx.Rngs,
        output_scale_factor: float = 1.0,
    ):
        self.norm1 = group_norm(in_ch, groups, eps, rngs)
        self.conv1 = conv(in_ch, out_ch, 3, rngs)
        self.time_emb_proj = linear(temb_ch, out_ch, rngs) if temb_ch else None
        self.norm2 = group_norm(out_ch, groups, eps, rngs)
        self.conv2 = conv(out_ch, out_ch, 3, rngs)
        self.conv_shortcut = conv(in_ch, out_ch, 1, rngs) if in_ch != out_ch else None
        self.output_scale_factor = output_scale_factor

    def __call__(self, x: jax.Array, temb: jax.Array | None = None) -> jax.Array:
        h = self.conv1(self.norm1(x, silu=True))
        if self.time_emb_proj is not None:
            h = h + self.time_emb_proj(jax.nn.silu(temb))[:, None, None, :]
        h = self.conv2(self.norm2(h, silu=True))
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x)
        return (x + h) / self.output_scale_factor


class Downsample2D(nnx.Module):
    def __init__(self, channels: int, padding: int, rngs: nnx.Rngs):
        # padding 0 is the VAE encoder's: diffusers pads right and bottom by one before the conv.
        self.padding = padding
        self.conv = conv(channels, channels, 3, rngs, stride=2, padding=padding if padding else ((0, 1), (0, 1)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.conv(x)


class Upsample2D(nnx.Module):
    def __init__(self, channels: int, rngs: nnx.Rngs):
        self.conv = conv(channels, channels, 3, rngs)

    def __call__(self, x: jax.Array, size: tuple[int, int] | None = None) -> jax.Array:
        """Nearest-neighbour 2x, or to `size` (the UNet's skip size when a side is not a multiple of 2**depth)."""
        h, w = x.shape[1:3]
        out_h, out_w = size or (2 * h, 2 * w)
        if (out_h, out_w) == (2 * h, 2 * w):
            return self.conv.upsampled(x)
        # torch's "nearest": source index floor(i * in / out)
        x = x[:, (jnp.arange(out_h) * h) // out_h][:, :, (jnp.arange(out_w) * w) // out_w]
        return self.conv(x)


def timestep_embedding(
    t: jax.Array, dim: int, flip_sin_to_cos: bool, freq_shift: float, max_period: float = 10000.0
) -> jax.Array:
    """Sinusoidal embedding of (possibly fractional) timesteps: [batch] -> [batch, dim], in f32."""
    half = dim // 2
    exponent = -math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / (half - freq_shift)
    args = t.astype(jnp.float32)[:, None] * jnp.exp(exponent)[None, :]
    sin, cos = jnp.sin(args), jnp.cos(args)
    emb = jnp.concatenate([cos, sin] if flip_sin_to_cos else [sin, cos], axis=-1)
    if dim % 2:
        emb = jnp.pad(emb, ((0, 0), (0, 1)))
    return emb


def guidance_scale_embedding(w: jax.Array, dim: int) -> jax.Array:
    """diffusers' `get_guidance_scale_embedding` (VDM's): w [batch] -> [batch, dim] f32, the sines then the
    cosines of 1000 w at frequencies 10000^(-k / (dim/2 - 1)), zero-padded to an odd dim. What a guidance-distilled
    UNet (LCM) reads beside the timestep, with w = guidance_scale - 1."""
    half = dim // 2
    freqs = jnp.exp(jnp.arange(half, dtype=jnp.float32) * -(jnp.log(jnp.float32(10000.0)) / (half - 1)))
    args = (w.astype(jnp.float32) * 1000.0)[:, None] * freqs[None, :]
    emb = jnp.concatenate([jnp.sin(args), jnp.cos(args)], axis=-1)
    if dim % 2:
        emb = jnp.pad(emb, ((0, 0), (0, 1)))
    return emb


class TimestepEmbedding(nnx.Module):
    """`linear_2(silu(linear_1(x)))`; with `cond_dim`, a condition (`timestep_cond`) projected without bias is
    added to x first, as diffusers' `TimestepEmbedding(cond_proj_dim=)` does."""

    def __init__(self, in_ch: int, dim: int, rngs: nnx.Rngs, cond_dim: int | None = None, bias: bool = True):
        self.linear_1 = linear(in_ch, dim, rngs, bias=bias)  # `sample_proj_bias` (False for FLUX.2)
        self.linear_2 = linear(dim, dim, rngs, bias=bias)
        self.cond_proj = linear(cond_dim, in_ch, rngs, bias=False) if cond_dim else None

    def __call__(self, x: jax.Array, condition: jax.Array | None = None) -> jax.Array:
        if condition is not None:
            x = x + self.cond_proj(condition)
        return self.linear_2(jax.nn.silu(self.linear_1(x)))
