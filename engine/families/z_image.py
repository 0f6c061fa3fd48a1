"""Z-Image and Z-Image-Turbo: a Qwen3 text encoder's second-to-last layer, the single-stream DiT, FLUX.1's VAE.

Mirrors diffusers' `ZImagePipeline`, `ZImageImg2ImgPipeline` and `ZImageInpaintPipeline` (Tongyi-MAI 2025). The
prompt is one user message in Qwen3's chat template with the generation prompt (`enable_thinking=True`: no think
block), cut at 512 tokens; the encoder sees the attention mask and the pipeline keeps `hidden_states[-2]` of the
real tokens only (`qwen_prompt.Z_IMAGE`). Here a prompt is padded to the shortest of 128, 256 and 512 tokens that
holds it and its negative prompt (`Plan.text_tokens`: a short prompt runs the text encoder over a quarter of the
512, and each step's caption tokens too), and its mask travels beside it (`Conditioning.context_mask`): the
transformer reads each caption's own length as data, so prompts padded alike share one program, and the padding
changes nothing that is read (causal attention, right padding, keys past each caption masked out in the
transformer). The caption goes through the transformer's `cap_embedder` and
context refiner once per request (`project`), not at every step.

The latents are FLUX.1's VAE's 16 channels, scaled and shifted by its config; the transformer packs 2x2 patches
itself. The schedule is flow matching on torch's linspace(1, 1/n, n) sigmas (`uniform_sigmas="torch"`), shifted as
the folder's scheduler says (the published folders shift statically: Turbo by 3, the base model by 6; `mu` from the
token count only where a scheduler shifts dynamically). The transformer reads `(1000 - t) / 1000` and its output,
negated, is the velocity (`ZImageTransformer2DModel.velocity`).

Guidance: the pipeline computes `pos + g * (pos - neg)` whenever g > 0, which is this engine's
`neg + G * (pos - neg)` at G = g + 1 (a second, unconditional row at G > 1, the negative prompt "" unless given):
a request's guidance scale is the engine's G, so the pipeline's g = 4 (the base model's recommendation) is 5 here.
`cfg_truncation` (default 1.0, which never truncates) and `cfg_normalization` (default off) are not offered.
Turbo (8-9 steps, no guidance) and the base model (50 steps, guided) share every config but the scheduler's:
a scheduler that shifts statically by less than the base model's 6 (Turbo's 3), or a folder named Turbo, is Turbo.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ..errors import ConfigError
from ..loading.host_encoder import HostEncoder
from ..loading.qwen_tokenizer import QwenTokenizer
from ..models.config import VAEConfig
from ..models.qwen3 import Qwen3Config, Qwen3Model
from ..models.transformer_z_image import ZImageTransformer2DModel, ZImageTransformerConfig
from ..models.vae import AutoencoderKL
from .base import Conditioning, Denoiser, Family, LatentFormat, Models, text_to_image
from .qwen_prompt import Z_IMAGE, folder_tokenizer
from .sd3 import flow_sampling

TURBO = {"num_inference_steps": 9, "guidance_scale": 0.0}  # Z-Image-Turbo's model card: 9 steps (8 evaluations), g 0
BASE = {"num_inference_steps": 50, "guidance_scale": 5.0}  # the base model's 50 steps at the pipeline's g = 4
BASE_SHIFT = 6.0  # Tongyi-MAI/Z-Image's scheduler_config.json `shift`; Turbo's is 3.0


def check_layout(configs: Mapping[str, Any], where: str) -> None:
    """The widths that must agree between the text encoder, the transformer and the VAE."""
    transformer: ZImageTransformerConfig = configs["transformer"]
    qwen: Qwen3Config = configs["text_encoder"]
    problems = []
    if qwen.hidden_size != transformer.cap_feat_dim:
        problems.append(f"the text encoder's width {qwen.hidden_size} is not cap_feat_dim {transformer.cap_feat_dim}")
    if transformer.axes_lens[0] <= Z_IMAGE.max_sequence_length + 1:
        problems.append(
            f"the transformer's {transformer.axes_lens[0]} frame positions (axes_lens) do not reach past a caption of "
            f"{Z_IMAGE.max_sequence_length} tokens"
        )
    if configs["vae"].latent_channels != transformer.in_channels:
        problems.append(
            f"the VAE's {configs['vae'].latent_channels} latent channels are not the transformer's "
            f"{transformer.in_channels}"
        )
    if problems:
        raise ConfigError(f"{where}: not a consistent Z-Image model: " + "; ".join(problems))


def is_turbo_schedule(scheduler: Any) -> bool:
    """Whether a folder's scheduler is Z-Image-Turbo's: a static shift below the base model's (Turbo's is 3)."""
    shift = getattr(scheduler, "shift", None)
    return not scheduler.use_dynamic_shifting and shift is not None and shift < BASE_SHIFT


def prompt_inputs(
    plan: Any, prompt: str, negative_prompt: str | None, tokenizer: QwenTokenizer, host: HostEncoder | None
) -> dict:
    """The prompt (and, guided, the negative prompt) as the pipeline tokenizes them: ids int32 and mask bool
    [1, plan.text_tokens] each (the shortest of `Z_IMAGE.lengths` holding both; 512 without a length), padded on
    the right; with the text encoder on the host, its `hidden_states[-2]` for those ids in place of the ids."""
    texts = {
        "qwen": (prompt, "prompt"),
        **({"neg_qwen": (negative_prompt or "", "negative prompt")} if plan.guidance else {}),
    }
    out = {}
    for key, (text, what) in texts.items():
        ids, mask, _ = Z_IMAGE.tokenize(tokenizer, [text], max_length=plan.text_tokens or None, what=what)
        out[f"{key}_mask"] = mask
        if host is None:
            out[f"{key}_ids"] = ids
        else:
            out[f"{key}_embeds"] = host(ids, mask)
    return out


def extra_inputs(index: Mapping[str, Any], vae_scale_factor: int, folder: Any, host: Any) -> Any:
    """The family's per-image inputs: the folder's Qwen tokenizer reads both prompts."""
    return functools.partial(prompt_inputs, tokenizer=folder_tokenizer(folder), host=host)


def encode(models: Models, ids: jax.Array, extra: dict, plan: Any, negative: bool) -> Conditioning:
    """The Qwen3 encoder's `hidden_states[-2]` [batch, 512, hidden] for `extra`'s ids (or as the host computed
    them), with their mask. `ids` is unused: no CLIP reads the prompt."""
    key = "neg_qwen" if negative else "qwen"
    mask = extra[f"{key}_mask"]
    if f"{key}_embeds" in extra:
        return Conditioning(extra[f"{key}_embeds"], context_mask=mask)
    encoder: Qwen3Model = models.text_encoder
    states = encoder(extra[f"{key}_ids"], mask)
    return Conditioning(Z_IMAGE.embeds(encoder.config, states), context_mask=mask)


def project(transformer: ZImageTransformer2DModel, cond: Conditioning) -> tuple[jax.Array, jax.Array]:
    """The caption refined once per request: (context [batch, 512, dim], lengths [batch]), what every step reads."""
    lengths = jnp.sum(cond.context_mask, axis=-1, dtype=jnp.int32)
    return transformer.encode_context(cond.context, lengths), lengths


def denoise(models: Models, x: jax.Array, timesteps: jax.Array, kv: Any, cond: Conditioning, residuals: tuple):
    """The velocity the scheduler steps with, for its timesteps t = sigma * 1000."""
    context, lengths = kv
    return models.transformer.velocity(x, timesteps, context, lengths)


def build(configs: Mapping[str, Any], rngs: nnx.Rngs) -> dict[str, nnx.Module]:
    """The transformer, the VAE and the whole text encoder (its last layer and final norm are read by nothing, and
    compiled away), unless it runs on the host (`host_qwen3`, which builds the layers read only)."""
    networks = {
        "transformer": ZImageTransformer2DModel(configs["transformer"], rngs),
        "vae": AutoencoderKL(configs["vae"], rngs),
    }
    if "text_encoder" in configs:
        networks["text_encoder"] = Qwen3Model(configs["text_encoder"], rngs)
    return networks


PIPELINES = ("ZImagePipeline", "ZImageImg2ImgPipeline", "ZImageInpaintPipeline")


def w8a8(path: tuple[str, ...]) -> bool:
    """`--quantize w8a8`'s kernels: the blocks' attention and feed-forward, nearly all the products; the embedders,
    each block's adaLN modulation (a row per image) and the final layer stay float."""
    return path[0] in ZImageTransformer2DModel.WIDENED_BLOCKS and "adaLN_modulation" not in path


FAMILY = Family(
    name="z-image",
    pipelines=PIPELINES,
    configs={"text_encoder": Qwen3Config, "transformer": ZImageTransformerConfig, "vae": VAEConfig},
    build=build,
    text=Z_IMAGE.text_side(encode, extra_inputs),
    denoiser=Denoiser(
        component="transformer", denoise=denoise, project=project, adapters=frozenset({"lora"}), w8a8=w8a8
    ),
    # The transformer packs the latents' 2x2 patches itself, but its in_channels are the VAE's 16: no denoiser_patch
    latent=LatentFormat(tiny_vae="madebyollin/taef1"),
    sampling=flow_sampling(
        {"height": 1024, "width": 1024, **BASE},
        turbo_defaults=TURBO,
        turbo_schedule=is_turbo_schedule,
        uniform_sigmas="torch",  # ZImagePipeline's torch.linspace(1, 1 / n, n)
    ),
    check_layout=check_layout,
)
# One task: image-to-image and inpainting (blending the kept part at each step) use the same model
VARIANTS = (text_to_image(FAMILY, "Z-Image", PIPELINES, strength=0.6, inpaint=1.0),)  # the pipelines' defaults
