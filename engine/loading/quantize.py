"""8-bit weights for the big denoisers (`load_pipeline(quantize="int8")`, `--quantize int8`): FLUX.1's 12B-parameter
transformer takes 24 GB in bf16 and about 12 GB with int8 kernels. And for a decoder LM's text encoder (Qwen3, Z-Image's
and FLUX.2 [klein]'s: `int8_components`), on the devices or on the host (`quantize_module`): Qwen3-4B's 8 GB of bf16
weigh more than Z-Image's 6B transformer in int8, and its layers are linear kernels like the denoisers'.

Weight-only, symmetric, per output channel, round to nearest (the recipe of LLM.int8()'s weight half and of
optimum-quanto's qint8 weights): a linear kernel w [in, out] becomes `Int8Kernel(values, scale)` with
`scale[j] = max_i |w[i, j]| / 127` and `values = round(w / scale)`, so `values * scale` is within `scale / 2` of
every weight. Only large 2-D kernels are replaced; biases, norms, embeddings and convolutions stay as they were.
The loader quantizes each such kernel as it reads its tensor (`streaming`), so loading never holds the float model.

The quantized tree is data like any other param tree: it is put on the devices as int8 and handed to the jitted
programs, which call `dequantize` just before `nnx.merge`, so the widened kernel exists only inside the program,
where XLA can fuse the convert and the scale into the matmul that reads it. `Int8Kernel` and `dequantize` live in
engine/nn/int8_weights.py, beside `widened`, so that a network can widen its own: the Qwen3 text encoder's are left
int8 by the programs (`dequantize(keep=nn.int8_weights.widened_blocks(...))`) and widened one layer at a time, once that layer's
input exists, and so are a DiT denoiser's blocks' (the lists its class names in `WIDENED_BLOCKS`), one block at a
time inside each step (`dequantize(after=)`: each step widens its own, not the loop once before it). Widened all at
once, Qwen3-4B's 36 layers took 12.7 GB of XLA's temporaries at 512 tokens, and Z-Image's 6B transformer would hold
24 GB of f32 kernels in each step.

`--quantize w8a8` quantizes for compute instead: the denoiser's linear and convolution kernels its family's rule takes
(`Denoiser.w8a8`: a UNet's but its ends, the DiTs' blocks' attention and feed-forward) become
`nn.int8.QuantizedKernel`s (7-bit values per output channel), which the layers keep and multiply in int8 with
activations quantized per call (engine/nn/int8.py): on a CPU without native bf16, about twice f32's speed. The loader
quantizes them as it reads them too (`streaming`), and a Qwen3 text encoder beside them is weight-only int8.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..errors import ConfigError
from ..models.qwen3 import Qwen3Config
from ..nn import int8
from ..nn.int8_weights import Int8Kernel, dequantize  # noqa: F401 (dequantize: the programs import it from here)
from ..nn.int8_weights import is_int8 as _is_int8

MODES = ("int8", "w8a8")  # what `load_pipeline(quantize=...)` takes, besides None
# w8a8 leaves a network's first and last convolutions in float: they carry its input and output at full precision
# (the UNet's conv_in reads 4 latent channels, conv_out writes them) for a sliver of its products. And the ResNet
# blocks' 1x1 shortcuts, which read the raw hidden states (the up blocks': concatenated with a skip), not normalized as
# every 3x3 convolution's input is, so one scale per tensor fits them worst: in float the embedded model's w8a8
# pictures went from 34.1 to 36.4 dB PSNR against f32 (its down- and upsamplers in float as well: no better), for 2%
# of SD-Turbo's products.
KEEP_FLOAT = ("conv_in", "conv_out", "conv_shortcut")
# Kernels with fewer entries than this stay as they are: what they would save is nothing, and the smallest layers
# (a tiny model's, a head of a few outputs) lose the most to one scale per column.
MIN_SIZE = 1024
THREADS = 8  # numpy frees the GIL in its loops: a few kernels at once
# Text encoders whose kernels `--quantize int8` takes beside the denoiser's, by their config's class: decoder LMs of
# billions of weights (Qwen3-4B and -8B: 8 and 16 GB of bf16), all in linear layers. CLIP and T5 stay as loaded.
INT8_TEXT_ENCODERS = (Qwen3Config,)


def quantize_kernel(kernel: Any) -> Int8Kernel:
    """w [in, out] (numpy or jax, any float dtype) -> Int8Kernel with every |values * scale - w| <= scale / 2.

    The scale is stored in the kernel's dtype; where rounding it to that dtype made it smaller than max|w| / 127,
    it is rounded up instead, so that no weight falls outside [-127, 127] scales. A column of zeros gets scale 0.
    A `jax.ShapeDtypeStruct` gives the shapes alone: what a model would take, measured without its weights.
    """
    if isinstance(kernel, jax.ShapeDtypeStruct):
        return Int8Kernel(
            jax.ShapeDtypeStruct(kernel.shape, np.int8), jax.ShapeDtypeStruct(kernel.shape[1:], kernel.dtype)
        )
    w = np.asarray(kernel)
    dtype = w.dtype
    w = w.astype(np.float32)  # the one f32 copy: every step below works in it, in place (`streaming`'s peak)
    # [out]: max |w| per column, with no |w| array (+ 0.0: a column of -0.0 gives 0.0, as |w| would)
    scale = (np.maximum(w.max(axis=0), -w.min(axis=0)) + 0.0) / 127.0
    stored = scale.astype(dtype)
    # bf16 keeps 8 significant bits: x * (1 + 2^-7), rounded to nearest, is never below x
    stored = np.where(stored.astype(np.float32) < scale, (scale * (1 + 2.0**-7)).astype(dtype), stored)
    divisor = stored.astype(np.float32)
    np.divide(w, np.where(divisor == 0, 1.0, divisor), out=w)
    np.rint(w, out=w)
    return Int8Kernel(np.clip(w, -127, 127, out=w).astype(np.int8), stored)


def int8_components(denoiser: str, configs: Mapping[str, type], mode: str) -> tuple[str, ...]:
    """The components whose kernels `quantize=mode` keeps as weight-only `Int8Kernel`s, of a family whose denoiser is
    `denoiser` and whose components' config classes are `configs` (`Family.configs`): with "int8" the denoiser, and
    with either mode each decoder-LM text encoder (`INT8_TEXT_ENCODERS`), wherever it runs (the loader quantizes each
    kernel as it reads it, `streaming`, as `quantize_params` would the devices' tree and `quantize_module` the
    host's). "w8a8" computes the denoiser in int8 instead (its family's `Denoiser.w8a8` rule): a Qwen3-4B left in f32
    beside it would weigh 16 GB."""
    text = tuple(name for name, cls in configs.items() if issubclass(cls, INT8_TEXT_ENCODERS))
    return ((denoiser,) if mode == "int8" else ()) + text


def w8a8_quantizer(path: tuple) -> Callable[[Any], int8.QuantizedKernel]:
    """How w8a8 quantizes the kernel at `path`: a convolution that follows a nearest 2x upsampling (a UNet's
    `upsamplers.0.conv`, which `Conv.upsampled` runs) with its phase kernels beside it
    (`int8.quantize_upsampling_kernel`: 16/36 of its products), any other as it is (`int8.quantize_kernel`)."""
    upsampling = "upsamplers" in (str(part) for part in path)
    return int8.quantize_upsampling_kernel if upsampling else int8.quantize_kernel


def unet_w8a8(path: tuple) -> bool:
    """The UNet families' `Denoiser.w8a8` rule, by a kernel's path below the UNet: every linear and convolution
    kernel but KEEP_FLOAT's (the first and last convolutions, the 1x1 shortcuts)."""
    return not any(str(part) in KEEP_FLOAT for part in path)


def _quantizable(path: tuple, value: Any, components: set[str] | None, min_size: int) -> bool:
    return (
        (components is None or path[0] in components)
        and str(path[-1]) == "kernel"  # nnx.Linear's and nnx.Conv's weight; embeddings are `embedding`
        and not isinstance(value, Int8Kernel)
        and len(value.shape) == 2  # a linear layer's [in, out]; convolutions are 4-D
        and math.prod(value.shape) >= min_size
    )


def _computes_in_int8(path: tuple, value: Any, components: set[str], min_size: int, takes: Callable) -> bool:
    return (
        path[0] in components
        and str(path[-1]) == "kernel"
        and not isinstance(value, Int8Kernel | int8.QuantizedKernel)
        and len(value.shape) in (2, 4)  # linear layers' [in, out], convolutions' HWIO
        and math.prod(value.shape) >= min_size
        and takes(tuple(str(part) for part in path[1:]))
    )


def quantize_params(
    params: nnx.State,
    component: str | Sequence[str] = "transformer",
    min_size: int = MIN_SIZE,
    mode: str = "int8",
    takes: Callable[[tuple[str, ...]], bool] | None = None,
) -> nnx.State:
    """`params` with kernels of `component` (a `Models` attribute: the family's denoiser, or several) of at least
    `min_size` entries quantized; every other leaf is the same object as before. `mode` "int8": each linear kernel
    becomes an `Int8Kernel` (weight-only: widened inside the program, saves memory); "w8a8": each linear and
    convolution kernel that `takes` (a family's `Denoiser.w8a8` rule, by the kernel's path below the component; the
    UNet's, `unet_w8a8`, for a "unet") chooses becomes an `int8.QuantizedKernel`, which the layers compute with in int8
    (engine/nn/int8.py: activations quantized per call; oneDNN's int8 kernels), on a CPU only (an accelerator's bf16
    is its fast path)."""
    components = {component} if isinstance(component, str) else set(component)
    missing = components - set(params.keys())
    if missing:
        raise ConfigError(f"nothing to quantize: no component {sorted(missing)} in {sorted(params.keys())}")
    if mode not in MODES:
        raise ConfigError(f"quantize={mode!r} is not one of {', '.join(MODES)}")
    if mode == "w8a8":
        takes = w8a8_rule(takes, components)
        return _replace(
            params,
            lambda path, value: _computes_in_int8(path, value, components, min_size, takes),
            lambda path, value: w8a8_quantizer(path)(value),
        )
    return _replace(
        params,
        lambda path, value: _quantizable(path, value, components, min_size),
        lambda _, value: quantize_kernel(value),
    )


def w8a8_rule(takes: Callable[[tuple[str, ...]], bool] | None, components: set[str]) -> Callable:
    """The kernels w8a8 computes in int8 (`takes`; a UNet's by default), or a refusal that says what to start with:
    on a CPU only, and for a denoiser whose family gives a rule."""
    if jax.default_backend() != "cpu":  # an accelerator's bf16 is its fast path
        raise ConfigError(
            f"quantize='w8a8' computes in int8 on a CPU; on {jax.default_backend()} start without it (bf16 is the "
            "fast path there) or with quantize='int8'"
        )
    if takes is None and components != {"unet"}:  # the families that computed in int8 were measured and checked
        raise ConfigError(
            f"quantize='w8a8' computes the denoisers of SD 1.x/2.x/XL, Z-Image and FLUX.2 [klein] in int8; this "
            f"model's {', '.join(sorted(components))} takes quantize='int8' (int8 weights, float compute) or none"
        )
    return takes or unet_w8a8


def streaming(
    weight_only: Sequence[str] | None,
    w8a8: tuple[str, Callable[[tuple[str, ...]], bool]] | None = None,
    min_size: int = MIN_SIZE,
) -> Callable[[tuple, Any], Callable[[Any], Any] | None]:
    """How `loading.weights.convert(quantized=)` quantizes each kernel while it reads a checkpoint: (a param's path in
    the tree built, its shape-only value) -> `quantize_kernel` (an `Int8Kernel`) for the kernels of `weight_only` (a
    `Models` tree's components, `int8_components`; None: any path, one module's own tree, a host encoder's);
    `int8.quantize_kernel` (computed in int8) for those of the component `w8a8` names that its rule takes
    (`Denoiser.w8a8`); else None, kept as read. The same kernels and values as `quantize_params` gives the finished
    tree.

    Why while reading: quantizing after the load holds the whole model in the run dtype first and its int8 copy beside
    it (Z-Image-Turbo's 20.5 GB of bf16 and 10.7 of int8); this way each kernel's float copy lives only while it is
    quantized, and the load holds the int8 model plus the few kernels being quantized at once (`LOAD_THREADS`)."""
    chosen = None if weight_only is None else set(weight_only)
    if w8a8 is not None:
        computed, takes = w8a8
        takes = w8a8_rule(takes, {computed})

    def quantizer(path: tuple, value: Any) -> Callable[[Any], Any] | None:
        if w8a8 is not None and _computes_in_int8(path, value, {computed}, min_size, takes):
            return w8a8_quantizer(path)
        return quantize_kernel if _quantizable(path, value, chosen, min_size) else None

    return quantizer


def quantize_module(params: nnx.State, min_size: int = MIN_SIZE) -> nnx.State:
    """One module's own params (not a `Models` tree: `nnx.split(module)`'s) with every linear kernel of at least
    `min_size` entries an `Int8Kernel`, as `quantize_params` makes a component's: a text encoder kept on the host
    (`loading.host_encoder`), whose program widens them as the devices' do (`dequantize`)."""
    return _replace(
        params, lambda path, value: _quantizable(path, value, None, min_size), lambda _, value: quantize_kernel(value)
    )


def _replace(params: nnx.State, chooses: Any, quantize: Any) -> nnx.State:
    """`params` with each leaf that `chooses(path, value)` replaced by `quantize(path, value)`, a few at once."""
    flat = list(nnx.to_flat_state(params))
    chosen = [i for i, (path, var) in enumerate(flat) if chooses(path, var.get_value())]
    with ThreadPoolExecutor(THREADS, thread_name_prefix="jax-sd-quantize") as pool:
        done = dict(zip(chosen, pool.map(lambda i: quantize(flat[i][0], flat[i][1].get_value()), chosen), strict=True))
    return nnx.from_flat_state(
        [(path, var.replace(done[i]) if i in done else var) for i, (path, var) in enumerate(flat)]
    )


def quantize_tiny_decoder(params: nnx.State) -> nnx.State:
    """`params` with a TAESD decoder's inner convolutions as `int8.QuantizedKernel`s (`--quantize w8a8` beside the
    UNet's), its first (4 latent channels in) and last (3 colours out) in float as a UNet's conv_in and conv_out; the
    same tree where the VAE is not a TAESD (a KL decoder, whose int8 pictures nothing measured) or there is none.

    Why: TAESD's decode is most of a 512x512 picture's fixed part on a CPU without native bf16 (~140 GFLOP, nearly
    all of it 64-channel 3x3 convolutions at 256x256 and 512x512): on 2 loaded Zen 3 cores 5.7 s in XLA's f32, 3.8 s
    in int8, oneDNN's f32 6.7 s (bench/fixed_part.py). Only the decoder: the encoder (img2img's) keeps its precision.
    A TAESD is told by its layout, the decoder's layers in one list (`vae.decoder.layers.N`, models/autoencoder_tiny.py),
    where the convolutions directly in the list, but the ends, each follow a 2x upsampling (the blocks' are a level
    down, `layers.N.conv.M`): those are quantized with their phase kernels (`int8.quantize_upsampling_kernel`).
    """
    if "vae" not in params or "layers" not in params["vae"].get("decoder", {}):
        return params
    ends = {0, max(params["vae"]["decoder"]["layers"].keys())}  # the first layer and the last: convolutions

    def inner(path: tuple, value: Any) -> bool:
        return (
            path[:3] == ("vae", "decoder", "layers")
            and path[3] not in ends
            and str(path[-1]) == "kernel"
            and len(value.shape) == 4
        )

    def quantize(path: tuple, value: Any) -> int8.QuantizedKernel:
        upsampling = len(path) == 5  # vae, decoder, layers, N, kernel
        return (int8.quantize_upsampling_kernel if upsampling else int8.quantize_kernel)(value)

    return _replace(params, inner, quantize)


def is_quantized(params: Any) -> bool:
    return any(_is_int8(x) for x in jax.tree.leaves(params, is_leaf=_is_int8))


def _is_w8a8(x: Any) -> bool:
    return isinstance(x, int8.QuantizedKernel)


def computes_in_int8(params: Any) -> bool:
    """Whether a param tree holds kernels its layers compute with in int8 (`quantize_params(mode="w8a8")`)."""
    return any(_is_w8a8(x) for x in jax.tree.leaves(params, is_leaf=_is_w8a8))


def param_bytes(params: Any) -> int:
    """Bytes the tree's arrays take (int8 values and their scales included): numpy, jax or shape-only leaves."""
    return sum(math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(params))
