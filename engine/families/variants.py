"""What each kind of model is, as data: one `Variant` per family and task.

A family is the text side and the sizes (SD 1.x/2.x: one CLIP encoder; SDXL: two, and `text_time`
conditioning); a task is what the UNet was trained for (text-to-image, or inpainting with a 9-channel
UNet that also reads the mask and the masked picture). Loading, serving and the page ask the record
instead of branching on a family string. A folder's variant comes from its `model_index.json` class and
its UNet's `in_channels`, so an inpainting UNet is recognised even in a folder saved as text-to-image.
A ControlNet variant (the residuals' model) is a record like these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..errors import ConfigError, InvalidRequest

_SD_TEXT = dict(text_encoders=("text_encoder",), tokenizers=("tokenizer",))
_SDXL_TEXT = dict(text_encoders=("text_encoder", "text_encoder_2"), tokenizers=("tokenizer", "tokenizer_2"))
# The scheduler here is a fallback: a folder's own scheduler class, when we have it, comes first.
_SD_DEFAULTS = MappingProxyType({"num_inference_steps": 50, "guidance_scale": 7.5, "scheduler": "pndm"})
_SDXL_DEFAULTS = MappingProxyType({"num_inference_steps": 25, "guidance_scale": 5.0, "scheduler": "euler"})


@dataclass(frozen=True)
class Variant:
    family: str  # "sd" | "sdxl": which text encoders and conditioning (pipeline.ENCODERS)
    task: str  # "text-to-image" | "inpainting"
    label: str  # for people
    pipelines: tuple[str, ...]  # model_index.json `_class_name`s saved for this variant
    text_encoders: tuple[str, ...]  # sub-folders, in the order the encoders run
    tokenizers: tuple[str, ...]
    unet_in_channels: int  # 4: latents; 9: latents, mask and masked-picture latents
    max_side: int  # pixels: twice the side the family was trained at
    defaults: MappingProxyType = field(compare=False)  # num_inference_steps, guidance_scale, scheduler
    strength: float  # image-to-image default, as the family's diffusers img2img pipeline
    inpaint_strength: float  # inpainting default, as the family's diffusers inpaint pipeline
    needs: frozenset[str] = frozenset()  # picture inputs a request must bring

    def check(self, image: Any, mask_image: Any) -> None:
        """The picture inputs this model can use; the message says what to change."""
        given = {name for name, value in (("image", image), ("mask_image", mask_image)) if value is not None}
        missing = sorted(self.needs - given)
        if missing:
            raise InvalidRequest(
                f"this {self.label} model repaints part of a picture: give {' and '.join(missing)} "
                "(white in the mask is repainted)"
            )

    def default_strength(self, mask_image: Any) -> float:
        return self.inpaint_strength if mask_image is not None else self.strength


VARIANTS: tuple[Variant, ...] = (
    Variant(
        "sd",
        "text-to-image",
        "Stable Diffusion",
        ("StableDiffusionPipeline", "StableDiffusionImg2ImgPipeline"),
        **_SD_TEXT,
        unet_in_channels=4,
        max_side=1024,
        defaults=_SD_DEFAULTS,
        strength=0.8,
        inpaint_strength=1.0,
    ),
    Variant(
        "sd",
        "inpainting",
        "Stable Diffusion Inpainting",
        ("StableDiffusionInpaintPipeline",),
        **_SD_TEXT,
        unet_in_channels=9,
        max_side=1024,
        defaults=_SD_DEFAULTS,
        strength=1.0,
        inpaint_strength=1.0,
        needs=frozenset({"image", "mask_image"}),
    ),
    Variant(
        "sdxl",
        "text-to-image",
        "Stable Diffusion XL",
        ("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline"),
        **_SDXL_TEXT,
        unet_in_channels=4,
        max_side=2048,
        defaults=_SDXL_DEFAULTS,  # as the SDXL-on-TPU write-up
        strength=0.3,
        inpaint_strength=0.9999,
    ),
    Variant(
        "sdxl",
        "inpainting",
        "Stable Diffusion XL Inpainting",
        ("StableDiffusionXLInpaintPipeline",),
        **_SDXL_TEXT,
        unet_in_channels=9,
        max_side=2048,
        defaults=_SDXL_DEFAULTS,
        strength=0.9999,
        inpaint_strength=0.9999,
        needs=frozenset({"image", "mask_image"}),
    ),
)

PIPELINE_FAMILIES: dict[str, str] = {name: v.family for v in VARIANTS for name in v.pipelines}


def family_of(class_name: str) -> str | None:
    """The family a model_index.json `_class_name` belongs to, or None when we have no such pipeline."""
    return PIPELINE_FAMILIES.get(class_name)


def find(family: str, unet_in_channels: int, where: str = "model") -> Variant:
    """The variant of a folder: its family and what its UNet reads."""
    for variant in VARIANTS:
        if variant.family == family and variant.unet_in_channels == unet_in_channels:
            return variant
    raise ConfigError(
        f"{where}: a {family} UNet with in_channels={unet_in_channels} is neither text-to-image (4) nor inpainting (9)"
    )
