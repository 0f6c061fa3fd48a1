"""A folder's task comes from its configs' widths, not from constants: the denoiser's input channels read against
the VAE's latent channels (and the denoiser's own packing).

diffusers' own FLUX.1 pipeline tests build `FluxTransformer2DModel(patch_size=1, in_channels=4, ...)` over an
`AutoencoderKL(latent_channels=1, block_out_channels=(4,), ...)` (tests/pipelines/flux/test_pipeline_flux.py,
`get_dummy_components`): such a folder, written with `save_pretrained`, loads as FLUX.1 text-to-image and draws
the picture `FluxPipeline` draws from the same initial latents, within 1/255 on 0..1 in f32, as tests/test_flux.py
compares them. The other widths are told apart (or refused, saying what would fit) from configs alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from reference import randomize
from t5_reference import save_tiny_t5_tokenizer, tiny_t5_encoder
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5TokenizerFast

from engine import load_pipeline
from engine.errors import ConfigError
from engine.families import find
from engine.models.config import VAEConfig
from tools.tiny_tokenizer import write_tokenizer

WORDS = ["a", "painting", "of", "squirrel", "eating", "burger"]
PROMPT = "a painting of a squirrel eating a burger"  # diffusers' dummy prompt
TOLERANCE = 1 / 255
SIDE = 16  # pixels; the one-block VAE's factor is 1, so the latents are 16x16 and the transformer reads 8x8 tokens


@pytest.fixture(scope="module")
def dummy_flux(tmp_path_factory):
    """diffusers' dummy FLUX.1 components (its tokenizers come from the Hub: ours are built offline), randomised
    as tests/test_flux.py does so that the picture is no flat field, saved and loaded by our engine."""
    clip_dir, t5_dir = tmp_path_factory.mktemp("clip"), tmp_path_factory.mktemp("t5")
    vocab = write_tokenizer(clip_dir, WORDS)
    clip = CLIPTextConfig(
        hidden_size=32, intermediate_size=37, layer_norm_eps=1e-05, num_attention_heads=4, num_hidden_layers=5,
        hidden_act="gelu", projection_dim=32, vocab_size=vocab, max_position_embeddings=77,
        bos_token_id=vocab - 2, eos_token_id=vocab - 1, pad_token_id=vocab - 1,
    )  # fmt: skip
    t5 = dict(d_model=32, d_kv=8, num_heads=4, d_ff=37, num_layers=2, feed_forward_proj="gated-gelu")
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
    )  # fmt: skip
    vae = AutoencoderKL(
        sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,), layers_per_block=1,
        latent_channels=1, norm_num_groups=1, use_quant_conv=False, use_post_quant_conv=False,
        shift_factor=0.0609, scaling_factor=1.5035,
    )  # fmt: skip
    reference = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=randomize(vae, 4, std=0.05),
        text_encoder=randomize(CLIPTextModel(clip), 1),
        tokenizer=CLIPTokenizer.from_pretrained(str(clip_dir)),
        text_encoder_2=tiny_t5_encoder(save_tiny_t5_tokenizer(t5_dir), 5, **t5),
        tokenizer_2=T5TokenizerFast.from_pretrained(str(t5_dir)),
        transformer=randomize(transformer, 3, std=0.05),
    )
    folder = tmp_path_factory.mktemp("dummy-flux")
    reference.save_pretrained(folder)
    engine = load_pipeline(folder, safety_checker=False)
    yield reference, engine
    engine.close()


def test_diffusers_dummy_flux_folder_loads_and_draws_what_flux_pipeline_draws(dummy_flux):
    reference, ours = dummy_flux
    assert (ours.family, ours.label) == ("flux", "FLUX.1")
    start = np.random.default_rng(0).standard_normal((2, 1, SIDE, SIDE)).astype(np.float32)  # 1 latent channel
    packed = FluxPipeline._pack_latents(torch.from_numpy(start), 2, 1, SIDE, SIDE)
    with torch.no_grad():
        want = reference(
            prompt=PROMPT, latents=packed, height=SIDE, width=SIDE, num_inference_steps=2, guidance_scale=5.0,
            output_type="np",
        ).images  # fmt: skip
    got = ours.generate(
        PROMPT, height=SIDE, width=SIDE, num_images=2, latents=start, num_inference_steps=2, guidance_scale=5.0
    ).arrays
    assert got.shape == want.shape == (2, SIDE, SIDE, 3)
    assert np.abs(got - want).max() < TOLERANCE
    assert want.std() > 0.02  # a picture, not a flat field that any mistake would still match


def vae(channels: int) -> VAEConfig:
    return VAEConfig(latent_channels=channels)


@pytest.mark.parametrize(
    ("family", "in_channels", "latent_channels", "task"),
    [
        ("flux", 4, 1, "text-to-image"),  # diffusers' dummy: 2x2 patches of 1 channel
        ("flux", 16, 4, "text-to-image"),  # the folder the old constant refused
        ("flux", 64, 16, "text-to-image"),  # FLUX.1 schnell and dev
        ("sd", 4, 4, "text-to-image"),
        ("sd", 9, 4, "inpainting"),  # latents, mask, masked picture's latents
        ("sd", 3, 1, "inpainting"),
        ("sdxl", 9, 4, "inpainting"),
        ("sd3", 16, 16, "text-to-image"),
    ],
)
def test_the_task_is_the_denoisers_width_over_the_vaes_latents(family, in_channels, latent_channels, task):
    variant = find(family, in_channels, vae(latent_channels))
    assert (variant.family, variant.task) == (family, task)


@pytest.mark.parametrize(
    ("family", "in_channels", "latent_channels", "says"),
    [
        ("flux", 64, 4, r"it would read text-to-image \(16\)$"),
        ("flux", 16, 16, r"it would read text-to-image \(64\)$"),
        ("sd", 8, 4, r"text-to-image \(4\) or inpainting \(9\)"),
        ("sd-lcm", 9, 4, r"it would read text-to-image \(4\)$"),  # no LCM inpainting pipeline
        ("sd3", 33, 16, r"text-to-image \(16\)$"),
    ],
)
def test_a_width_that_fits_no_task_is_refused_with_the_widths_that_would(family, in_channels, latent_channels, says):
    with pytest.raises(ConfigError, match=says) as refused:
        find(family, in_channels, vae(latent_channels), where="folder")
    assert f"folder: a {family} denoiser with in_channels={in_channels}" in str(refused.value)
    assert f"{latent_channels} latent channels" in str(refused.value)
