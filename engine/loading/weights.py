"""diffusers/transformers tensor names -> our parameter tree, by one table.

Our module attribute paths equal the checkpoint keys, so a parameter's name is its path
joined by dots with the Flax leaf name translated (`kernel`/`scale`/`embedding` -> `weight`).
Layouts differ by rank only: conv kernels OIHW -> HWIO, linear kernels [out, in] -> [in, out]; a kernel that comes
quantized already (an `Int8Kernel` in our layout, from a GGUF file's Q8_0) is kept as it is.
The expected tree is built with shape-only initializers, never from a random init. Missing,
unexpected and mis-shaped tensors are fatal and reported together.

Loading costs memory traffic, not arithmetic: each full copy of SD 1.5's 4.3 GB (f32) is seconds of
page faults. So the files are mapped, not read (the tensors are views of the page cache), and each
tensor is copied once, into our layout and dtype, by several threads at once, into memory aligned as
the CPU backend's `device_put` wants it to use the array in place instead of copying it again. A kernel that
`--quantize` takes is quantized as soon as it is copied (`convert(quantized=)`), so its float copy never outlives it.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from ..cpus import usable_cpus
from ..errors import WeightsError
from ..nn.layers import shapes_only
from .quantize import Int8Kernel

LEAF_NAMES = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}

# The exceptions, renamed before matching: names from older diffusers releases, and CLIP
# text encoders written without their `text_model.` prefix (as transformers 5 saves them).
LEGACY_RENAMES: tuple[tuple[str, str], ...] = (
    # CLIP text encoders saved by transformers 5, without `text_model.` (only CLIP's layer names: TAESD's
    # encoder has `encoder.layers.N` too).
    (r"^(embeddings\.|encoder\.layers\.\d+\.(?:self_attn|mlp|layer_norm[12])\.|final_layer_norm\.)", r"text_model.\1"),
    # The safety checker's vision tower as transformers 5 saves it, without `vision_model.`'s inner one.
    (r"^vision_model\.(embeddings|encoder|pre_layrnorm|post_layernorm)\.", r"vision_model.vision_model.\1."),
    (r"(attentions\.\d+)\.query\.", r"\1.to_q."),
    (r"(attentions\.\d+)\.key\.", r"\1.to_k."),
    (r"(attentions\.\d+)\.value\.", r"\1.to_v."),
    (r"(attentions\.\d+)\.proj_attn\.", r"\1.to_out.0."),
)
# Tensors that transformers ties to another (`_tied_weights_keys`), saved under either name or both: T5's
# `encoder.embed_tokens` is its `shared` embedding. The alias alone stands for the kept name; beside it, it
# must be equal (transformers 5 unties two that differ and reads the alias). A component's prefix may lead both.
TIED = ((re.compile(r"^((?:.+\.)?)encoder\.embed_tokens\.weight$"), r"\1shared.weight"),)
# Checkpoint entries that are buffers, not parameters (a batch norm's count of training batches among them).
IGNORED = re.compile(r"(^|\.)(position_ids|num_batches_tracked)$")
# safetensors' dtype names -> numpy's (bf16 through ml_dtypes: numpy has none).
SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
    # fp8 checkpoints (FLUX.1's and SD 3.5's "fp8" files): widened to the run dtype as they are copied
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}
ALIGNMENT = 64  # bytes: XLA's CPU backend takes a host array in place when it is aligned this far
STRIP = 64  # columns: a transposed view is copied in strips this wide (`aligned_copy`)
LOAD_THREADS = min(8, usable_cpus())  # the CPUs this process may use (its cgroup's quota, its affinity)


def checkpoint_name(path: tuple) -> str:
    *modules, leaf = (str(p) for p in path)
    # A bare parameter (CLIP's `class_embedding`, the safety checker's `concept_embeds`) keeps its own name.
    return ".".join([*modules, LEAF_NAMES.get(leaf, leaf)])


def to_our_layout(leaf: str, array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if leaf == "kernel":
        if len(shape) == 4:
            return array.transpose(2, 3, 1, 0)  # OIHW -> HWIO
        if array.ndim == 4 and array.shape[2:] == (1, 1):  # a 1x1 conv stored where we use a linear
            array = array[:, :, 0, 0]
        return array.T  # [out, in] -> [in, out]
    return array


def rename_legacy(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for name, value in tensors.items():
        for pattern, repl in LEGACY_RENAMES:
            name = re.sub(pattern, repl, name)
        out[name] = value
    for alias, kept in TIED:
        for name in [n for n in out if alias.match(n)]:
            value, kept_name = out.pop(name), alias.sub(kept, name)
            if kept_name in out and not np.array_equal(out[kept_name], value):
                raise WeightsError(f"{name} is tied to {kept_name}, but the checkpoint holds two different tensors")
            out.setdefault(kept_name, value)
    return out


def map_safetensors(file: Path) -> dict[str, np.ndarray]:
    """A safetensors file's tensors as read-only views of the file mapped into memory: nothing is read yet.

    The format (huggingface/safetensors' README): an 8-byte little-endian header length, a JSON header
    naming each tensor's dtype, shape and byte range, then the bytes. The safetensors package reads every
    tensor into memory of its own (a copy); a view costs nothing until a page is touched.
    """
    data = np.memmap(file, dtype=np.uint8, mode="r")
    fail = f"{file} is not a safetensors file"
    if data.size < 8:
        raise WeightsError(f"{fail}: {data.size} bytes")
    (length,) = struct.unpack("<Q", data[:8].tobytes())
    try:
        header = json.loads(data[8 : 8 + length].tobytes())
    except (ValueError, UnicodeDecodeError) as err:
        raise WeightsError(f"{fail}: its header does not parse ({err})") from err
    if not isinstance(header, dict):
        raise WeightsError(f"{fail}: its header is not a table of tensors")
    start, tensors = 8 + length, {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
            begin, end = (int(offset) for offset in entry["data_offsets"])
            shape = tuple(int(size) for size in entry["shape"])
        except (KeyError, TypeError, ValueError) as err:  # a missing field, or one of the wrong kind
            raise WeightsError(f"{fail}: tensor {name}'s entry {entry!r} lacks dtype, shape or data_offsets") from err
        if dtype is None:
            raise WeightsError(f"{file}: tensor {name} has dtype {entry['dtype']}, which this engine does not read")
        size = np.dtype(dtype).itemsize * int(np.prod(shape))
        if not 0 <= begin <= end or end - begin != size or start + end > data.size:
            raise WeightsError(f"{fail}: tensor {name}'s bytes {begin}..{end} do not hold {shape} of {entry['dtype']}")
        tensors[name] = data[start + begin : start + end].view(dtype).reshape(shape)
    return tensors


def read_safetensors(files: list[Path]) -> dict[str, np.ndarray]:
    """Every tensor of the files, mapped (`map_safetensors`): read-only views, read as they are used."""
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        tensors.update(map_safetensors(file))
    return tensors


def aligned_copy(array: np.ndarray, dtype) -> np.ndarray:
    """`array` cast to `dtype` in a new C-ordered, read-only array aligned to ALIGNMENT bytes.

    Read-only because the CPU backend's `device_put` may share its memory: a device array must never change.
    """
    dtype = np.dtype(dtype)
    raw = np.empty(array.size * dtype.itemsize + ALIGNMENT, np.uint8)
    skip = -raw.ctypes.data % ALIGNMENT
    out = raw[skip : skip + array.size * dtype.itemsize].view(dtype).reshape(array.shape)
    if array.ndim < 2 or array.strides[-1] == array.itemsize or array.size < STRIP * STRIP:
        np.copyto(out, array, casting="unsafe")
    else:
        # A transposed view (a kernel in our layout, read from the checkpoint's): copied whole, each element of
        # `out`'s rows comes from a row of its own in the source, a page apart, and every cache line and page of
        # the source is fetched again for each row. In strips of STRIP columns, the lines a strip reads are
        # used up while they are cached: on a Zen 3 core SD 2.1's UNet kernels took 3.1-3.9 s instead of 5-7 s.
        for start in range(0, array.shape[-1], STRIP):
            np.copyto(out[..., start : start + STRIP], array[..., start : start + STRIP], casting="unsafe")
    out.flags.writeable = False
    return out


def convert(
    make_model: Callable[[], nnx.Module],
    tensors: Mapping[str, np.ndarray],
    dtype=np.float32,
    where: str = "model",
    quantized: Callable[[tuple, Any], Callable[[np.ndarray], Any] | None] | None = None,
) -> tuple[nnx.GraphDef, nnx.State]:
    """Returns the model's graph and a state of host numpy arrays in `dtype`, ready for device_put.

    `quantized(path, shape-only value)`: how to quantize that kernel (`quantize.streaming`: to an `Int8Kernel` for
    `--quantize int8`, to an `int8.QuantizedKernel` for w8a8), or None to keep it; each is quantized as it is read,
    from its copy in `dtype`, which is dropped then: the same values as `quantize_params` gives the finished tree,
    without ever holding the model in `dtype` beside its int8 copy."""
    with shapes_only():
        graphdef, abstract = nnx.split(make_model())
    tensors = {k: v for k, v in rename_legacy(tensors).items() if not IGNORED.search(k)}
    found, kept, seen, missing, misshaped = [], [], set(), [], []
    dtype = np.dtype(ml_dtypes.bfloat16) if dtype in ("bfloat16", jax.numpy.bfloat16) else np.dtype(dtype)
    for path, var in nnx.to_flat_state(abstract):
        name = checkpoint_name(path)
        if name not in tensors:
            missing.append(name)
            continue
        seen.add(name)
        shape = tuple(var.get_value().shape)
        if isinstance(tensors[name], Int8Kernel):  # quantized already (a GGUF's Q8_0), in our layout: kept as it is
            if tuple(tensors[name].values.shape) != shape:
                misshaped.append(f"{name}: int8 {tuple(tensors[name].values.shape)}, model expects {shape}")
            else:
                kept.append((path, var.replace(tensors[name])))
            continue
        array = to_our_layout(str(path[-1]), np.asarray(tensors[name]), shape)  # a view: nothing copied yet
        if array.shape != shape:
            misshaped.append(f"{name}: checkpoint {tuple(tensors[name].shape)}, model expects {shape} (our layout)")
            continue
        found.append((path, var, array, quantized(path, var.get_value()) if quantized is not None else None))
    unexpected = sorted(set(tensors) - seen)
    if missing or unexpected or misshaped:
        lines = [f"{where}: the weights do not fit the model built from its config.json"]
        for title, names in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
            if names:
                lines.append(
                    f"  {title} ({len(names)}): " + "; ".join(names[:20]) + (" ..." if len(names) > 20 else "")
                )
        raise WeightsError("\n".join(lines))

    # One copy per tensor, by several threads (numpy copies without the GIL), the largest first so they end together.
    def copy(i: int) -> np.ndarray | Int8Kernel:
        _, _, array, quantize = found[i]
        if quantize is None:
            return aligned_copy(array, dtype)
        kernel = quantize(aligned_copy(array, dtype))  # the float copy is dropped here
        return jax.tree.map(lambda a: aligned_copy(a, a.dtype), kernel)  # its int8 values, scales (and sums)

    largest_first = sorted(range(len(found)), key=lambda i: -found[i][2].size)
    with ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="jax-sd-load") as pool:
        copies = dict(zip(largest_first, pool.map(copy, largest_first), strict=True))
    flat = [(path, var.replace(copies[i])) for i, (path, var, *_) in enumerate(found)] + kept
    return graphdef, nnx.from_flat_state(flat)


def load_model(
    make_model: Callable[[], nnx.Module], tensors: Mapping[str, np.ndarray], dtype=np.float32, where: str = "model"
) -> nnx.Module:
    graphdef, state = convert(make_model, tensors, dtype, where)
    return nnx.merge(graphdef, jax.tree.map(jax.numpy.asarray, state))


def export(model: nnx.Module, dtype=None) -> dict[str, np.ndarray]:
    """The inverse table: our parameters as a diffusers/transformers state dict (numpy)."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        array = np.asarray(var.get_value())
        if str(path[-1]) == "kernel":
            array = array.transpose(3, 2, 0, 1) if array.ndim == 4 else array.T
        out[checkpoint_name(path)] = np.ascontiguousarray(array.astype(dtype) if dtype else array)
    return out
