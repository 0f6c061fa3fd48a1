"""Latent consistency: LCM models and LCM-LoRA against diffusers' PyTorch pipelines, picture for picture.

- A tiny LCM model (an SD 1.x UNet with `time_cond_proj_dim`, LCMScheduler) saved as a
  `LatentConsistencyModelPipeline`: `load_pipeline(folder)` draws what that pipeline and
  `LatentConsistencyModelImg2ImgPipeline` draw from the same latents (1, 2 and 4 steps, two guidance scales,
  which reach the UNet as an embedding: no unconditional row, and a new scale compiles nothing).
- An LCM-LoRA-style LoRA (diffusers/PEFT layout, UNet only) on a tiny SD 1.x folder, loaded with
  `load_pipeline(loras=...)`, drawing with scheduler "lcm" at guidance 1: what `StableDiffusionPipeline` +
  `load_lora_weights` + `LCMScheduler` draw.

The step noise LCM draws is the noise our engine draws (`ancestral_noise`), handed to diffusers through its
`randn_tensor`; img2img's VAE encodes to the posterior mean on both sides. Max abs pixel difference < 1/255.
"""

from __future__ import annotations

import contextlib
import json
from unittest import mock

import numpy as np
import pytest
import tiny_pipeline
import torch
from diffusers import LatentConsistencyModelImg2ImgPipeline, LCMScheduler, StableDiffusionPipeline
from test_image_modes import picture
from test_lora import UNET_TARGETS, random_lora
from test_pipeline import ancestral_noise

from engine import load_pipeline
from engine.errors import ConfigError
from engine.families.loader import load_model_folder
from engine.nn.layers import guidance_scale_embedding

SIZE = 64
TOLERANCE = 1 / 255
PROMPT = "a red circle on a blue background"
SCHEDULING_LCM = "diffusers.schedulers.scheduling_lcm.randn_tensor"
LCM_IMG2IMG = "diffusers.pipelines.latent_consistency_models.pipeline_latent_consistency_img2img"


@pytest.fixture(scope="module")
def lcm(tmp_path_factory):
    """The tiny LCM folder: diffusers' text-to-image and img2img pipelines from disk, and our engine."""
    folder = tmp_path_factory.mktemp("lcm")
    reference = tiny_pipeline.write("lcm", folder)
    return reference, LatentConsistencyModelImg2ImgPipeline(**reference.components), load_pipeline(folder)


def start(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 4, SIZE // 8, SIZE // 8)).astype(np.float32)


def lcm_noise(seeds: list[int], steps: int):
    """diffusers' LCMScheduler draws its step noise from what our engine draws at the same step."""
    return mock.patch(SCHEDULING_LCM, side_effect=iter(ancestral_noise(seeds, steps, (SIZE // 8, SIZE // 8, 4))))


def test_the_guidance_embedding_is_diffusers(lcm):
    reference = lcm[0]
    w = np.array([0.0, 0.5, 7.5, 14.0], np.float32)
    for dim in (16, 256, 7):
        want = reference.get_guidance_scale_embedding(torch.from_numpy(w), embedding_dim=dim).numpy()
        # Sines of up to 14000 radians, where one float32 ulp of the argument (a frequency an ulp apart: torch's
        # and XLA's exp round differently) is 1e-3; the pictures below are the real measure.
        np.testing.assert_allclose(np.asarray(guidance_scale_embedding(w, dim)), want, atol=1e-3)


def test_an_lcm_model_loads_as_its_family(lcm):
    ours = lcm[2]
    assert ours.label == "Latent Consistency Model"
    assert {k: ours.defaults[k] for k in ("num_inference_steps", "guidance_scale", "scheduler")} == {
        "num_inference_steps": 4,
        "guidance_scale": 8.5,
        "scheduler": "lcm",
    }
    assert ours.variant.default_strength(None) == 0.8  # LatentConsistencyModelImg2ImgPipeline's


def test_an_lcm_folder_without_the_guidance_input_is_refused(tmp_path):
    folder = tmp_path / "lcm"
    tiny_pipeline.build("lcm").save_pretrained(folder, safe_serialization=True)
    config = json.loads((folder / "unet" / "config.json").read_text())
    (folder / "unet" / "config.json").write_text(json.dumps({**config, "time_cond_proj_dim": None}))
    with pytest.raises(ConfigError, match="time_cond_proj_dim"):
        load_model_folder(folder, "float32")


def test_text_to_image_matches_diffusers_and_a_new_scale_compiles_nothing(lcm):
    reference, _, ours = lcm
    errors, pictures, compiled = {}, {}, None
    for steps in (1, 2, 4):
        for guidance in (8.5, 3.0):
            latents = start(2, steps)
            with lcm_noise([7, 8], steps), torch.no_grad():
                want = reference(
                    PROMPT,
                    num_inference_steps=steps,
                    guidance_scale=guidance,
                    latents=torch.from_numpy(latents),
                    height=SIZE,
                    width=SIZE,
                    num_images_per_prompt=2,
                    output_type="np",
                ).images
            got = ours.generate(
                PROMPT,
                negative_prompt="blurry photo",  # LCM reads none: no unconditional row is ever computed
                seed=7,
                num_inference_steps=steps,
                guidance_scale=guidance,
                height=SIZE,
                width=SIZE,
                num_images=2,
                latents=latents,
            )
            assert got.arrays.std() > 0.01  # a picture, not a constant that would match trivially
            errors[steps, guidance] = float(np.abs(got.arrays - want).max())
            pictures[steps, guidance] = got.arrays
            compiled = ours.compile_count if compiled is None else compiled
    assert ours.compile_count == compiled  # every step count and scale ran the first request's programs
    assert np.abs(pictures[4, 8.5] - pictures[4, 3.0]).max() > 0.01  # the scale reached the UNet
    assert all(not plan.guidance for plan in ours.compiled_plans)
    assert max(errors.values()) < TOLERANCE, errors
    print("LCM text-to-image max abs errors:", errors)


def test_img2img_matches_diffusers(lcm):
    _, reference, ours = lcm
    image, errors = picture(SIZE), {}
    for strength, guidance in ((0.5, 8.5), (0.8, 2.0)):
        noise = start(1, 11)
        mean = lambda out, generator=None, sample_mode="sample": out.latent_dist.mode()  # noqa: E731
        with contextlib.ExitStack() as stack, torch.no_grad():
            stack.enter_context(mock.patch(f"{LCM_IMG2IMG}.retrieve_latents", side_effect=mean))
            stack.enter_context(mock.patch(f"{LCM_IMG2IMG}.randn_tensor", return_value=torch.from_numpy(noise)))
            stack.enter_context(lcm_noise([3], 4))
            want = reference(
                PROMPT, image=image, strength=strength, num_inference_steps=4, guidance_scale=guidance, output_type="np"
            ).images
        got = ours.generate(
            PROMPT,
            seed=3,
            image=image,
            strength=strength,
            num_inference_steps=4,
            guidance_scale=guidance,
            num_images=1,
            latents=noise,
        )
        assert got.arrays.std() > 0.01
        errors[strength, guidance] = float(np.abs(got.arrays - want).max())
    assert max(errors.values()) < TOLERANCE, errors
    print("LCM img2img max abs errors:", errors)


@pytest.fixture(scope="module")
def lcm_lora(tmp_path_factory):
    """A tiny SD 1.x folder as diffusers loads it, an LCM-LoRA-style UNet LoRA for it, and our engine with it."""
    root = tmp_path_factory.mktemp("lcm-lora")
    reference = tiny_pipeline.write("sd1", root / "model")
    layers, config = random_lora(reference.unet, dict(r=4, lora_alpha=8, target_modules=UNET_TARGETS), 21)
    StableDiffusionPipeline.save_lora_weights(
        root, weight_name="lcm.safetensors", unet_lora_layers=layers, unet_lora_adapter_metadata=config
    )
    return reference, root / "lcm.safetensors", load_pipeline(root / "model", loras={"lcm": root / "lcm.safetensors"})


def test_lcm_lora_with_the_lcm_scheduler_matches_diffusers(lcm_lora):
    reference, lora, ours = lcm_lora
    reference.load_lora_weights(str(lora), adapter_name="lcm")
    reference.scheduler = LCMScheduler.from_config(reference.scheduler.config)
    errors = {}
    try:
        for steps in (2, 4):
            latents = start(1, 20 + steps)
            with lcm_noise([5], steps), torch.no_grad():
                want = reference(
                    PROMPT,
                    num_inference_steps=steps,
                    guidance_scale=1.0,
                    latents=torch.from_numpy(latents),
                    height=SIZE,
                    width=SIZE,
                    output_type="np",
                ).images
            got = ours.generate(
                PROMPT,
                seed=5,
                num_inference_steps=steps,
                guidance_scale=1.0,
                scheduler="lcm",
                num_images=1,
                height=SIZE,
                width=SIZE,
                latents=latents,
            )
            assert got.arrays.std() > 0.01
            errors[steps] = float(np.abs(got.arrays - want).max())
        # The same request with the LoRA weighed 0: the LoRA did change the picture.
        plain = ours.generate(
            PROMPT,
            seed=5,
            num_inference_steps=4,
            guidance_scale=1.0,
            scheduler="lcm",
            num_images=1,
            height=SIZE,
            width=SIZE,
            latents=latents,
            lora_scales={"lcm": 0.0},
        )
        assert np.abs(plain.arrays - got.arrays).max() > 0.01
    finally:
        reference.unload_lora_weights()
    assert max(errors.values()) < TOLERANCE, errors
    print("LCM-LoRA max abs errors:", errors)
