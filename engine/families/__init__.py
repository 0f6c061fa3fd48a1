"""Model families as records: one module per family, one registry here.

`sd.py` (Stable Diffusion 1.x/2.x), `sdxl.py` (XL), `lcm.py` (SD's latent consistency distillations) and `sd3.py`
(SD 3 and 3.5: MMDiT, CLIP and T5, flow matching) and `flux.py` (FLUX.1 schnell and dev, on SD3's T5, flow
matching and 16-channel VAE) each
declare a `FAMILY` (`base.Family`: components and their classes, prompt encoding, the denoiser call, guidance
style, latent format, defaults, layout checks) and its `VARIANTS` (tasks: text-to-image, inpainting).
`loader.py` reads a diffusers folder into a `LoadedModel` by asking the folder's family; `single_file.py` reads
a single-file checkpoint in the original layout as one, with a folder's configs, and `transformer_file.py` a FLUX.1
or SD 3 transformer file (GGUF too), with a folder's text encoders and VAE. `qwen_prompt.py` says how the
pipelines on a Qwen3 text encoder encode a prompt (chat template options, length, hidden layers). A new family
is one new module and one line in `FAMILIES`.

May import: `engine.errors`, `engine.models`, `engine.schedulers`, `engine.loading`. Imported by `sampling`,
`serving` and `compat`; a family's name appears as a string nowhere outside this folder.
"""

from __future__ import annotations

from ..errors import ConfigError
from . import flux, lcm, sd, sd3, sdxl
from .base import Conditioning, Family, LatentFormat, Models, Variant

FAMILIES: dict[str, Family] = {
    family.name: family for family in (sd.FAMILY, sdxl.FAMILY, lcm.FAMILY, sd3.FAMILY, flux.FAMILY)
}
DEFAULT_FAMILY = sd.FAMILY.name  # what a `Plan` that names none samples with
VARIANTS: tuple[Variant, ...] = (*sd.VARIANTS, *sdxl.VARIANTS, *lcm.VARIANTS, *sd3.VARIANTS, *flux.VARIANTS)
PIPELINE_FAMILIES: dict[str, str] = {name: v.family for v in VARIANTS for name in v.pipelines}
# Each family's prompt encoder by name: what `Plan.family` selects inside the programs.
ENCODERS = {name: family.encode for name, family in FAMILIES.items()}


def family_of(class_name: str) -> Family | None:
    """The family a model_index.json `_class_name` belongs to, or None when we have no such pipeline."""
    name = PIPELINE_FAMILIES.get(class_name)
    return None if name is None else FAMILIES[name]


def find(family: str, unet_in_channels: int, where: str = "model") -> Variant:
    """The variant of a folder: its family and what its UNet reads."""
    for variant in VARIANTS:
        if variant.family == family and variant.unet_in_channels == unet_in_channels:
            return variant
    raise ConfigError(
        f"{where}: a {family} UNet with in_channels={unet_in_channels} is neither text-to-image (4) nor inpainting (9)"
    )


__all__ = [
    "DEFAULT_FAMILY",
    "ENCODERS",
    "FAMILIES",
    "PIPELINE_FAMILIES",
    "VARIANTS",
    "Conditioning",
    "Family",
    "LatentFormat",
    "Models",
    "Variant",
    "family_of",
    "find",
]
