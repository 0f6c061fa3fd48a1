"""Tiny random diffusers Stable Diffusion folders, written with `save_pretrained`, for parity tests."""

from __future__ import annotations

import tempfile
from pathlib import Path

from diffusers import (
    AutoencoderKL,
    AutoencoderTiny,
    LatentConsistencyModelPipeline,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)
from diffusers import schedulers as torch_schedulers
from reference import CLIP_LAYOUTS, DISTILLED_UNET_LAYOUTS, UNET_LAYOUTS, randomize
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from tools.tiny_tokenizer import write_tokenizer

WORDS = ["a", "red", "circle", "on", "blue", "background", "photo", "of", "cat", "blurry"]
# A factor-8 VAE, so latents are (n, 4, h/8, w/8) as with every real SD model.
VAE_FACTOR8 = dict(
    block_out_channels=(8, 16, 16, 16),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    latent_channels=4,
    norm_num_groups=4,
    layers_per_block=1,
    sample_size=64,
)
TINY_VAE = dict(  # TAESD's layout, narrow: 4 latent channels, 8 pixels per latent
    encoder_block_out_channels=(8, 8, 8, 8),
    decoder_block_out_channels=(8, 8, 8, 8),
    num_encoder_blocks=(1, 2, 1, 1),
    num_decoder_blocks=(1, 1, 2, 1),
)
SD15_SCHEDULER = dict(
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    set_alpha_to_one=False,
    skip_prk_steps=True,
    steps_offset=1,
    clip_sample=False,
)
VARIANTS = {
    # SD 1.x: conv projections, epsilon prediction, PNDM.
    "sd1": dict(unet="sd1", clip="sd1", scheduler=("PNDMScheduler", dict(SD15_SCHEDULER))),
    # SD 2.x-v: linear projections, per-block heads, upcast attention, v-prediction, DDIM.
    "sd2v": dict(
        unet="sd2",
        clip="sd2",
        scheduler=("DDIMScheduler", dict(SD15_SCHEDULER, prediction_type="v_prediction", clip_sample=False)),
    ),
    # SD-Turbo: SD 2.x layout, trailing spacing, meant for guidance 0 and 1-4 steps.
    "turbo": dict(
        unet="sd2",
        clip="sd2",
        scheduler=("EulerDiscreteScheduler", dict(SD15_SCHEDULER, timestep_spacing="trailing")),
    ),
    # A latent consistency model (LCM_Dreamshaper_v7's layout): SD 1.x whose UNet reads the guidance scale's
    # embedding (`time_cond_proj_dim`, 256 there), its LCMScheduler, saved as a LatentConsistencyModelPipeline.
    "lcm": dict(
        unet="sd1",
        clip="sd1",
        unet_extra=dict(time_cond_proj_dim=16),
        scheduler=("LCMScheduler", dict(SD15_SCHEDULER, set_alpha_to_one=True, original_inference_steps=50)),
        pipeline=LatentConsistencyModelPipeline,
    ),
    # SDXS-512-DreamShaper's layout: a tiny UNet (three stages, one resnet each, no mid block, no attention
    # outside) and a tiny autoencoder (TAESD's layout) as the folder's own VAE; one step, no guidance.
    "sdxs": dict(
        unet="sdxs-512-dreamshaper",
        clip="sd1",
        vae=(AutoencoderTiny, TINY_VAE),
        scheduler=("EulerDiscreteScheduler", dict(SD15_SCHEDULER, timestep_spacing="trailing")),
    ),
}


def build(variant: str, seed: int = 0) -> StableDiffusionPipeline | LatentConsistencyModelPipeline:
    spec = VARIANTS[variant]
    tok_dir = Path(tempfile.mkdtemp(prefix="tokenizer-"))
    vocab = write_tokenizer(tok_dir, WORDS)
    clip_cfg = CLIPTextConfig(
        **CLIP_LAYOUTS[spec["clip"]],
        vocab_size=vocab,
        max_position_embeddings=77,
        bos_token_id=vocab - 2,
        eos_token_id=vocab - 1,
        pad_token_id=vocab - 1,
    )
    text_encoder = randomize(CLIPTextModel(clip_cfg), seed)
    layouts = {**UNET_LAYOUTS, **DISTILLED_UNET_LAYOUTS}
    unet_layout = dict(layouts[spec["unet"]], cross_attention_dim=clip_cfg.hidden_size, sample_size=8)
    unet_layout.update(spec.get("unet_extra", {}))
    unet = randomize(UNet2DConditionModel(**unet_layout), seed + 1)
    vae_class, vae_layout = spec.get("vae", (AutoencoderKL, VAE_FACTOR8))
    vae = randomize(vae_class(**vae_layout), seed + 2, std=0.05 if vae_class is AutoencoderKL else 0.1)
    cls_name, sched_kwargs = spec["scheduler"]
    scheduler = getattr(torch_schedulers, cls_name).from_config(
        sched_kwargs
    )  # ignores keys of other kinds, as loading does
    return spec.get("pipeline", StableDiffusionPipeline)(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=CLIPTokenizer.from_pretrained(str(tok_dir)),
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def write(variant: str, folder: Path) -> StableDiffusionPipeline | LatentConsistencyModelPipeline:
    """Saves a tiny pipeline and returns it as read back from disk, as a user would load it."""
    build(variant).save_pretrained(folder, safe_serialization=True)
    cls = VARIANTS[variant].get("pipeline", StableDiffusionPipeline)
    return cls.from_pretrained(folder, safety_checker=None, requires_safety_checker=False)
