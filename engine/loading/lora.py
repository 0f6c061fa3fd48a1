"""LoRA: low-rank updates of the UNet's and the text encoders' kernels (a transformer's alone: Z-Image, FLUX.2), read
from safetensors files.

A LoRA (Hu et al. 2021) adapts a layer W by `delta = (alpha / rank) * down @ up`; several at once, each with
a user's weight s_i, give `W + sum_i s_i * delta_i` (diffusers: `load_lora_weights` + `set_adapters`, whose
PEFT layers add `s_i * alpha_i / rank_i * B_i(A_i(x))` unmerged; merged here, the same product).
`load_lora` reads one file, `lora_factors` matches it against a model's param tree (every tensor must land
on a layer of the right shape, or the whole file is refused with the names that do not fit), and
`apply_loras` merges inside a jitted program with the weights as a traced array, so a new weight never
recompiles. Names in every layout people publish are matched in `lora_keys`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from .lora_keys import COMPONENTS, Target, parse, spellings, unsupported

# diffusers keeps each component's PEFT `LoraConfig` in the file's header, as "unet.lora_alpha" and so on.
METADATA_KEY = "lora_adapter_metadata"
PEFT_DEFAULT_ALPHA = 8  # `LoraConfig.lora_alpha` when a header names no alpha
PROBLEMS = {  # why a tensor is refused -> how the error says it
    "unknown": "for no layer of this model",
    "mis-shaped": "mis-shaped",
    "incomplete": "without their pair",
    "twice": "the same layer twice",
    "unsupported": "a LoRA variant we do not run (LoHa, LoKr, LoCon's mid factor, DoRA, biases)",
}


class LoRAError(ValueError):
    """A LoRA file that cannot be read, or that does not fit the model."""


class LowRank(NamedTuple):
    """One layer's update, laid out for our kernel: `delta = scale * down @ up` has the kernel's shape."""

    down: np.ndarray  # [..., in, rank]: the kernel's layout with its output axis replaced by the rank
    up: np.ndarray  # [rank, out]
    scale: np.ndarray  # [] f32: alpha / rank (alpha / sqrt(rank) for rank-stabilised LoRA)


# A model's LoRA: the kernel paths of our param tree ("unet", "down_blocks", 0, ..., "to_q", "kernel") -> update.
LoRAFactors = dict[tuple, LowRank]


@dataclass(frozen=True)
class LoRAFile:
    name: str  # what the user asked for: a path or a Hub id
    tensors: Mapping[str, np.ndarray]
    metadata: Mapping[str, Any] = field(default_factory=dict)  # the PEFT configs of diffusers' header, if any


def _hub_file(source: str) -> Path:
    """`owner/name` (its one LoRA file, or diffusers' pytorch_lora_weights.safetensors) or `owner/name/file`."""
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    owner, name, *rest = source.split("/")
    repo_id, filename = f"{owner}/{name}", "/".join(rest)
    try:
        if not filename:
            files = [f for f in huggingface_hub.list_repo_files(repo_id) if f.endswith(".safetensors")]
            if "pytorch_lora_weights.safetensors" in files or not files:
                filename = "pytorch_lora_weights.safetensors"
            elif len(files) == 1:
                filename = files[0]
            else:
                raise LoRAError(f"{source}: several LoRA files, name one as {repo_id}/FILE: {', '.join(files)}")
        return Path(huggingface_hub.hf_hub_download(repo_id, filename))
    except (OfflineModeIsEnabled, OSError, HfHubHTTPError) as err:
        raise LoRAError(
            f"cannot fetch the LoRA {source!r} from the Hugging Face Hub and it is not in the local cache "
            f"({type(err).__name__}: {err})"
        ) from err


def load_lora(source: str | Path) -> LoRAFile:
    """One LoRA .safetensors file: a path, a folder holding one, `owner/name` or `owner/name/file.safetensors`."""
    path = Path(source).expanduser()
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if len(files) != 1:
            raise LoRAError(f"{source}: the folder holds {len(files)} .safetensors files, not one LoRA file")
        path = files[0]
    elif not path.is_file():
        if not (isinstance(source, str) and re.fullmatch(r"[\w.-]+/[\w.-]+(/[\w./-]+\.safetensors)?", source)):
            raise LoRAError(f"LoRA {str(source)!r} is neither a .safetensors file nor a Hub id like 'owner/name'")
        path = _hub_file(source)
    try:
        with safe_open(str(path), "np") as file:
            tensors = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118 (not a dict)
            header = file.metadata() or {}
    except Exception as err:  # safetensors raises its own error types for a file that is not one
        raise LoRAError(f"{source}: not a readable .safetensors file ({err})") from err
    metadata = json.loads(header[METADATA_KEY]) if header.get(METADATA_KEY) else {}
    return LoRAFile(name=str(source), tensors=tensors, metadata=metadata)


def _kernels(params: nnx.State) -> dict[str, tuple]:
    """Layer name ("unet.down_blocks.0...to_q") -> its kernel's path, for the components a LoRA may touch: a
    transformer model's LoRAs adapt its transformer alone (diffusers loads none into Z-Image's or FLUX.2's Qwen3)."""
    components = ("transformer",) if "transformer" in params else COMPONENTS
    out = {}
    for path, _ in nnx.to_flat_state(params):
        if path[-1] == "kernel" and path[0] in components:
            out[".".join(str(p) for p in path[:-1])] = path
    return out


def _peft_alpha(metadata: Mapping[str, Any], component: str, module: str | None, rank: int) -> float | None:
    """alpha / rank from a component's PEFT config (its `alpha_pattern` first); None without a config."""
    config = {k.removeprefix(f"{component}."): v for k, v in metadata.items() if k.startswith(f"{component}.")}
    if not config:
        return None
    alpha = config.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if module is not None and re.match(rf"(.*\.)?({pattern})$", module):  # PEFT's own matching rule
            alpha = value
            break
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def _our_layout(down: np.ndarray, up: np.ndarray, kernel: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray] | None:
    """torch factors (down [rank, in(, kh, kw)], up [out, rank(, 1, 1)]) -> ours, or None when they do not fit."""
    rank = down.shape[0]
    down = down.transpose(2, 3, 1, 0) if down.ndim == 4 else down.T  # [kh, kw, in, rank] or [in, rank]
    if up.ndim == 4 and up.shape[2:] == (1, 1):
        up = up[:, :, 0, 0]
    want = (*kernel[:-1], rank)
    # A 1x1 conv and a linear layer are the same map: the SD 1.x transformers' proj_in/proj_out are convs,
    # SD 2.x's and SDXL's linear, and LoRA trainers write either shape for either.
    if down.shape != want and down.shape[-2:] == want[-2:] and all(d == 1 for d in (*down.shape[:-2], *want[:-2])):
        down = down.reshape(want)
    if up.ndim != 2 or down.shape != want or up.shape != (kernel[-1], rank):
        return None
    return np.ascontiguousarray(down, np.float32), np.ascontiguousarray(up.T, np.float32)


def _torch_shape(kernel: tuple[int, ...]) -> tuple[int, ...]:
    return (kernel[3], kernel[2], kernel[0], kernel[1]) if len(kernel) == 4 else (kernel[1], kernel[0])


def _cut(up: np.ndarray, target: Target) -> list[np.ndarray] | None:
    """The up factor [out, rank(, 1, 1)] of each of `target`'s layers: its rows in equal parts (halves swapped)."""
    n = len(target.layers)
    if up.shape[0] % (2 * n if target.swap else n):
        return None
    parts = np.split(up, n, axis=0)
    if target.swap:
        parts = [np.concatenate([p[p.shape[0] // 2 :], p[: p.shape[0] // 2]]) for p in parts]
    return parts


def lora_factors(lora: LoRAFile, params: nnx.State) -> LoRAFactors:
    """Matches every tensor of `lora` to a kernel of `params` (a `LoadedModel.params` tree); refuses the file,
    naming each tensor that fits no layer, does not fit its layer's shape, or is of a LoRA variant we do not run."""
    kernels = _kernels(params)
    shapes = {path: tuple(var.get_value().shape) for path, var in nnx.to_flat_state(params) if path[-1] == "kernel"}
    table = spellings(kernels)
    found: dict[Target, dict[str, tuple[str, np.ndarray]]] = {}
    peft_names: dict[Target, str | None] = {}
    problems: dict[str, list[str]] = {title: [] for title in PROBLEMS}
    for key, value in lora.tensors.items():
        name = parse(key)
        target = table.get(name.layer) if name else None
        if target is None:
            problems["unsupported" if unsupported(key) else "unknown"].append(key)
            continue
        parts = found.setdefault(target, {})
        if name.part in parts:  # the same layer under two spellings
            problems["twice"].append(f"{parts[name.part][0]} and {key}")
            continue
        parts[name.part] = (key, np.asarray(value, np.float32))
        peft_names[target] = name.peft_module
    for flag in ("use_dora", "lora_bias"):
        for component in COMPONENTS:
            if lora.metadata.get(f"{component}.{flag}"):
                problems["unsupported"].append(f"{component} adapters with {flag} (header)")
    out: LoRAFactors = {}
    adapted_by: dict[str, str] = {}  # our layer -> the tensor that adapts it (a fused and a split spelling clash)
    for target, parts in sorted(found.items()):
        if "down" not in parts or "up" not in parts:
            problems["incomplete"].append(", ".join(key for key, _ in parts.values()))
            continue
        (down_key, down), (up_key, up) = parts["down"], parts["up"]
        rank = down.shape[0]
        if "alpha" in parts:
            scale = float(parts["alpha"][1].reshape(-1)[0]) / rank
        else:
            peft = _peft_alpha(lora.metadata, target.layers[0].split(".", 1)[0], peft_names[target], rank)
            scale = 1.0 if peft is None else peft  # no alpha anywhere: alpha = rank, as diffusers assumes
        ups = _cut(up, target) or [None] * len(target.layers)
        layers = list(zip(target.layers, ups, strict=True))
        fitted = [None if u is None else _our_layout(down, u, shapes[kernels[layer]]) for layer, u in layers]
        if any(f is None for f in fitted):
            wanted = " + ".join(f"{layer} {_torch_shape(shapes[kernels[layer]])}" for layer in target.layers)
            problems["mis-shaped"].append(f"{down_key} {down.shape} and {up_key} {up.shape} do not fit {wanted}")
            continue
        for layer, factors in zip(target.layers, fitted, strict=True):
            if layer in adapted_by:
                problems["twice"].append(f"{adapted_by[layer]} and {down_key}")
                continue
            adapted_by[layer] = down_key
            out[kernels[layer]] = LowRank(*factors, np.float32(scale))
    if any(problems.values()) or not out:
        raise LoRAError(_refusal(lora, params, problems))
    return out


def _refusal(lora: LoRAFile, params: nnx.State, problems: dict[str, list[str]]) -> str:
    lines = [f"LoRA {lora.name}: its tensors do not fit this model"]
    for title, names in problems.items():
        if names:
            shown = "; ".join(names[:20]) + (f" ... ({len(names) - 20} more)" if len(names) > 20 else "")
            lines.append(f"  {PROBLEMS[title]} ({len(names)}): {shown}")
    if not lora.tensors:
        lines.append("  the file holds no tensors")
    second_encoder = any(k.startswith(("text_encoder_2.", "lora_te2_")) for k in lora.tensors)
    encoder = any(k.startswith(("text_encoder", "lora_te")) for k in problems["unknown"])
    if second_encoder and "text_encoder_2" not in params:
        lines.append("  it adapts a second text encoder, so it is made for Stable Diffusion XL")
    elif encoder and "transformer" in params:
        lines.append("  it adapts a text encoder: this model's LoRAs adapt its transformer alone")
    elif problems["unknown"] or problems["mis-shaped"]:
        lines.append("  is it a LoRA for another model family?")
    return "\n".join(lines)


def apply_loras(params: nnx.State, loras: Sequence[LoRAFactors], scales: jax.Array) -> nnx.State:
    """`W + sum_i scales[i] * loras[i].scale * down @ up` for every adapted kernel; other leaves pass through.

    Pure and jittable: `scales` [len(loras)] is traced, so new weights never recompile; the sum is taken in
    f32 and cast back to each kernel's dtype.
    """
    deltas: dict[tuple, jax.Array] = {}
    for i, lora in enumerate(loras):
        for path, f in lora.items():
            product = jnp.matmul(
                jnp.asarray(f.down, jnp.float32), jnp.asarray(f.up, jnp.float32), precision=jax.lax.Precision.HIGHEST
            )  # [..., in, out]: the kernel's shape
            delta = (scales[i] * f.scale) * product
            deltas[path] = deltas[path] + delta if path in deltas else delta
    flat = []
    for path, var in nnx.to_flat_state(params):
        if path in deltas:
            kernel = var.get_value()
            var = var.replace((kernel.astype(jnp.float32) + deltas.pop(path)).astype(kernel.dtype))
        flat.append((path, var))
    if deltas:
        raise LoRAError(f"LoRA factors for layers this model does not have: {sorted(map(str, deltas))[:5]}")
    return nnx.from_flat_state(flat)
