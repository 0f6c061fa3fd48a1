"""Frozen configs that mirror the `config.json` of each diffusers/transformers model folder.

Field names are copied verbatim from diffusers (`UNet2DConditionModel`, `AutoencoderKL`) and
transformers (`CLIPTextConfig`), misnomers included, so a folder's JSON maps onto them one to
one. Frozen dataclasses are hashable, so a config can be a static argument of `jax.jit`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ..errors import ConfigError


def _tupled(value: Any) -> Any:
    # JSON lists become tuples so that the config stays hashable.
    if isinstance(value, list):
        return tuple(_tupled(v) for v in value)
    return value


class _FromJson:
    # Whether a key this config does not know stops the load: diffusers configs name every
    # architecture switch, so an unknown key there may be one we would silently ignore.
    _strict: bool = True

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "config") -> Any:
        names = {f.name for f in dataclasses.fields(cls)}
        kept = {k: _tupled(v) for k, v in raw.items() if not k.startswith("_")}
        unknown = sorted(set(kept) - names)
        if unknown and cls._strict:
            raise ConfigError(f"{where}: unknown keys for {cls.__name__}: {', '.join(unknown)}")
        config = cls(**{k: v for k, v in kept.items() if k in names})
        config.validate(where)
        return config

    @classmethod
    def from_json(cls, path: str | Path) -> Any:
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ConfigError(f"cannot read {path}: {err}") from err
        return cls.from_dict(raw, where=str(path))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self, where: str) -> None:
        pass


def _require(ok: bool, where: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{where}: {message}")


@dataclasses.dataclass(frozen=True)
class UNetConfig(_FromJson):
    """`UNet2DConditionModel` config (unet/config.json)."""

    sample_size: int | None = None  # latent side the model was trained at (64 for SD1.5 512px)
    in_channels: int = 4
    out_channels: int = 4
    center_input_sample: bool = False
    flip_sin_to_cos: bool = True
    freq_shift: int = 0
    down_block_types: tuple[str, ...] = (
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "CrossAttnDownBlock2D",
        "DownBlock2D",
    )
    mid_block_type: str | None = "UNetMidBlock2DCrossAttn"
    up_block_types: tuple[str, ...] = (
        "UpBlock2D",
        "CrossAttnUpBlock2D",
        "CrossAttnUpBlock2D",
        "CrossAttnUpBlock2D",
    )
    only_cross_attention: bool | tuple[bool, ...] = False
    block_out_channels: tuple[int, ...] = (320, 640, 1280, 1280)
    layers_per_block: int | tuple[int, ...] = 2
    downsample_padding: int = 1
    mid_block_scale_factor: float = 1.0
    dropout: float = 0.0
    act_fn: str = "silu"
    norm_num_groups: int | None = 32
    norm_eps: float = 1e-5
    cross_attention_dim: int | tuple[int, ...] = 1280
    transformer_layers_per_block: int | tuple[int, ...] = 1
    reverse_transformer_layers_per_block: tuple[int, ...] | None = None
    encoder_hid_dim: int | None = None
    encoder_hid_dim_type: str | None = None
    # Misnomer kept from diffusers: for SD1.x/2.x this is the number of heads, not their size.
    attention_head_dim: int | tuple[int, ...] = 8
    num_attention_heads: int | tuple[int, ...] | None = None
    dual_cross_attention: bool = False
    use_linear_projection: bool = False
    class_embed_type: str | None = None
    addition_embed_type: str | None = None
    addition_time_embed_dim: int | None = None
    num_class_embeds: int | None = None
    upcast_attention: bool = False
    resnet_time_scale_shift: str = "default"
    resnet_skip_time_act: bool = False
    resnet_out_scale_factor: float = 1.0
    time_embedding_type: str = "positional"
    time_embedding_dim: int | None = None
    time_embedding_act_fn: str | None = None
    timestep_post_act: str | None = None
    time_cond_proj_dim: int | None = None  # guidance-distilled UNets (LCM) read the guidance scale's embedding
    conv_in_kernel: int = 3
    conv_out_kernel: int = 3
    projection_class_embeddings_input_dim: int | None = None
    attention_type: str = "default"
    class_embeddings_concat: bool = False
    mid_block_only_cross_attention: bool | None = None
    cross_attention_norm: str | None = None
    addition_embed_type_num_heads: int = 64

    def validate(self, where: str) -> None:
        n = len(self.block_out_channels)
        _require(len(self.down_block_types) == n, where, "down_block_types and block_out_channels differ in length")
        _require(len(self.up_block_types) == n, where, "up_block_types and block_out_channels differ in length")
        known_down = {"CrossAttnDownBlock2D", "DownBlock2D"}
        known_up = {"CrossAttnUpBlock2D", "UpBlock2D"}
        for kind in self.down_block_types:
            _require(kind in known_down, where, f"down block {kind!r} is not supported")
        for kind in self.up_block_types:
            _require(kind in known_up, where, f"up block {kind!r} is not supported")
        _require(
            self.mid_block_type in ("UNetMidBlock2DCrossAttn", None),
            where,
            f"mid_block_type {self.mid_block_type!r} is not supported",
        )
        _require(self.act_fn == "silu", where, f"act_fn {self.act_fn!r} is not supported")
        _require(
            self.addition_embed_type in (None, "text_time"), where, "only addition_embed_type 'text_time' is supported"
        )
        unsupported = {
            "class_embed_type": None,
            "encoder_hid_dim_type": None,
            "dual_cross_attention": False,
            "resnet_time_scale_shift": "default",
            "time_embedding_type": "positional",
            "attention_type": "default",
            "only_cross_attention": False,
            "resnet_skip_time_act": False,
            "resnet_out_scale_factor": 1.0,
            "conv_in_kernel": 3,
            "conv_out_kernel": 3,
            "time_embedding_act_fn": None,
            "timestep_post_act": None,
            "num_class_embeds": None,
            "cross_attention_norm": None,
            "mid_block_only_cross_attention": None,
        }
        for name, expected in unsupported.items():
            value = getattr(self, name)
            _require(value == expected, where, f"{name}={value!r} is not supported (only {expected!r})")

    @property
    def num_blocks(self) -> int:
        return len(self.block_out_channels)

    def per_block(self, name: str) -> tuple:
        value = getattr(self, name)
        return value if isinstance(value, tuple) else (value,) * self.num_blocks

    @property
    def heads_per_block(self) -> tuple[int, ...]:
        # diffusers: num_attention_heads defaults to attention_head_dim (the misnomer above).
        return self.per_block("num_attention_heads" if self.num_attention_heads is not None else "attention_head_dim")

    @property
    def time_embed_dim(self) -> int:
        return self.time_embedding_dim or self.block_out_channels[0] * 4


@dataclasses.dataclass(frozen=True)
class VAEConfig(_FromJson):
    """`AutoencoderKL` config (vae/config.json)."""

    in_channels: int = 3
    out_channels: int = 3
    down_block_types: tuple[str, ...] = ("DownEncoderBlock2D",)
    up_block_types: tuple[str, ...] = ("UpDecoderBlock2D",)
    block_out_channels: tuple[int, ...] = (64,)
    layers_per_block: int = 1
    act_fn: str = "silu"
    latent_channels: int = 4
    norm_num_groups: int = 32
    sample_size: int = 32
    scaling_factor: float = 0.18215  # latents are multiplied by this before the UNet sees them
    shift_factor: float | None = None
    latents_mean: tuple[float, ...] | None = None
    latents_std: tuple[float, ...] | None = None
    force_upcast: bool = True  # fp16 overflows in this VAE; we never run it in fp16
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent along a side: each encoder block but the last halves the sides (8 for SD's VAEs)."""
        return 2 ** (len(self.block_out_channels) - 1)

    @property
    def decoder_channels(self) -> tuple[int, ...]:
        """The decoder's block widths: the encoder's here; FLUX.2's VAE may name its own."""
        return self.block_out_channels

    def validate(self, where: str) -> None:
        for kind in self.down_block_types:
            _require(kind == "DownEncoderBlock2D", where, f"down block {kind!r} is not supported")
        for kind in self.up_block_types:
            _require(kind == "UpDecoderBlock2D", where, f"up block {kind!r} is not supported")
        _require(self.act_fn == "silu", where, f"act_fn {self.act_fn!r} is not supported")


TINY_VAE_ACTIVATIONS = ("relu", "silu", "swish", "gelu", "mish")  # diffusers' `get_activation` names


@dataclasses.dataclass(frozen=True)
class AutoencoderTinyConfig(_FromJson):
    """`AutoencoderTiny` config (TAESD: madebyollin/taesd, taesdxl, taesd3, taef1 config.json; TAEF2 with
    `use_midblock_gn`).

    Beside `VAEConfig`'s names that the pipeline reads (`scaling_factor`, `shift_factor`, `latent_channels`,
    `block_out_channels`, `force_upcast`), `latents_mean`/`latents_std` are None as diffusers finds them.
    """

    in_channels: int = 3
    out_channels: int = 3
    encoder_block_out_channels: tuple[int, ...] = (64, 64, 64, 64)
    decoder_block_out_channels: tuple[int, ...] = (64, 64, 64, 64)
    act_fn: str = "relu"
    upsample_fn: str = "nearest"
    latent_channels: int = 4
    upsampling_scaling_factor: int = 2
    num_encoder_blocks: tuple[int, ...] = (1, 3, 3, 3)
    num_decoder_blocks: tuple[int, ...] = (3, 3, 3, 1)
    latent_magnitude: float = 3  # scale_latents/unscale_latents only: latents <-> [0, 1] for storing as bytes
    latent_shift: float = 0.5
    force_upcast: bool = False
    scaling_factor: float = 1.0  # TAESD/TAESDXL encode straight to the UNet's scaled latents
    shift_factor: float = 0.0
    # diffusers writes the decoder's widths here (`register_to_config`) whatever the file said; so do we.
    block_out_channels: tuple[int, ...] | None = None
    # TAEF2 (FLUX.2): a GroupNorm branch in the blocks at the latents' resolution (taesd.py's `use_midblock_gn`;
    # `models.autoencoder_tiny`). diffusers' `AutoencoderTiny` has no such switch: a TAEF2 folder names it here.
    use_midblock_gn: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_out_channels", self.decoder_block_out_channels)

    latents_mean = None  # class attributes, not fields: no TAESD config.json carries them
    latents_std = None

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent along a side: 8 for TAESD (three upsamplings by 2)."""
        return self.upsampling_scaling_factor ** (len(self.decoder_block_out_channels) - 1)

    def validate(self, where: str) -> None:
        for part in ("encoder", "decoder"):
            widths, counts = getattr(self, f"{part}_block_out_channels"), getattr(self, f"num_{part}_blocks")
            _require(
                len(widths) == len(counts), where, f"{part}_block_out_channels and num_{part}_blocks differ in length"
            )
            _require(len(widths) >= 1, where, f"{part}_block_out_channels is empty")
            # diffusers builds each stage at its own width but never converts between them: only one width runs.
            _require(len(set(widths)) == 1, where, f"{part}_block_out_channels {widths} must all be equal")
        _require(self.act_fn in TINY_VAE_ACTIVATIONS, where, f"act_fn {self.act_fn!r} is not supported")
        _require(
            self.upsample_fn == "nearest", where, f"upsample_fn {self.upsample_fn!r} is not supported (only 'nearest')"
        )
        factor = self.upsampling_scaling_factor
        _require(
            isinstance(factor, int) and factor >= 1,
            where,
            f"upsampling_scaling_factor {factor!r} is not a whole number",
        )
        down = 2 ** (len(self.encoder_block_out_channels) - 1)  # each encoder stage after the first halves the sides
        _require(
            down == self.vae_scale_factor,
            where,
            f"the encoder shrinks sides {down}x but the decoder grows them {self.vae_scale_factor}x",
        )


@dataclasses.dataclass(frozen=True)
class CLIPTextConfig(_FromJson):
    """transformers `CLIPTextConfig` (text_encoder/config.json), architecture fields only."""

    # transformers configs carry dozens of keys with no bearing on the network (generation
    # settings, labels, versions; older releases wrote every one of them), so the unknown ones
    # are ignored here; `model_type` tells whether this is a CLIP text encoder at all.
    _strict = False

    vocab_size: int = 49408
    hidden_size: int = 512
    intermediate_size: int = 2048
    projection_dim: int = 512  # only CLIPTextModelWithProjection (SDXL's second encoder) uses it
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"  # SD1.x: quick_gelu; SD2.x/OpenCLIP: gelu
    layer_norm_eps: float = 1e-5
    eos_token_id: int = 49407  # legacy configs say 2, which means "the largest id" for pooling
    model_type: str = "clip_text_model"

    def validate(self, where: str) -> None:
        _require(
            self.model_type == "clip_text_model",
            where,
            f"model_type {self.model_type!r} is not a CLIP text encoder ('clip_text_model')",
        )
        _require(self.hidden_act in ("quick_gelu", "gelu"), where, f"hidden_act {self.hidden_act!r} is not supported")
        _require(self.hidden_size % self.num_attention_heads == 0, where, "hidden_size must divide into heads")


@dataclasses.dataclass(frozen=True)
class CLIPVisionConfig(_FromJson):
    """transformers `CLIPVisionConfig` (the safety checker's `vision_config`), architecture fields only."""

    _strict = False  # transformers' bookkeeping keys, as for the text encoder

    hidden_size: int = 768
    intermediate_size: int = 3072
    projection_dim: int = 512  # CLIPVisionModelWithProjection's; the safety checker projects with its own
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224  # the side the position embeddings were learnt for; the input must have it
    patch_size: int = 32  # SD's safety checker is ViT-L/14: 14
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    model_type: str = "clip_vision_model"

    def validate(self, where: str) -> None:
        _require(
            self.model_type == "clip_vision_model",
            where,
            f"model_type {self.model_type!r} is not a CLIP vision tower ('clip_vision_model')",
        )
        _require(self.hidden_act in ("quick_gelu", "gelu"), where, f"hidden_act {self.hidden_act!r} is not supported")
        _require(self.hidden_size % self.num_attention_heads == 0, where, "hidden_size must divide into heads")
        _require(self.num_channels == 3, where, "only RGB (num_channels 3) is supported")
        _require(isinstance(self.image_size, int), where, "only square image_size is supported")
        _require(self.image_size % self.patch_size == 0, where, "image_size must be a multiple of patch_size")

    @property
    def num_positions(self) -> int:
        return (self.image_size // self.patch_size) ** 2 + 1  # the patches and the class token


@dataclasses.dataclass(frozen=True)
class SafetyCheckerConfig(_FromJson):
    """transformers `CLIPConfig` as diffusers' `StableDiffusionSafetyChecker` reads it (safety_checker/config.json).

    Only the vision half and `projection_dim` matter: the checker has no text tower.
    """

    _strict = False

    projection_dim: int = 512  # visual_projection's width, and the concept embeddings'
    vision_config: CLIPVisionConfig = CLIPVisionConfig()
    model_type: str = "clip"

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "config") -> SafetyCheckerConfig:
        # transformers: a legacy `vision_config_dict` (SD 1.x folders carry one) replaces
        # `vision_config` whole, its missing keys taking the defaults.
        vision = raw.get("vision_config_dict")
        vision = raw.get("vision_config") if vision is None else vision
        flat = {k: v for k, v in raw.items() if not k.startswith(("vision_config", "text_config"))}
        config = super().from_dict(flat, where)
        return dataclasses.replace(config, vision_config=CLIPVisionConfig.from_dict(vision or {}, f"{where}: vision"))

    def validate(self, where: str) -> None:
        _require(self.model_type == "clip", where, f"model_type {self.model_type!r} is not a CLIP model ('clip')")


OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PIL_BICUBIC = 3  # PIL's code for bicubic resampling, as `resample` says it


@dataclasses.dataclass(frozen=True)
class FeatureExtractorConfig(_FromJson):
    """transformers `CLIPImageProcessor` (feature_extractor/preprocessor_config.json): what the safety checker sees.

    `size` and `crop_size` are held as numbers; the file writes them as dicts ({"shortest_edge": 224},
    {"height": 224, "width": 224}) or, in older folders, as plain ints.
    """

    _strict = False  # processor class names and flags with no effect here (do_convert_rgb)

    do_resize: bool = True
    size: int = 224  # the shortest edge after the resize; the other keeps the aspect ratio
    resample: int = PIL_BICUBIC
    do_center_crop: bool = True
    crop_size: tuple[int, int] = (224, 224)  # (height, width)
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "config") -> FeatureExtractorConfig:
        raw = dict(raw)
        size, crop = raw.get("size", cls.size), raw.get("crop_size", cls.crop_size)
        if isinstance(size, dict):
            _require(set(size) == {"shortest_edge"}, where, f"size {size} is not supported (only shortest_edge)")
            raw["size"] = size["shortest_edge"]
        if isinstance(crop, dict):
            raw["crop_size"] = (crop["height"], crop["width"])
        elif isinstance(crop, int):
            raw["crop_size"] = (crop, crop)
        return super().from_dict(raw, where)

    def validate(self, where: str) -> None:
        _require(isinstance(self.size, int), where, f"size {self.size!r} is not supported (only shortest_edge)")
        _require(
            self.resample == PIL_BICUBIC or not self.do_resize,
            where,
            f"resample {self.resample} is not supported (only {PIL_BICUBIC}, bicubic)",
        )
        _require(
            not (self.do_resize and self.do_center_crop) or max(self.crop_size) <= self.size,
            where,
            f"crop_size {self.crop_size} is larger than the resized shortest edge {self.size}",
        )
        _require(len(self.image_mean) == len(self.image_std) == 3, where, "image_mean and image_std need 3 values")
