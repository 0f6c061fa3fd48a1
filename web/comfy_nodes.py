"""The ComfyUI nodes this server runs, each described once (`NODES`): its inputs (a link's kind, or a value's kind,
default and range, or its choices) and its outputs, for reading a graph (comfy_graph.py) and for ComfyUI's
`/object_info` alike; and the `Offer` of what a graph may choose here (the server's model, LoRAs, samplers,
schedulers, upscaler networks, the caller's uploads).

The loaders name the one model the server draws with: CheckpointLoaderSimple and UNETLoader must name it, while
DualCLIPLoader and VAELoader may name any file (the model's own text encoders and VAE draw).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from PIL import Image

LINK_KINDS = ("MODEL", "CLIP", "VAE", "CONDITIONING", "LATENT", "IMAGE", "MASK", "UPSCALE_MODEL")
MAX_SEED = 2**64 - 1  # ComfyUI's; ours are uint32, so a seed is taken modulo 2**32
MAX_SIDE = 16384
SEED_LIMIT = 2**32
MAX_NODES = 500  # the graphs clients ship have about ten
MAX_TEXT = 100_000  # characters of a text input (the engine's own prompt limit is far below)


@dataclass(frozen=True)
class Input:
    """One input of a node: a link of `kind` (one of LINK_KINDS), or a value ("INT", "FLOAT", "STRING", "CHOICE")."""

    kind: str
    default: Any = None
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] | str = ()  # CHOICE: the choices, or the name of the `Offer` list that holds them
    optional: bool = False


@dataclass(frozen=True)
class Node:
    display: str
    category: str
    inputs: dict[str, Input]
    outputs: tuple[str, ...] = ()
    output_node: bool = False


def _int(default, low, high) -> Input:
    return Input("INT", default, low, high)


def _float(default, low, high) -> Input:
    return Input("FLOAT", default, low, high)


def _choice(choices, default=None, optional=False) -> Input:
    return Input("CHOICE", default, choices=choices, optional=optional)


_SAMPLING = {
    "steps": _int(20, 1, 10000),
    "cfg": _float(8.0, 0.0, 100.0),
    "sampler_name": _choice("samplers"),
    "scheduler": _choice("schedulers"),
    "positive": Input("CONDITIONING"),
    "negative": Input("CONDITIONING"),
    "latent_image": Input("LATENT"),
}
_EMPTY_LATENT = {"width": _int(512, 16, MAX_SIDE), "height": _int(512, 16, MAX_SIDE), "batch_size": _int(1, 1, 4096)}

NODES: dict[str, Node] = {
    "CheckpointLoaderSimple": Node(
        "Load Checkpoint", "loaders", {"ckpt_name": _choice("checkpoints")}, ("MODEL", "CLIP", "VAE")
    ),
    "UNETLoader": Node(
        "Load Diffusion Model",
        "advanced/loaders",
        {
            "unet_name": _choice("unets"),
            "weight_dtype": _choice(("default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"), "default"),
        },
        ("MODEL",),
    ),
    "DualCLIPLoader": Node(
        "DualCLIPLoader",
        "advanced/loaders",
        {
            "clip_name1": _choice("text_encoders"),
            "clip_name2": _choice("text_encoders"),
            "type": _choice(tuple("sdxl sd3 flux hunyuan_video hidream".split())),  # ComfyUI's CLIP pairings
            "device": _choice(("default", "cpu"), "default", optional=True),
        },
        ("CLIP",),
    ),
    "VAELoader": Node("Load VAE", "loaders", {"vae_name": _choice("vaes")}, ("VAE",)),
    "LoraLoader": Node(
        "Load LoRA",
        "loaders",
        {
            "model": Input("MODEL"),
            "clip": Input("CLIP"),
            "lora_name": _choice("loras"),
            "strength_model": _float(1.0, -100.0, 100.0),
            "strength_clip": _float(1.0, -100.0, 100.0),
        },
        ("MODEL", "CLIP"),
    ),
    "CLIPTextEncode": Node(
        "CLIP Text Encode (Prompt)",
        "conditioning",
        {"text": Input("STRING", ""), "clip": Input("CLIP")},
        ("CONDITIONING",),
    ),
    "EmptyLatentImage": Node("Empty Latent Image", "latent", _EMPTY_LATENT, ("LATENT",)),
    "EmptySD3LatentImage": Node("EmptySD3LatentImage", "latent/sd3", _EMPTY_LATENT, ("LATENT",)),
    "KSampler": Node(
        "KSampler",
        "sampling",
        {"model": Input("MODEL"), "seed": _int(0, 0, MAX_SEED), **_SAMPLING, "denoise": _float(1.0, 0.0, 1.0)},
        ("LATENT",),
    ),
    "KSamplerAdvanced": Node(
        "KSampler (Advanced)",
        "sampling",
        {
            "model": Input("MODEL"),
            "add_noise": _choice(("enable", "disable"), "enable"),
            "noise_seed": _int(0, 0, MAX_SEED),
            **_SAMPLING,
            "start_at_step": _int(0, 0, 10000),
            "end_at_step": _int(10000, 0, 10000),
            "return_with_leftover_noise": _choice(("disable", "enable"), "disable"),
        },
        ("LATENT",),
    ),
    "VAEDecode": Node("VAE Decode", "latent", {"samples": Input("LATENT"), "vae": Input("VAE")}, ("IMAGE",)),
    "VAEEncode": Node("VAE Encode", "latent", {"pixels": Input("IMAGE"), "vae": Input("VAE")}, ("LATENT",)),
    "UpscaleModelLoader": Node(
        "Load Upscale Model", "loaders", {"model_name": _choice("upscalers")}, ("UPSCALE_MODEL",)
    ),
    "ImageUpscaleWithModel": Node(
        "Upscale Image (using Model)",
        "image/upscaling",
        {"upscale_model": Input("UPSCALE_MODEL"), "image": Input("IMAGE")},
        ("IMAGE",),
    ),
    "LoadImage": Node("Load Image", "image", {"image": _choice("uploads")}, ("IMAGE", "MASK")),
    "SaveImage": Node(
        "Save Image",
        "image",
        {"images": Input("IMAGE"), "filename_prefix": Input("STRING", "ComfyUI")},
        output_node=True,
    ),
    "PreviewImage": Node("Preview Image", "image", {"images": Input("IMAGE")}, output_node=True),
}
SAMPLERS = ("KSampler", "KSamplerAdvanced")
LATENTS = ("EmptyLatentImage", "EmptySD3LatentImage")
SEED_INPUT = {"KSampler": "seed", "KSamplerAdvanced": "noise_seed"}
ANY_NAME = ("text_encoders", "vaes")  # the model's own encoders and VAE draw, whatever file is named
MODEL_NAMES = ("checkpoints", "unets")
NAME_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin", ".gguf")


@dataclass(frozen=True)
class Offer:
    """What the server offers a graph: the choices `/object_info` lists, and how to check a model's name, pair a
    sampler with a schedule, and open an uploaded picture (each raises `engine.InvalidRequest`)."""

    lists: dict[str, tuple[str, ...]]  # checkpoints, unets, text_encoders, vaes, loras, samplers, schedulers,
    # upscalers (the networks), uploads
    check_model: Callable[[str], None]
    scheduler: Callable[[str, str], str]  # (sampler_name, scheduler) -> our scheduler kind
    picture: Callable[[str], Image.Image]


# ---- ComfyUI's /object_info -------------------------------------------------------------------------


def _spec(offer: Offer, spec: Input) -> list:
    if spec.kind in LINK_KINDS:
        return [spec.kind]
    if spec.kind == "CHOICE":
        listed = offer.lists.get(spec.choices, ()) if isinstance(spec.choices, str) else spec.choices
        extra = {"image_upload": True} if spec.choices == "uploads" else {}
        if spec.default is not None:
            extra["default"] = spec.default
        return [list(listed), extra]
    options: dict[str, Any] = {"default": spec.default}
    if spec.low is not None:
        options.update(min=spec.low, max=spec.high)
    if spec.kind == "FLOAT":
        options["step"] = 0.01
    if spec.kind == "STRING":
        options["multiline"] = spec.default == ""
    return [spec.kind, options]


def object_info(offer: Offer) -> dict[str, dict]:
    """ComfyUI's description of every node offered here, with the server's own choices."""
    info = {}
    for name, node in NODES.items():
        required = {k: _spec(offer, v) for k, v in node.inputs.items() if not v.optional}
        optional = {k: _spec(offer, v) for k, v in node.inputs.items() if v.optional}
        info[name] = {
            "input": {"required": required, **({"optional": optional} if optional else {})},
            "input_order": {"required": list(required), **({"optional": list(optional)} if optional else {})},
            "output": list(node.outputs),
            "output_is_list": [False] * len(node.outputs),
            "output_name": list(node.outputs),
            "name": name,
            "display_name": node.display,
            "description": "",
            "python_module": "nodes",
            "category": node.category,
            "output_node": node.output_node,
        }
    return info
