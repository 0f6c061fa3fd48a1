"""The original layouts of the DiT transformers renamed to diffusers' names, which are our parameter paths: FLUX.1's
and FLUX.2's (Black Forest Labs' `double_blocks.N.img_attn.qkv`), SD 3's (Stability's MMDiT
`joint_blocks.N.x_block.attn.qkv`) and Z-Image's (ComfyUI's `layers.N.attention.qkv`).

The same tables as diffusers' `convert_flux_transformer_checkpoint_to_diffusers`,
`convert_flux2_transformer_checkpoint_to_diffusers`, `convert_sd3_transformer_checkpoint_to_diffusers` and
`convert_z_image_transformer_checkpoint_to_diffusers` (single_file_utils.py): fused q/k/v projections (and FLUX.1's
single blocks' q/k/v/MLP input) are cut into diffusers' separate ones along the output axis, and the final
adaptive norms' (and SD3's last context block's) shift-then-scale halves swap to diffusers' scale-then-shift. The
widths come from the tensors' shapes, never from a constant, so any size of model converts.

A conversion is a plan first (`Take`: which tensor, which rows, halves swapped), then applied: the plan says which of
the file's tensors nothing took (refused by name: a file of another layout, or a model we do not build).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..errors import WeightsError

PREFIX = "model.diffusion_model."  # an all-in-one file's denoiser, as Stability's and ComfyUI's files keep it


@dataclass(frozen=True)
class Take:
    """One of our tensors: rows `start:stop` of the file's tensor `source` (all of it when None), its two halves
    swapped when `swap` (shift, scale -> scale, shift)."""

    source: str
    start: int | None = None
    stop: int | None = None
    swap: bool = False

    def __call__(self, tensors: Mapping[str, np.ndarray]) -> np.ndarray:
        """Rows of the tensor, picked by slicing or by an index array: a quantized tensor (`gguf_file.Q8Tensor`)
        picks whole rows of its blocks and stays quantized."""
        array = tensors[self.source]
        if self.start is not None or self.stop is not None:
            array = array[self.start : self.stop]
        if self.swap:
            half = array.shape[0] // 2
            array = array[np.r_[half : array.shape[0], 0:half]]
        return array


Plan = dict[str, Take]


def strip_prefix(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The denoiser's tensors without an all-in-one file's `model.diffusion_model.` (a file without it as it is)."""
    if not any(name.startswith(PREFIX) for name in tensors):
        return dict(tensors)
    return {name[len(PREFIX) :]: v for name, v in tensors.items() if name.startswith(PREFIX)}


def _count(names, pattern: str) -> int:
    found = {int(m[1]) for name in names if (m := re.match(pattern, name))}
    return max(found) + 1 if found else 0


def _whole(plan: Plan, pairs: Mapping[str, str], names, ends=("weight", "bias")) -> None:
    """diffusers module -> original module, every parameter the original has."""
    for ours, theirs in pairs.items():
        for end in ends:
            if f"{theirs}.{end}" in names:
                plan[f"{ours}.{end}"] = Take(f"{theirs}.{end}")


def _split(plan: Plan, source: str, targets: list[str], sizes: list[int], names) -> None:
    """A fused projection `source` (.weight and .bias) cut along its outputs into `targets` of `sizes` rows."""
    for end in ("weight", "bias"):
        if f"{source}.{end}" not in names:
            continue
        start = 0
        for target, size in zip(targets, sizes, strict=True):
            plan[f"{target}.{end}"] = Take(f"{source}.{end}", start, start + size)
            start += size


def _double_attention(plan: Plan, ours: str, theirs: str, inner: int, names) -> None:
    """A FLUX.1 or FLUX.2 double block's attention: each stream's fused qkv cut in thirds, its q and k norms."""
    _split(plan, f"{theirs}.img_attn.qkv", [f"{ours}.attn.to_{x}" for x in "qkv"], [inner] * 3, names)
    _split(plan, f"{theirs}.txt_attn.qkv", [f"{ours}.attn.add_{x}_proj" for x in "qkv"], [inner] * 3, names)
    for ours_norm, theirs_norm in (
        ("norm_q", "img_attn.norm.query_norm"),
        ("norm_k", "img_attn.norm.key_norm"),
        ("norm_added_q", "txt_attn.norm.query_norm"),
        ("norm_added_k", "txt_attn.norm.key_norm"),
    ):
        plan[f"{ours}.attn.{ours_norm}.weight"] = Take(f"{theirs}.{theirs_norm}.scale")


def flux_plan(shapes: Mapping[str, tuple[int, ...]]) -> Plan:
    """BFL's FLUX.1 names -> diffusers' FluxTransformer2DModel names, for the file's tensor `shapes`."""
    names = set(shapes)
    inner = shapes["img_in.weight"][0]
    plan: Plan = {}
    _whole(
        plan,
        {
            "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
            "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
            "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
            "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
            "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",  # dev only
            "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
            "context_embedder": "txt_in",
            "x_embedder": "img_in",
            "proj_out": "final_layer.linear",
        },
        names,
    )
    for i in range(_count(names, r"double_blocks\.(\d+)\.")):
        ours, theirs = f"transformer_blocks.{i}", f"double_blocks.{i}"
        _whole(
            plan,
            {
                f"{ours}.norm1.linear": f"{theirs}.img_mod.lin",
                f"{ours}.norm1_context.linear": f"{theirs}.txt_mod.lin",
                f"{ours}.ff.net.0.proj": f"{theirs}.img_mlp.0",
                f"{ours}.ff.net.2": f"{theirs}.img_mlp.2",
                f"{ours}.ff_context.net.0.proj": f"{theirs}.txt_mlp.0",
                f"{ours}.ff_context.net.2": f"{theirs}.txt_mlp.2",
                f"{ours}.attn.to_out.0": f"{theirs}.img_attn.proj",
                f"{ours}.attn.to_add_out": f"{theirs}.txt_attn.proj",
            },
            names,
        )
        _double_attention(plan, ours, theirs, inner, names)
    for i in range(_count(names, r"single_blocks\.(\d+)\.")):
        ours, theirs = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        _whole(
            plan, {f"{ours}.norm.linear": f"{theirs}.modulation.lin", f"{ours}.proj_out": f"{theirs}.linear2"}, names
        )
        mlp = shapes[f"{theirs}.linear1.weight"][0] - 3 * inner
        targets = [f"{ours}.attn.to_{x}" for x in "qkv"] + [f"{ours}.proj_mlp"]
        _split(plan, f"{theirs}.linear1", targets, [inner, inner, inner, mlp], names)
        plan[f"{ours}.attn.norm_q.weight"] = Take(f"{theirs}.norm.query_norm.scale")
        plan[f"{ours}.attn.norm_k.weight"] = Take(f"{theirs}.norm.key_norm.scale")
    for end in ("weight", "bias"):
        plan[f"norm_out.linear.{end}"] = Take(f"final_layer.adaLN_modulation.1.{end}", swap=True)
    return plan


def sd3_plan(shapes: Mapping[str, tuple[int, ...]]) -> Plan:
    """Stability's MMDiT names -> diffusers' SD3Transformer2DModel names (SD 3 and 3.5: QK-norm, dual attention)."""
    names = set(shapes)
    layers = _count(names, r"joint_blocks\.(\d+)\.")
    plan: Plan = {"pos_embed.pos_embed": Take("pos_embed")}
    _whole(
        plan,
        {
            "pos_embed.proj": "x_embedder.proj",
            "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
            "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
            "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
            "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2",
            "context_embedder": "context_embedder",
            "proj_out": "final_layer.linear",
        },
        names,
    )
    for i in range(layers):
        ours, theirs = f"transformer_blocks.{i}", f"joint_blocks.{i}"
        last = i == layers - 1  # its context block only modulates and projects: diffusers' context_pre_only
        x, c = f"{theirs}.x_block", f"{theirs}.context_block"
        inner = shapes[f"{x}.attn.qkv.weight"][0] // 3
        _split(plan, f"{x}.attn.qkv", [f"{ours}.attn.to_{q}" for q in "qkv"], [inner] * 3, names)
        _split(plan, f"{c}.attn.qkv", [f"{ours}.attn.add_{q}_proj" for q in "qkv"], [inner] * 3, names)
        _split(plan, f"{x}.attn2.qkv", [f"{ours}.attn2.to_{q}" for q in "qkv"], [inner] * 3, names)
        pairs = {
            f"{ours}.attn.to_out.0": f"{x}.attn.proj",
            f"{ours}.attn2.to_out.0": f"{x}.attn2.proj",
            f"{ours}.norm1.linear": f"{x}.adaLN_modulation.1",
            f"{ours}.ff.net.0.proj": f"{x}.mlp.fc1",
            f"{ours}.ff.net.2": f"{x}.mlp.fc2",
        }
        if not last:
            pairs |= {
                f"{ours}.attn.to_add_out": f"{c}.attn.proj",
                f"{ours}.norm1_context.linear": f"{c}.adaLN_modulation.1",
                f"{ours}.ff_context.net.0.proj": f"{c}.mlp.fc1",
                f"{ours}.ff_context.net.2": f"{c}.mlp.fc2",
            }
        else:
            for end in ("weight", "bias"):
                plan[f"{ours}.norm1_context.linear.{end}"] = Take(f"{c}.adaLN_modulation.1.{end}", swap=True)
        _whole(plan, pairs, names)
        norms = {
            "attn.norm_q": f"{x}.attn.ln_q",
            "attn.norm_k": f"{x}.attn.ln_k",
            "attn.norm_added_q": f"{c}.attn.ln_q",
            "attn.norm_added_k": f"{c}.attn.ln_k",
            "attn2.norm_q": f"{x}.attn2.ln_q",
            "attn2.norm_k": f"{x}.attn2.ln_k",
        }
        _whole(plan, {f"{ours}.{k}": v for k, v in norms.items()}, names, ends=("weight",))
    for end in ("weight", "bias"):
        plan[f"norm_out.linear.{end}"] = Take(f"final_layer.adaLN_modulation.1.{end}", swap=True)
    return plan


def flux2_plan(shapes: Mapping[str, tuple[int, ...]]) -> Plan:
    """BFL's FLUX.2 names -> diffusers' Flux2Transformer2DModel names ([klein] 4B and 9B, and [dev]'s guidance
    embedder where a file has one). The double blocks' fused q/k/v are cut in thirds; the single blocks keep their
    fused q/k/v/MLP input (diffusers' `to_qkv_mlp_proj`) whole; the modulations are shared by every block of a stream
    (`double_stream_modulation_img.lin`...), renamed only; the final adaptive norm swaps to scale-then-shift. No
    FLUX.2 layer has a bias, but one that a file holds is renamed with its weight (and refused by the loader)."""
    names = set(shapes)
    inner = shapes["img_in.weight"][0]
    plan: Plan = {}
    _whole(
        plan,
        {
            "x_embedder": "img_in",
            "context_embedder": "txt_in",
            "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
            "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
            "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",  # [dev] only
            "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
            "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
            "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
            "single_stream_modulation.linear": "single_stream_modulation.lin",
            "proj_out": "final_layer.linear",
        },
        names,
    )
    for i in range(_count(names, r"double_blocks\.(\d+)\.")):
        ours, theirs = f"transformer_blocks.{i}", f"double_blocks.{i}"
        _whole(
            plan,
            {
                f"{ours}.attn.to_out.0": f"{theirs}.img_attn.proj",
                f"{ours}.attn.to_add_out": f"{theirs}.txt_attn.proj",
                f"{ours}.ff.linear_in": f"{theirs}.img_mlp.0",
                f"{ours}.ff.linear_out": f"{theirs}.img_mlp.2",
                f"{ours}.ff_context.linear_in": f"{theirs}.txt_mlp.0",
                f"{ours}.ff_context.linear_out": f"{theirs}.txt_mlp.2",
            },
            names,
        )
        _double_attention(plan, ours, theirs, inner, names)
    for i in range(_count(names, r"single_blocks\.(\d+)\.")):
        ours, theirs = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        _whole(
            plan,
            {f"{ours}.attn.to_qkv_mlp_proj": f"{theirs}.linear1", f"{ours}.attn.to_out": f"{theirs}.linear2"},
            names,
        )
        plan[f"{ours}.attn.norm_q.weight"] = Take(f"{theirs}.norm.query_norm.scale")
        plan[f"{ours}.attn.norm_k.weight"] = Take(f"{theirs}.norm.key_norm.scale")
    for end in ("weight", "bias"):
        if f"final_layer.adaLN_modulation.1.{end}" in names:
            plan[f"norm_out.linear.{end}"] = Take(f"final_layer.adaLN_modulation.1.{end}", swap=True)
    return plan


def z_image_plan(shapes: Mapping[str, tuple[int, ...]]) -> Plan:
    """ComfyUI's Z-Image names (Lumina 2's NextDiT layout, as `z_image_turbo_bf16.safetensors` has them) -> diffusers'
    ZImageTransformer2DModel names. Most names are the same in both; each attention's fused q/k/v is cut in thirds,
    its `out` is diffusers' `to_out.0` and its `q_norm`/`k_norm` are `norm_q`/`norm_k`, and the patch embedder and
    final layer sit under diffusers' per-patch-size key `2-1` (patches of 2x2, one frame). The final layer's
    modulation is shift-then-scale in both (diffusers' converter swaps nothing)."""
    names = set(shapes)
    plan: Plan = {name: Take(name) for name in ("x_pad_token", "cap_pad_token") if name in names}
    _whole(
        plan,
        {
            "all_x_embedder.2-1": "x_embedder",
            "all_final_layer.2-1.linear": "final_layer.linear",
            "all_final_layer.2-1.adaLN_modulation.1": "final_layer.adaLN_modulation.1",
            "t_embedder.mlp.0": "t_embedder.mlp.0",
            "t_embedder.mlp.2": "t_embedder.mlp.2",
            "cap_embedder.0": "cap_embedder.0",
            "cap_embedder.1": "cap_embedder.1",
        },
        names,
    )
    for stack in ("noise_refiner", "context_refiner", "layers"):
        for i in range(_count(names, rf"{stack}\.(\d+)\.")):
            block = f"{stack}.{i}"
            attention = f"{block}.attention"
            inner = shapes[f"{attention}.qkv.weight"][0] // 3
            _split(plan, f"{attention}.qkv", [f"{attention}.to_{x}" for x in "qkv"], [inner] * 3, names)
            same = [f"{block}.feed_forward.w{n}" for n in (1, 2, 3)] + [f"{block}.adaLN_modulation.0"]
            same += [f"{block}.{norm}" for norm in ("attention_norm1", "attention_norm2", "ffn_norm1", "ffn_norm2")]
            _whole(
                plan,
                {
                    f"{attention}.to_out.0": f"{attention}.out",
                    f"{attention}.norm_q": f"{attention}.q_norm",
                    f"{attention}.norm_k": f"{attention}.k_norm",
                    **{name: name for name in same},
                },
                names,
            )
    return plan


def apply_plan(plan: Plan, tensors: Mapping[str, np.ndarray], where: str, what: str) -> dict[str, np.ndarray]:
    """Our tensors from the file's by `plan`; a tensor the plan needs and the file lacks, or one of the file's that
    nothing takes, is refused by name."""
    missing = sorted({take.source for take in plan.values()} - set(tensors))
    unused = sorted(set(tensors) - {take.source for take in plan.values()})
    if missing or unused:
        parts = [
            f"missing {', '.join(missing[:8])}" if missing else "",
            f"unknown {', '.join(unused[:8])}" if unused else "",
        ]
        raise WeightsError(f"{where}: not {what} in the original layout: " + "; ".join(p for p in parts if p))
    return {name: take(tensors) for name, take in plan.items()}
