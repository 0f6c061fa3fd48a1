"""LoRA tensor names -> the layer of our param tree that each one adapts.

LoRA files name the layer they adapt in one of several spellings, all derived here from our own module
paths (which are diffusers' key paths), so that matching is a table lookup and never a chain of string
replacements:

- diffusers/PEFT: `unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight` (`lora_B`
  for the up factor), `text_encoder.text_model.encoder.layers.0.self_attn.q_proj...`, `text_encoder_2....`;
  text encoders also without `text_model.` (transformers 5 saves CLIPTextModel so).
- older diffusers: `...attn1.processor.to_q_lora.down.weight` or `...attn1.to_q_lora.up.weight` (attention
  processors; `to_out_lora` is `to_out.0`, and in a text encoder `q_proj`...`out_proj`), and
  `...mlp.fc1.lora_linear_layer.down.weight` / `...lora.down.weight`; UNet-only files without a `unet.` prefix.
- kohya (sd-scripts, A1111): the module path with dots as underscores behind `lora_unet_`, `lora_te_`
  (`lora_te1_`/`lora_te2_` for SDXL's two encoders), then `.lora_down.weight`, `.lora_up.weight`, `.alpha`.
- kohya for SDXL names UNet layers after Stability's original (sgm) UNet: `input_blocks.{n}.{0: resnet,
  1: transformer}`, `middle_block.{0, 1, 2}`, `output_blocks.{n}.{0, 1, 1 or 2: upsampler}`, with resnet
  parts `in_layers.2` (conv1), `out_layers.3` (conv2), `emb_layers.1` (time_emb_proj), `skip_connection`;
  the same mapping as diffusers' `_maybe_map_sgm_blocks_to_diffusers`, computed from our tree's layout.
- transformers (Z-Image, FLUX.2): diffusers/PEFT's `transformer.<module>.lora_A.weight` as `save_lora_weights`
  writes it, and the trainers' (ComfyUI, ai-toolkit, musubi-tuner) `diffusion_model.<module>` with `lora_A`/`lora_B`
  or `lora_down`/`lora_up` and `.alpha`, the module named after diffusers or after the original checkpoint
  (`ORIGINAL_NAMES`: FLUX.2's `double_blocks.N.img_attn.qkv`, Z-Image's `layers.N.attention.qkv`); kohya's
  `lora_unet_` + either name with underscores. A fused original layer is a `Target` of several of ours: the down
  factor is shared and the up factor's rows are cut in equal parts, as diffusers' converters cut them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import NamedTuple

COMPONENTS = ("unet", "text_encoder", "text_encoder_2", "transformer")
TRAINER = "diffusion_model."  # a trainer's transformer (ComfyUI, ai-toolkit, musubi-tuner)
TRAINER_PREFIXES = (TRAINER, "base_model.model.")  # the second: PEFT's own `save_pretrained` of the model
KOHYA_PREFIXES = {"lora_unet_": "unet", "lora_te_": "text_encoder", "lora_te1_": "text_encoder"}
KOHYA_PREFIXES["lora_te2_"] = "text_encoder_2"
KOHYA_PARTS = {"lora_down.weight": "down", "lora_up.weight": "up", "alpha": "alpha"}
# Top-level UNet modules: a file whose keys start with one of these is a UNet-only file without `unet.`.
UNET_ROOTS = ("down_blocks", "mid_block", "up_blocks", "conv_in", "conv_out", "time_embedding", "add_embedding")
# Attention processor LoRAs (diffusers < 0.21) name the projection, not the layer.
PROCESSOR_LAYERS = {
    "unet": {"to_q": "to_q", "to_k": "to_k", "to_v": "to_v", "to_out": "to_out.0"},
    "text": {"to_q": "q_proj", "to_k": "k_proj", "to_v": "v_proj", "to_out": "out_proj"},
}
DIFFUSERS_PATTERNS = (
    re.compile(r"^(?P<module>.+)\.lora_(?P<part>A|B)(\.default(_\d+)?)?\.weight$"),
    re.compile(r"^(?P<module>.+?)(\.processor)?\.(?P<proj>to_q|to_k|to_v|to_out)_lora\.(?P<part>down|up)\.weight$"),
    re.compile(r"^(?P<module>.+)\.lora(_linear_layer)?\.(?P<part>down|up)\.weight$"),
    re.compile(r"^(?P<module>.+)\.lora_(?P<part>down|up)\.weight$"),
    re.compile(r"^(?P<module>.+)\.(?P<part>alpha)$"),
)
PART_NAMES = {"A": "down", "B": "up", "down": "down", "up": "up", "alpha": "alpha"}
# Variants of LoRA that are not a plain low-rank product (LoHa, LoKr, LoCon's Tucker core, DoRA, biases):
# their tensors are refused by name rather than silently dropped.
UNSUPPORTED = re.compile(
    r"(hada_|lokr_|lora_mid|dora_scale|lora_magnitude_vector|lora_B\.bias|lora_up\.bias|\.diff(_b)?$|\.on_input$)"
)
RESNET_SGM = {"conv1": "in_layers.2", "conv2": "out_layers.3", "time_emb_proj": "emb_layers.1"}
RESNET_SGM["conv_shortcut"] = "skip_connection"
TOP_LEVEL_SGM = {
    "conv_in": "input_blocks.0.0",
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "add_embedding.linear_1": "label_emb.0.0",
    "add_embedding.linear_2": "label_emb.0.2",
    "conv_out": "out.2",
}


# The original checkpoints' names of our (diffusers') transformer layers, per family, told by a layer only it has:
# (our layer, its original name, the order of a fused original's parts by the `part` group, halves swapped). As
# diffusers' `convert_*_transformer_checkpoint_to_diffusers` and `_convert_non_diffusers_*_lora_to_diffusers`.
_BLOCK = r"(?P<b>(layers|noise_refiner|context_refiner)\.\d+)"
_DOUBLE = r"transformer_blocks\.(?P<i>\d+)"
ORIGINAL_NAMES = {
    "noise_refiner.0.attention.to_q": (  # Z-Image (Tongyi's checkpoint): fused q, k, v
        (_BLOCK + r"\.attention\.to_(?P<part>[qkv])", r"\g<b>.attention.qkv", "qkv", False),
        (_BLOCK + r"\.attention\.to_out\.0", r"\g<b>.attention.out", "", False),
        (r"all_final_layer\.2-1\.(?P<rest>.+)", r"final_layer.\g<rest>", "", False),
        (r"all_x_embedder\.2-1", "x_embedder", "", False),
    ),
    "single_stream_modulation.linear": (  # FLUX.2 (Black Forest Labs' flux2 code)
        (_DOUBLE + r"\.attn\.to_(?P<part>[qkv])", r"double_blocks.\g<i>.img_attn.qkv", "qkv", False),
        (_DOUBLE + r"\.attn\.add_(?P<part>[qkv])_proj", r"double_blocks.\g<i>.txt_attn.qkv", "qkv", False),
        (_DOUBLE + r"\.attn\.to_out\.0", r"double_blocks.\g<i>.img_attn.proj", "", False),
        (_DOUBLE + r"\.attn\.to_add_out", r"double_blocks.\g<i>.txt_attn.proj", "", False),
        (_DOUBLE + r"\.ff\.linear_in", r"double_blocks.\g<i>.img_mlp.0", "", False),
        (_DOUBLE + r"\.ff\.linear_out", r"double_blocks.\g<i>.img_mlp.2", "", False),
        (_DOUBLE + r"\.ff_context\.linear_in", r"double_blocks.\g<i>.txt_mlp.0", "", False),
        (_DOUBLE + r"\.ff_context\.linear_out", r"double_blocks.\g<i>.txt_mlp.2", "", False),
        (r"single_transformer_blocks\.(?P<i>\d+)\.attn\.to_qkv_mlp_proj", r"single_blocks.\g<i>.linear1", "", False),
        (r"single_transformer_blocks\.(?P<i>\d+)\.attn\.to_out", r"single_blocks.\g<i>.linear2", "", False),
        (r"x_embedder", "img_in", "", False),
        (r"context_embedder", "txt_in", "", False),
        (r"time_guidance_embed\.timestep_embedder\.linear_1", "time_in.in_layer", "", False),
        (r"time_guidance_embed\.timestep_embedder\.linear_2", "time_in.out_layer", "", False),
        (r"time_guidance_embed\.guidance_embedder\.linear_1", "guidance_in.in_layer", "", False),
        (r"time_guidance_embed\.guidance_embedder\.linear_2", "guidance_in.out_layer", "", False),
        (
            r"(?P<m>(double_stream_modulation_img|double_stream_modulation_txt|single_stream_modulation))\.linear",
            r"\g<m>.lin",
            "",
            False,
        ),
        (r"proj_out", "final_layer.linear", "", False),
        (r"norm_out\.linear", "final_layer.adaLN_modulation.1", "", True),  # shift, scale there; scale, shift here
    ),
}


class Target(NamedTuple):
    """The layers of ours that one LoRA layer adapts: one, or the parts of a fused original layer in the order
    of its output rows (its up factor cut in equal parts, its down factor shared)."""

    layers: tuple[str, ...]  # "unet.down_blocks.0...to_q", "transformer.transformer_blocks.0.attn.to_q", ...
    swap: bool = False  # the up factor's two halves swapped: the original's (shift, scale) is our (scale, shift)


class TensorName(NamedTuple):
    layer: str  # a spelling of the layer, component first: "unet.down_blocks.0...to_q" or "lora_unet_down_..."
    part: str  # "down", "up" or "alpha"
    peft_module: str | None  # the layer's name within its component as PEFT matched it (for alpha_pattern)


def unsupported(key: str) -> bool:
    return bool(UNSUPPORTED.search(key))


def parse(key: str) -> TensorName | None:
    """What one tensor of a LoRA file is; None for a name of no layout we know (or an unsupported variant)."""
    if unsupported(key):
        return None
    for prefix in KOHYA_PREFIXES:
        if key.startswith(prefix):
            layer, _, suffix = key.partition(".")
            part = KOHYA_PARTS.get(suffix)
            return TensorName(layer, part, None) if part else None
    for prefix in TRAINER_PREFIXES:
        if key.startswith(prefix):
            key = TRAINER + key.removeprefix(prefix)
    head = key.split(".", 1)[0]
    if head not in (*COMPONENTS, TRAINER[:-1]):
        if head not in UNET_ROOTS:
            return None
        key, head = f"unet.{key}", "unet"
    for pattern in DIFFUSERS_PATTERNS:
        match = pattern.match(key)
        if match:
            module = match["module"]
            if match.groupdict().get("proj"):
                kind = "text" if head.startswith("text_encoder") else "unet"
                module = f"{module}.{PROCESSOR_LAYERS[kind][match['proj']]}"
            return TensorName(module, PART_NAMES[match["part"]], module.split(".", 1)[1] if "." in module else "")
    return None


def _sgm_names(unet_layers: list[str]) -> dict[str, str]:
    """Our UNet layer names (without `unet.`) -> their names in the original (sgm) UNet."""
    resnets: dict[tuple[str, int], int] = {}
    attention_blocks, down_samplers = set(), set()
    for name in unet_layers:
        match = re.match(r"^(down|up)_blocks\.(\d+)\.(resnets|attentions|downsamplers)\.(\d+)\.", name)
        if not match:
            continue
        side, block, kind, index = match[1], int(match[2]), match[3], int(match[4])
        if kind == "resnets":
            resnets[(side, block)] = max(resnets.get((side, block), 0), index + 1)
        elif kind == "attentions":
            attention_blocks.add((side, block))
        else:
            down_samplers.add(block)
    first_input, n = {}, 1  # input_blocks.0 is conv_in
    for block in range(len([k for k in resnets if k[0] == "down"])):
        first_input[block] = n
        n += resnets[("down", block)] + (block in down_samplers)
    first_output, n = {}, 0
    for block in range(len([k for k in resnets if k[0] == "up"])):
        first_output[block] = n
        n += resnets[("up", block)]

    def inner(kind: str, rest: str) -> str:
        if kind == "resnets":
            head, _, tail = rest.partition(".")
            return RESNET_SGM.get(head, head) + (f".{tail}" if tail else "")
        return rest

    out = {}
    for name in unet_layers:
        if name in TOP_LEVEL_SGM:
            out[name] = TOP_LEVEL_SGM[name]
        elif m := re.match(r"^down_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.+)$", name):
            i, j = int(m[1]), int(m[3])
            out[name] = f"input_blocks.{first_input[i] + j}.{int(m[2] == 'attentions')}.{inner(m[2], m[4])}"
        elif m := re.match(r"^down_blocks\.(\d+)\.downsamplers\.0\.conv$", name):
            i = int(m[1])
            out[name] = f"input_blocks.{first_input[i] + resnets[('down', i)]}.0.op"
        elif m := re.match(r"^mid_block\.(resnets|attentions)\.(\d+)\.(.+)$", name):
            index = {("resnets", "0"): 0, ("attentions", "0"): 1, ("resnets", "1"): 2}[(m[1], m[2])]
            out[name] = f"middle_block.{index}.{inner(m[1], m[3])}"
        elif m := re.match(r"^up_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.+)$", name):
            i, j = int(m[1]), int(m[3])
            out[name] = f"output_blocks.{first_output[i] + j}.{int(m[2] == 'attentions')}.{inner(m[2], m[4])}"
        elif m := re.match(r"^up_blocks\.(\d+)\.upsamplers\.0\.conv$", name):
            i = int(m[1])
            last = first_output[i] + resnets[("up", i)] - 1
            out[name] = f"output_blocks.{last}.{2 if ('up', i) in attention_blocks else 1}.conv"
    return out


def _original_names(transformer: list[str]) -> dict[str, Target]:
    """The original checkpoint's names of a transformer's layers (without `transformer.`) -> our layers."""
    rules = next((rules for marker, rules in ORIGINAL_NAMES.items() if marker in transformer), ())
    fused: dict[str, dict[int, str]] = {}
    orders, swaps = {}, {}
    for name in transformer:
        for pattern, template, order, swap in rules:
            if match := re.fullmatch(pattern, name):
                original = match.expand(template)
                fused.setdefault(original, {})[order.index(match["part"]) if order else 0] = f"transformer.{name}"
                orders[original], swaps[original] = order, swap
                break
    return {
        original: Target(tuple(parts[i] for i in range(len(orders[original]) or 1)), swaps[original])
        for original, parts in fused.items()
        if len(parts) == (len(orders[original]) or 1)  # a fused layer only when all its parts are ours
    }


def spellings(layers: Iterable[str]) -> dict[str, Target]:
    """Every name a LoRA file may give each of our layers -> the layers it adapts (`Target`)."""
    layers = list(layers)
    table: dict[str, Target] = {}
    for layer in layers:
        component, _, name = layer.partition(".")
        table[layer] = Target((layer,))
        if component.startswith("text_encoder"):
            if name.startswith("text_model."):
                table[f"{component}.{name.removeprefix('text_model.')}"] = Target((layer,))
            prefixes = ["lora_te_", "lora_te1_"] if component == "text_encoder" else ["lora_te2_"]
        else:
            prefixes = ["lora_unet_"] + ([TRAINER] if component == "transformer" else [])
        for prefix in prefixes:
            table[prefix + (name if prefix == TRAINER else name.replace(".", "_"))] = Target((layer,))
    unet = [layer.removeprefix("unet.") for layer in layers if layer.startswith("unet.")]
    for name, sgm in _sgm_names(unet).items():
        table["lora_unet_" + sgm.replace(".", "_")] = Target((f"unet.{name}",))
    transformer = [layer.removeprefix("transformer.") for layer in layers if layer.startswith("transformer.")]
    for original, target in _original_names(transformer).items():
        table.setdefault(TRAINER + original, target)
        table.setdefault("lora_unet_" + original.replace(".", "_"), target)
    return table
