"""The original (LDM / sgm / A1111) tensor names of a UNet, a KL VAE and an OpenCLIP text encoder -> diffusers'.

A single-file checkpoint holds every network under one prefix each (`model.diffusion_model.` for the UNet,
`first_stage_model.` for the VAE, `cond_stage_model.` or `conditioner.embedders.N.` for the text encoders); the
callers strip the prefix and these functions rename what is left, as diffusers' `convert_ldm_unet_checkpoint`,
`convert_ldm_vae_checkpoint` and `convert_open_clip_checkpoint` (loaders/single_file_utils.py) do:

- UNet: `input_blocks.N` is conv_in (0), then per down block its resnets (`.0`) with their attentions (`.1`) and a
  downsampler (`.0.op`); `middle_block.{0,1,2}` is resnet, attention, resnet; `output_blocks.N` holds per up block
  its resnets (`.0`), attentions (`.1`) and an upsampler (`.1.conv`, or `.2.conv` after an attention). Inside a
  resnet: `in_layers.{0,2}` are norm1/conv1, `out_layers.{0,3}` norm2/conv2, `emb_layers.1` time_emb_proj,
  `skip_connection` conv_shortcut. Attention blocks keep their inner names.
- VAE: `down.N.block.M` / `up.N.block.M` (up blocks numbered from the bottom, diffusers' from the top),
  `mid.block_{1,2}`, `mid.attn_1.{norm,q,k,v,proj_out}` whose 1x1 conv kernels become linear ones.
- OpenCLIP: `resblocks.N.{ln_1,ln_2,attn,mlp.c_fc,mlp.c_proj}` with q, k and v stacked in `attn.in_proj_*`;
  `text_projection` is applied as `x @ P`, so diffusers' linear weight is its transpose.

Each function returns the renamed tensors; names it does not know (EMA copies, OpenCLIP's `logit_scale`, layers
past the config's depth) are left out, and whatever the model then lacks is reported by `weights.convert`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np

from ..models.config import CLIPTextConfig, UNetConfig, VAEConfig

UNET_TOP = {
    "time_embed.0": "time_embedding.linear_1",
    "time_embed.2": "time_embedding.linear_2",
    "input_blocks.0.0": "conv_in",
    "out.0": "conv_norm_out",
    "out.2": "conv_out",
    "label_emb.0.0": "add_embedding.linear_1",  # SDXL's text_time embedding
    "label_emb.0.2": "add_embedding.linear_2",
}
UNET_RESNET = {
    "in_layers.0": "norm1",
    "in_layers.2": "conv1",
    "out_layers.0": "norm2",
    "out_layers.3": "conv2",
    "emb_layers.1": "time_emb_proj",
    "skip_connection": "conv_shortcut",
}
VAE_TOP = {"encoder.norm_out": "encoder.conv_norm_out", "decoder.norm_out": "decoder.conv_norm_out"}
VAE_SAME = (
    "encoder.conv_in",
    "encoder.conv_out",
    "decoder.conv_in",
    "decoder.conv_out",
    "quant_conv",
    "post_quant_conv",
)
VAE_ATTENTION = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}
OPENCLIP_TOP = {
    "positional_embedding": "text_model.embeddings.position_embedding.weight",
    "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
    "ln_final.weight": "text_model.final_layer_norm.weight",
    "ln_final.bias": "text_model.final_layer_norm.bias",
}
OPENCLIP_LAYER = {
    "ln_1": "layer_norm1",
    "ln_2": "layer_norm2",
    "mlp.c_fc": "mlp.fc1",
    "mlp.c_proj": "mlp.fc2",
    "attn.out_proj": "self_attn.out_proj",
}


def _rename_head(name: str, table: Mapping[str, str]) -> str | None:
    """`name` with its leading module renamed by `table` (`in_layers.2.weight` -> `conv1.weight`); None if none."""
    for old, new in table.items():
        if name.startswith(old + "."):
            return new + name[len(old) :]
    return None


def _unet_blocks(config: UNetConfig) -> tuple[dict[int, tuple[int, int]], dict[int, int], dict[int, tuple[int, int]]]:
    """input block -> (down block, resnet), input block -> down block whose downsampler it is, output block ->
    (up block, resnet), from the config's layers per block (diffusers' up blocks have one resnet more)."""
    layers = config.per_block("layers_per_block")
    inputs, downsamplers, outputs = {}, {}, {}
    n = 1
    for block, count in enumerate(layers):
        for j in range(count):
            inputs[n], n = (block, j), n + 1
        if block < len(layers) - 1:
            downsamplers[n], n = block, n + 1
    n = 0
    for block, count in enumerate(reversed(layers)):
        for j in range(count + 1):
            outputs[n], n = (block, j), n + 1
    return inputs, downsamplers, outputs


def unet_to_diffusers(tensors: Mapping[str, np.ndarray], config: UNetConfig) -> dict[str, np.ndarray]:
    """A UNet's tensors (without `model.diffusion_model.`) by diffusers' names."""
    inputs, downsamplers, outputs = _unet_blocks(config)
    out = {}
    for key, value in tensors.items():
        name = _rename_head(key, UNET_TOP)
        if m := re.fullmatch(r"input_blocks\.(\d+)\.([01])\.(.+)", key):
            i, part, rest = int(m[1]), m[2], m[3]
            if i in downsamplers and part == "0" and rest.startswith("op."):
                name = f"down_blocks.{downsamplers[i]}.downsamplers.0.conv.{rest[3:]}"
            elif i in inputs and part == "0":
                name = _rename_head(rest, UNET_RESNET)
                name = name and f"down_blocks.{inputs[i][0]}.resnets.{inputs[i][1]}.{name}"
            elif i in inputs:
                name = f"down_blocks.{inputs[i][0]}.attentions.{inputs[i][1]}.{rest}"
        elif m := re.fullmatch(r"middle_block\.([012])\.(.+)", key):
            if m[1] == "1":
                name = f"mid_block.attentions.0.{m[2]}"
            else:
                name = _rename_head(m[2], UNET_RESNET)
                name = name and f"mid_block.resnets.{int(m[1]) // 2}.{name}"
        elif (m := re.fullmatch(r"output_blocks\.(\d+)\.([012])\.(.+)", key)) and int(m[1]) in outputs:
            (block, j), part, rest = outputs[int(m[1])], m[2], m[3]
            if part == "0":
                name = _rename_head(rest, UNET_RESNET)
                name = name and f"up_blocks.{block}.resnets.{j}.{name}"
            elif rest.startswith("conv."):  # `.1.conv` without an attention, `.2.conv` after one
                name = f"up_blocks.{block}.upsamplers.0.{rest}"
            elif part == "1":
                name = f"up_blocks.{block}.attentions.{j}.{rest}"
        if name is not None:
            out[name] = value
    return out


def vae_to_diffusers(tensors: Mapping[str, np.ndarray], config: VAEConfig) -> dict[str, np.ndarray]:
    """A KL VAE's tensors (without `first_stage_model.`) by diffusers' names."""
    up_blocks = len(config.up_block_types)
    out = {}
    for key, value in tensors.items():
        name = _rename_head(key, VAE_TOP) or _rename_head(key, {k: k for k in VAE_SAME})
        if m := re.fullmatch(r"(encoder|decoder)\.mid\.block_([12])\.(.+)", key):
            name = f"{m[1]}.mid_block.resnets.{int(m[2]) - 1}.{m[3].replace('nin_shortcut', 'conv_shortcut')}"
        elif m := re.fullmatch(r"(encoder|decoder)\.mid\.attn_1\.(norm|q|k|v|proj_out)\.(weight|bias)", key):
            name = f"{m[1]}.mid_block.attentions.0.{VAE_ATTENTION[m[2]]}.{m[3]}"
            if m[2] != "norm" and value.ndim > 2:  # a 1x1 conv [C, C, 1, 1] -> the linear [C, C] diffusers has
                value = value.reshape(value.shape[:2])
        elif m := re.fullmatch(r"encoder\.down\.(\d+)\.block\.(\d+)\.(.+)", key):
            name = f"encoder.down_blocks.{m[1]}.resnets.{m[2]}.{m[3].replace('nin_shortcut', 'conv_shortcut')}"
        elif m := re.fullmatch(r"encoder\.down\.(\d+)\.downsample\.conv\.(.+)", key):
            name = f"encoder.down_blocks.{m[1]}.downsamplers.0.conv.{m[2]}"
        elif (m := re.fullmatch(r"decoder\.up\.(\d+)\.block\.(\d+)\.(.+)", key)) and int(m[1]) < up_blocks:
            block = up_blocks - 1 - int(m[1])
            name = f"decoder.up_blocks.{block}.resnets.{m[2]}.{m[3].replace('nin_shortcut', 'conv_shortcut')}"
        elif (m := re.fullmatch(r"decoder\.up\.(\d+)\.upsample\.conv\.(.+)", key)) and int(m[1]) < up_blocks:
            name = f"decoder.up_blocks.{up_blocks - 1 - int(m[1])}.upsamplers.0.conv.{m[2]}"
        if name is not None:
            out[name] = value
    return out


def openclip_to_diffusers(
    tensors: Mapping[str, np.ndarray], config: CLIPTextConfig, projection: bool
) -> dict[str, np.ndarray]:
    """An OpenCLIP text tower's tensors (without `cond_stage_model.model.` / `conditioner.embedders.1.model.`)
    by transformers' CLIPTextModel names (WithProjection's when `projection`).

    Layers past the config's `num_hidden_layers` are left out: SD 2.x's config drops the tower's last layer,
    whose output SD 2.x never read (it conditions on the penultimate layer)."""
    out = {}
    for key, value in tensors.items():
        name = OPENCLIP_TOP.get(key)
        if key == "text_projection" and projection:
            name, value = "text_projection.weight", value.T  # applied as x @ P; a linear weight is [out, in]
        elif m := re.fullmatch(r"transformer\.resblocks\.(\d+)\.(.+)", key):
            layer, rest = int(m[1]), m[2]
            if layer >= config.num_hidden_layers:
                continue
            prefix = f"text_model.encoder.layers.{layer}"
            if m2 := re.fullmatch(r"attn\.in_proj_(weight|bias)", rest):
                width = value.shape[0] // 3  # q, k and v stacked: [3 * d, d] and [3 * d]
                for i, part in enumerate(("q_proj", "k_proj", "v_proj")):
                    out[f"{prefix}.self_attn.{part}.{m2[1]}"] = value[i * width : (i + 1) * width]
                continue
            renamed = _rename_head(rest, OPENCLIP_LAYER)
            name = renamed and f"{prefix}.{renamed}"
        if name is not None:
            out[name] = value
    return out
