"""diffusers/transformers tensor names -> our parameter tree, by one table.

Our module attribute paths equal the checkpoint keys, so a parameter's name is its path
joined by dots with the Flax leaf name translated (`kernel`/`scale`/`embedding` -> `weight`).
Layouts differ by rank only: conv kernels OIHW -> HWIO, linear kernels [out, in] -> [in, out].
The expected tree is built with shape-only initializers, never from a random init. Missing,
unexpected and mis-shaped tensors are fatal and reported together.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import load_file

from .layers import shapes_only

LEAF_NAMES = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}

# The exceptions, renamed before matching: names from older diffusers releases, and CLIP
# text encoders written without their `text_model.` prefix (as transformers 5 saves them).
LEGACY_RENAMES: tuple[tuple[str, str], ...] = (
    (r"^(embeddings\.|encoder\.layers\.|final_layer_norm\.)", r"text_model.\1"),
    # The safety checker's vision tower as transformers 5 saves it, without `vision_model.`'s inner one.
    (r"^vision_model\.(embeddings|encoder|pre_layrnorm|post_layernorm)\.", r"vision_model.vision_model.\1."),
    (r"(attentions\.\d+)\.query\.", r"\1.to_q."),
    (r"(attentions\.\d+)\.key\.", r"\1.to_k."),
    (r"(attentions\.\d+)\.value\.", r"\1.to_v."),
    (r"(attentions\.\d+)\.proj_attn\.", r"\1.to_out.0."),
)
# Checkpoint entries that are buffers, not parameters.
IGNORED = re.compile(r"(^|\.)position_ids$")


class WeightsError(ValueError):
    """A checkpoint that does not fit the model built from its config."""


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
    return out


def read_safetensors(files: list[Path]) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def convert(
    make_model: Callable[[], nnx.Module], tensors: Mapping[str, np.ndarray], dtype=np.float32, where: str = "model"
) -> tuple[nnx.GraphDef, nnx.State]:
    """Returns the model's graph and a state of host numpy arrays in `dtype`, ready for device_put."""
    with shapes_only():
        graphdef, abstract = nnx.split(make_model())
    tensors = {k: v for k, v in rename_legacy(tensors).items() if not IGNORED.search(k)}
    flat, seen, missing, misshaped = [], set(), [], []
    dtype = np.dtype(ml_dtypes.bfloat16) if dtype in ("bfloat16", jax.numpy.bfloat16) else np.dtype(dtype)
    for path, var in nnx.to_flat_state(abstract):
        name = checkpoint_name(path)
        if name not in tensors:
            missing.append(name)
            continue
        seen.add(name)
        shape = tuple(var.get_value().shape)
        array = to_our_layout(str(path[-1]), np.asarray(tensors[name]), shape)
        if array.shape != shape:
            misshaped.append(f"{name}: checkpoint {tuple(tensors[name].shape)}, model expects {shape} (our layout)")
            continue
        flat.append((path, var.replace(array.astype(dtype))))
    unexpected = sorted(set(tensors) - seen)
    if missing or unexpected or misshaped:
        lines = [f"{where}: the weights do not fit the model built from its config.json"]
        for title, names in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
            if names:
                lines.append(
                    f"  {title} ({len(names)}): " + "; ".join(names[:20]) + (" ..." if len(names) > 20 else "")
                )
        raise WeightsError("\n".join(lines))
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
