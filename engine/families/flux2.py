"""FLUX.2 [klein] 4B and 9B: a Qwen3 text encoder's layers 9, 18 and 27, the FLUX.2 transformer, the 32-channel VAE.

Mirrors diffusers' `Flux2KleinPipeline` (Black Forest Labs 2026). The prompt is one user message in Qwen3's chat
template with an empty think block, padded to 512 tokens; the encoder sees the attention mask and its hidden states
after layers 9, 18 and 27 sit side by side, padding rows included (`qwen_prompt.FLUX2_KLEIN`). The latents are the
VAE's 32 channels, patchified 2x2 and normalised by the VAE's batch-norm statistics (`models.vae_flux2`): the steps
draw the pipeline's grid [h/16, w/16, 128] itself (`LatentFormat.vae_patch`), whose cells are the transformer's
tokens, and the VAE's side normalises on the way in and denormalises on the way out; a tiny VAE given in its place
(TAEF2, `load_pipeline(vae=...)`) works in the normalised space itself, unpatchified. The schedule is flow matching on
the sigmas linspace(1, 1/n, n), shifted by `compute_empirical_mu`, which reads the step count as well as the token
count.
Guidance: the distilled folders (model_index.json `is_distilled`: 4 steps) take none, whatever the scale; the base
folders take a second, unconditional batch row at scale > 1 (50 steps at 4), whose prompt is "" unless the request
brings a negative prompt.
Editing (`GenerationRequest.references`, up to 4 pictures): each is cut as the pipeline cuts it (`prepare_reference`),
encoded like the latents in the admit program and read by the transformer as tokens after the latent's, at times 10,
20, ...; the picture takes the first reference's size when the request gives none.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from PIL import Image

from ..errors import ConfigError
from ..loading.host_encoder import HostEncoder
from ..loading.qwen_tokenizer import QwenTokenizer
from ..models import qwen3
from ..models.autoencoder_tiny import AutoencoderTiny
from ..models.qwen3 import Qwen3Config, Qwen3Model
from ..models.transformer_flux import TIME_FACTOR
from ..models.transformer_flux2 import Flux2Transformer2DModel, Flux2TransformerConfig
from ..models.vae_flux2 import AutoencoderKLFlux2, Flux2VAEConfig, patchify, unpatchify
from .base import Conditioning, Denoiser, Family, LatentFormat, Models, References, text_to_image
from .qwen_prompt import FLUX2_KLEIN, folder_tokenizer
from .sd3 import flow_sampling

REFERENCE_PIXELS = 1024 * 1024  # a larger reference picture is shrunk to about this many pixels
MAX_REFERENCES = 4  # reference pictures a request may bring
DISTILLED = {"num_inference_steps": 4, "guidance_scale": 1.0}  # the pipeline ignores any scale for these
BASE = {"num_inference_steps": 50, "guidance_scale": 4.0}  # Flux2KleinPipeline's own defaults


def empirical_mu(image_tokens: int, steps: int) -> float:
    """`compute_empirical_mu`: the schedule's shift for a picture of `image_tokens` latent tokens in `steps` steps.

    Two lines fitted in the token count, at 10 and at 200 steps, between which mu is linear in the step count;
    past 4300 tokens the 200-step line alone.
    """
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    m_200 = a2 * image_tokens + b2
    if image_tokens > 4300:
        return float(m_200)
    m_10 = a1 * image_tokens + b1
    a = (m_200 - m_10) / 190.0
    return float(a * steps + (m_200 - 200.0 * a))


def is_distilled(index: Mapping[str, Any]) -> bool:
    """Whether model_index.json marks a step-distilled folder (`is_distilled`, the pipeline's own config)."""
    return bool(index.get("is_distilled", False))


def check_layout(configs: Mapping[str, Any], where: str) -> None:
    """The widths that must agree between the text encoder, the transformer and the VAE."""
    transformer: Flux2TransformerConfig = configs["transformer"]
    qwen: Qwen3Config = configs["text_encoder"]
    vae: Flux2VAEConfig = configs["vae"]
    problems = []
    try:
        FLUX2_KLEIN.layers(qwen)
    except ValueError as err:
        problems.append(f"the text encoder cannot give layers {FLUX2_KLEIN.hidden_layers}: {err}")
    width = len(FLUX2_KLEIN.hidden_layers) * qwen.hidden_size
    if width != transformer.joint_attention_dim:
        problems.append(
            f"{len(FLUX2_KLEIN.hidden_layers)} of the text encoder's layers are {width} wide, "
            f"joint_attention_dim is {transformer.joint_attention_dim}"
        )
    if vae.patched_channels != transformer.in_channels:
        problems.append(
            f"the VAE's {vae.latent_channels} latent channels in 2x2 patches are {vae.patched_channels}, "
            f"the transformer reads {transformer.in_channels}"
        )
    if problems:
        raise ConfigError(f"{where}: not a consistent FLUX.2 [klein] model: " + "; ".join(problems))


def prompt_inputs(
    plan: Any, prompt: str, negative_prompt: str | None, tokenizer: QwenTokenizer, host: HostEncoder | None
) -> dict:
    """The prompt (and, guided, the negative prompt: "" unless the request brings one) as the pipeline tokenizes
    them, ids int32 and mask bool [1, 512]; with the text encoder on the host (`loading.host_encoder.host_qwen3`),
    its embeddings [1, 512, 3 * hidden] instead."""
    texts = {"qwen": prompt, **({"neg_qwen": negative_prompt or ""} if plan.guidance else {})}
    out = {}
    for key, text in texts.items():
        ids, mask, _ = FLUX2_KLEIN.tokenize(tokenizer, [text], what="prompt" if key == "qwen" else "negative prompt")
        out |= {f"{key}_ids": ids, f"{key}_mask": mask} if host is None else {f"{key}_embeds": host(ids, mask)}
    return out


def extra_inputs(index: Mapping[str, Any], vae_scale_factor: int, folder: Any, host: Any) -> Any:
    """The family's per-image inputs: the folder's Qwen tokenizer reads both prompts."""
    return functools.partial(prompt_inputs, tokenizer=folder_tokenizer(folder), host=host)


def encode(models: Models, ids: jax.Array, extra: dict, plan: Any, negative: bool) -> Conditioning:
    """The Qwen3 encoder's layers 9, 18 and 27 side by side [batch, 512, 3 * hidden], from `extra`'s ids and mask,
    or as the host encoder brought them (`ids` is empty: no CLIP reads the prompt)."""
    key = "neg_qwen" if negative else "qwen"
    if f"{key}_embeds" in extra:
        return Conditioning(extra[f"{key}_embeds"])
    encoder: Qwen3Model = models.text_encoder
    states = encoder(extra[f"{key}_ids"], extra[f"{key}_mask"])
    return Conditioning(FLUX2_KLEIN.embeds(encoder.config, states))


def denoise(models: Models, x: jax.Array, timesteps: jax.Array, kv: Any, cond: Conditioning, residuals: tuple):
    """The velocity on the latent grid [batch, h/16, w/16, 128], fed as the pipeline feeds it: t / 1000, no
    guidance embedding; the reference pictures' grids (`Conditioning.references`) as tokens after the latent's."""
    return models.transformer(x, timesteps / TIME_FACTOR, kv, references=cond.references or ())


def prepare_reference(picture: Image.Image, width: int, height: int) -> np.ndarray:
    """A reference picture as Flux2KleinPipeline encodes it, [height, width, 3] in [-1, 1]: shrunk by Lanczos to
    about `REFERENCE_PIXELS` when larger (`_resize_to_target_area`), its middle cut to width x height (the sizes
    `engine.request_references.reference_size` gives: its sides floored to one token's pixels; Flux2ImageProcessor's
    `_resize_and_crop`, which only crops), in RGB."""
    w, h = picture.size
    if w * h > REFERENCE_PIXELS:
        scale = math.sqrt(REFERENCE_PIXELS / (w * h))
        picture = picture.resize((int(w * scale), int(h * scale)), Image.Resampling.LANCZOS)
        w, h = picture.size
    left, top = (w - width) // 2, (h - height) // 2
    picture = picture.convert("RGB").crop((left, top, left + width, top + height))
    return np.asarray(picture, np.float32) / 255.0 * 2.0 - 1.0


def to_latents(vae: AutoencoderKLFlux2 | AutoencoderTiny, images: jax.Array) -> jax.Array:
    """Pictures in [-1, 1] -> the steps' latents: `_encode_vae_image` (the posterior's mode, patchified, normalised).

    A tiny VAE (TAEF2) encodes straight to the normalised space, 2x2 patches apart: its latents are only
    patchified (the pipeline reads no scaling factor, and TAEF2 has no batch norm to apply)."""
    if isinstance(vae, AutoencoderTiny):
        return patchify(vae.encode(images)[0])
    return vae.encode_latents(images)


def to_pixels(vae: AutoencoderKLFlux2 | AutoencoderTiny, x: jax.Array) -> jax.Array:
    """The steps' latents -> pictures in about [-1, 1]: the pipeline's last steps (denormalise, unpatchify, decode).

    A tiny VAE (TAEF2) decodes the normalised latents unpatchified, as madebyollin's Flux2KleinPipeline wrapper
    feeds it (an identity batch norm in the VAE's place) and ComfyUI's TAESD decodes FLUX.2's latents."""
    if isinstance(vae, AutoencoderTiny):
        return vae.decode(unpatchify(x))
    return vae.decode_latents(x)


def checkpoint_tensors(component: str, config: Any, tensors: dict[str, Any]) -> dict[str, Any]:
    """The text encoder's tensors as `build` makes it: a `Qwen3ForCausalLM`'s (under `model.`, beside `lm_head`) up
    to the last layer read; the other components' as they are."""
    if component != "text_encoder":
        return tensors
    return qwen3.encoder_tensors(tensors, config, FLUX2_KLEIN.layers(config), component)


def build(configs: Mapping[str, Any], rngs: nnx.Rngs) -> dict[str, nnx.Module]:
    """The transformer, the VAE and the text encoder up to the last layer read (27 of Qwen3-4B's 36), unless the
    host runs it (`loading.host_encoder`)."""
    networks = {
        "transformer": Flux2Transformer2DModel(configs["transformer"], rngs),
        "vae": AutoencoderKLFlux2(configs["vae"], rngs),
    }
    if "text_encoder" in configs:
        qwen = configs["text_encoder"]
        networks["text_encoder"] = Qwen3Model(qwen, rngs, num_layers=FLUX2_KLEIN.layers(qwen))
    return networks


PIPELINES = ("Flux2KleinPipeline",)
FAMILY = Family(
    name="flux2",
    pipelines=PIPELINES,
    configs={"text_encoder": Qwen3Config, "transformer": Flux2TransformerConfig, "vae": Flux2VAEConfig},
    build=build,
    text=FLUX2_KLEIN.text_side(encode, extra_inputs),
    denoiser=Denoiser(
        component="transformer",
        denoise=denoise,
        adapters=frozenset({"lora"}),
        references=References(MAX_REFERENCES, prepare_reference, REFERENCE_PIXELS),  # editing, as Flux2KleinPipeline
        # --quantize w8a8: the double and single blocks' attention and feed-forward, nearly all the products; the
        # embedders, the shared modulations and the output layers stay float
        w8a8=lambda path: path[0] in Flux2Transformer2DModel.WIDENED_BLOCKS,
    ),
    # The steps draw the pipeline's grid: 2x2 patches of the VAE's latents, normalised
    latent=LatentFormat(tiny_vae="madebyollin/taef2", vae_patch=2, encode=to_latents, decode=to_pixels),
    sampling=flow_sampling(
        {"height": 1024, "width": 1024, **BASE},
        turbo_defaults=DISTILLED,
        uniform_sigmas=True,  # the pipeline's linspace(1, 1/n, n), numpy's
        shift=empirical_mu,
        distilled=is_distilled,
    ),
    check_layout=check_layout,
    tensors=checkpoint_tensors,
)
# One task for now: reference pictures (editing) are the same model's
VARIANTS = (text_to_image(FAMILY, "FLUX.2 [klein]", PIPELINES, strength=0.6, inpaint=1.0),)
