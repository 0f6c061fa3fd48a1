"""Model families as records: one module per family, one registry here.

`sd.py` (Stable Diffusion 1.x/2.x), `sdxl.py` (XL), `lcm.py` (SD's latent consistency distillations) and `sd3.py`
(SD 3 and 3.5: MMDiT, CLIP and T5, flow matching) and `flux.py` (FLUX.1 schnell and dev, on SD3's T5, flow
matching and 16-channel VAE), `flux_kontext.py` (FLUX.1 Kontext: dev editing a reference picture), `z_image.py`
(Z-Image and its Turbo, on Qwen3) and `flux2.py` (FLUX.2 [klein], on Qwen3, with the 32-channel VAE's normalised 2x2
patches as latents) each
declare a `FAMILY` (`base.Family`: components and their classes, layout checks, and four parts: the text side, the
denoiser, the latent format, the sampling defaults) and its `VARIANTS` (tasks: text-to-image, inpainting, told from
the folder's widths by `find`).
`loader.py` reads a diffusers folder into a `LoadedModel` by asking the folder's family; `single_file.py` reads
a single-file checkpoint in the original layout as one, with a folder's configs, and `transformer_file.py` a FLUX.1
(Kontext too), SD 3, Z-Image or FLUX.2 [klein] transformer file (GGUF too), with a folder's text encoders and VAE.
`qwen_prompt.py` says how the pipelines on a Qwen3 text encoder encode a prompt (chat template options, length, hidden layers). A new family
is one new module (its parts, most of them shared ones) and its name in the `FAMILIES` and `VARIANTS` lines.

May import: `engine.errors`, `engine.models`, `engine.schedulers`, `engine.loading`. Imported by `sampling`,
`serving` and `compat`; a family's name appears as a string nowhere outside this folder.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from . import flux, flux2, flux_kontext, lcm, sd, sd3, sdxl, z_image
from .base import Conditioning, Denoiser, Family, LatentFormat, Models, Sampling, TextSide, Variant

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        sd.FAMILY,
        sdxl.FAMILY,
        lcm.FAMILY,
        sd3.FAMILY,
        flux.FAMILY,
        flux_kontext.FAMILY,
        z_image.FAMILY,
        flux2.FAMILY,
    )
}
DEFAULT_FAMILY = sd.FAMILY.name  # what a `Plan` that names none samples with
VARIANTS: tuple[Variant, ...] = (
    *sd.VARIANTS,
    *sdxl.VARIANTS,
    *lcm.VARIANTS,
    *sd3.VARIANTS,
    *flux.VARIANTS,
    *flux_kontext.VARIANTS,
    *z_image.VARIANTS,
    *flux2.VARIANTS,
)
PIPELINE_FAMILIES: dict[str, str] = {name: v.family for v in VARIANTS for name in v.pipelines}
# Each family's prompt encoder by name: what `Plan.family` selects inside the programs.
ENCODERS = {name: family.text.encode for name, family in FAMILIES.items()}


def family_of(class_name: str) -> Family | None:
    """The family a model_index.json `_class_name` belongs to, or None when we have no such pipeline."""
    name = PIPELINE_FAMILIES.get(class_name)
    return None if name is None else FAMILIES[name]


def find(family: str, in_channels: int, vae_config: Any, where: str = "model") -> Variant:
    """The variant of a folder: its family and what its denoiser reads (`in_channels`) over its VAE's latents."""
    latent = FAMILIES[family].latent
    task = latent.task(in_channels, vae_config)
    for variant in VARIANTS:
        if variant.family == family and variant.task == task:
            return variant
    raise ConfigError(
        f"{where}: a {family} denoiser with in_channels={in_channels} fits no task over the VAE's "
        f"{vae_config.latent_channels} latent channels: it would read {latent.widths(vae_config)}"
    )


__all__ = [
    "DEFAULT_FAMILY",
    "ENCODERS",
    "FAMILIES",
    "PIPELINE_FAMILIES",
    "VARIANTS",
    "Conditioning",
    "Denoiser",
    "Family",
    "LatentFormat",
    "Models",
    "Sampling",
    "TextSide",
    "Variant",
    "family_of",
    "find",
]
