"""Weight-only int8 kernels (`--quantize int8`, made by engine/loading/quantize.py) and their widening inside a
program: `Int8Kernel` holds a linear kernel's int8 values and scales, `dequantize` widens a tree's, and `widened`
widens one layer's once the hidden state that enters it exists, for a network that runs its layers in a Python loop
(the Qwen3 text encoder's, and the DiT denoisers' blocks: Z-Image's, FLUX.1's, FLUX.2's, SD3's), whose kernels the
programs leave int8 (`dequantize(keep=)`). A network says which of its block lists it widens itself with a class
attribute, `WIDENED_BLOCKS` (the attribute names of those lists), and `widened_blocks` finds them in a module tree:
that is what the programs keep int8 for the denoisers. The UNets (SD 1.x/2.x/XL) declare none and are widened whole
once per step (`dequantize(after=)`): SDXL's, the largest, has 2.6B parameters to Z-Image's 6B and FLUX.1's 12B,
and their blocks are nested levels, not one list.

Why: nothing ties a kernel's widening to the layer that reads it, and XLA's CPU compiler ordered every layer's first:
widening the whole Qwen3 tree at the top of the prompt encoding held Qwen3-4B's 36 layers wide at once, 12.7 GB of
temporaries at 512 tokens (0.1 GB in plain f32); a denoising step of Z-Image's 6B transformer, widened whole, holds
24 GB of f32 kernels. `widened` makes each layer's widening read its input, so it waits for that layer's turn and is
dead once the layer has run: about one layer is wide at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Int8Kernel:
    """A linear kernel as int8 values and one scale per output channel: `values * scale` ~ the kernel. Or one scale
    per block of consecutive inputs of each output channel (a 2-D `scale`): a GGUF file's Q8_0 (blocks of 32), taken
    over exactly (`loading.gguf_file.Q8Tensor.kernel`)."""

    values: Any  # int8 [in, out]
    # [out], or [in / block, out]; in the kernel's own dtype (f32 on a CPU, bf16 on accelerators): what dequantize gives
    scale: Any

    def dequantize(self) -> jax.Array:
        if self.scale.ndim == 2:  # [blocks, block, out] * [blocks, 1, out]
            rows, out = self.values.shape
            blocks = self.values.reshape(self.scale.shape[0], -1, out).astype(self.scale.dtype)
            return (blocks * self.scale[:, None, :]).reshape(rows, out)
        return self.values.astype(self.scale.dtype) * self.scale  # [in, out] * [out]: per output channel


def is_int8(x: Any) -> bool:
    return isinstance(x, Int8Kernel)


def dequantize(params: Any, after: jax.Array | None = None, keep: tuple[str, ...] = ()) -> Any:
    """Every `Int8Kernel` of a param tree as a kernel in its scale's dtype (traceable); a tree without one as it is.

    `after`: an array that changes each turn of a loop (its carry), when this runs inside the loop's body. The int8
    values then pass an optimization barrier beside it, so XLA sees them as of this turn and widens them inside it,
    where each convert can join the matmul that reads it. Otherwise its loop-invariant code motion widens every
    kernel once before the loop and holds the whole denoiser at full width for the loop's length: more memory than
    not quantizing at all (the loop then carries f32/bf16 kernels; with the barrier it carries the int8 values).

    `keep`: sub-trees whose kernels stay int8, for networks that widen their own a layer at a time (`widened`):
    each a top-level key of the tree (a component of a `Models` tree: the Qwen3 text encoder's) or a path of keys
    (`widened_blocks`'s: ("transformer", "layers")).
    """
    if keep:  # a mapping (an `nnx.State`, a dict): the same type, its kept sub-trees as they are
        paths = [path if isinstance(path, tuple) else (path,) for path in keep]

        def part(key: Any, sub: Any) -> Any:
            inner = tuple(path[1:] for path in paths if path[0] == key)
            return sub if () in inner else dequantize(sub, after, inner)

        return type(params)({key: part(key, sub) for key, sub in params.items()})
    leaves, tree = jax.tree.flatten(params, is_leaf=is_int8)
    where = [i for i, leaf in enumerate(leaves) if is_int8(leaf)]
    if not where:
        return params
    if after is not None:
        values, _ = jax.lax.optimization_barrier(([leaves[i].values for i in where], after))
        for i, v in zip(where, values, strict=True):
            leaves[i] = Int8Kernel(v, leaves[i].scale)
    for i in where:
        leaves[i] = leaves[i].dequantize()
    return jax.tree.unflatten(tree, leaves)


def widened_blocks(module: nnx.Module) -> tuple[tuple, ...]:
    """The paths, in `module`'s param tree, of the block lists that the networks in it widen themselves one block at
    a time (each module's class's `WIDENED_BLOCKS`): what `dequantize(keep=)` leaves int8 for them. Read from the
    classes, at trace time; () for a tree of networks that declare none."""
    return tuple(
        (*path, name) for path, node in nnx.iter_graph(module) for name in getattr(type(node), "WIDENED_BLOCKS", ())
    )


def after_input(values: jax.Array, x: jax.Array) -> jax.Array:
    """int8 `values` exactly as they are, as a value XLA must compute from `x`: `max(values, floor)` with
    `floor = -128 | (sign bit of x's first entry << 7)`, -128 whatever that bit is, which XLA cannot tell."""
    sign = jnp.signbit(x.ravel()[0]).astype(jnp.int8)
    floor = jnp.int8(-128) | (sign << 7)
    return jnp.maximum(values, floor)


def widened(layer: nnx.Module, x: jax.Array) -> nnx.Module:
    """`layer` with its `Int8Kernel`s widened after `x`, the hidden state it is about to read; the same module when
    it holds none. For a network that loops over its layers in Python (inside a jitted program): each layer's
    kernels are wide only from its input on, so at most about one layer is wide at a time.

    Not an optimization barrier (`dequantize(after=)`, which keeps a loop's invariant code in the loop): XLA's CPU
    compiler removes barriers before it orders the program, and then widened every layer's kernels first (12 layers
    wide at once in tests/test_qwen3_int8_memory.py). A data edge stays: `after_input`, in the widening's fusion."""
    graphdef, state = nnx.split(layer)
    if not any(is_int8(leaf) for leaf in jax.tree.leaves(state, is_leaf=is_int8)):
        return layer
    tied = jax.tree.map(
        lambda k: Int8Kernel(after_input(k.values, x), k.scale) if is_int8(k) else k, state, is_leaf=is_int8
    )
    return nnx.merge(graphdef, dequantize(tied))
