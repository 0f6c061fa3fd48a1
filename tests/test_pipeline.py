"""The whole pipeline equals diffusers' StableDiffusionPipeline from the same initial latents.

A tiny random diffusers pipeline is written with `save_pretrained`; our engine loads that
folder. Same prompt, negative prompt, latents and settings: max abs pixel difference < 1e-2
on a 0..1 scale, in f32, for every scheduler, with guidance on and off.
"""

from __future__ import annotations

from unittest import mock

import jax
import numpy as np
import pytest
import tiny_pipeline
import torch
from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    PNDMScheduler,
)

from engine import load_pipeline
from engine.sampling.pipeline import image_keys

TORCH_SCHEDULERS = {
    "pndm": (PNDMScheduler, {}),
    "ddim": (DDIMScheduler, {}),
    "euler": (EulerDiscreteScheduler, {}),
    "euler_a": (EulerAncestralDiscreteScheduler, {}),
    "dpm++2m": (DPMSolverMultistepScheduler, {}),
    "dpm++2m_karras": (DPMSolverMultistepScheduler, {"use_karras_sigmas": True}),
}
SIZE = 64
TOLERANCE = 1e-2


# SD 1.x with every scheduler, DDIM with guidance off and on, the others with guidance on or off by turns; the other
# layouts with the schedulers they ship with. Guidance is the UNet's (a second, unconditional row per image, combined
# before the step): every scheduler steps the one combined prediction, so each scheduler once, and guidance both ways
# on DDIM and on the others by turns, cover what scheduler x guidance did, at a compiled plan fewer per case. DDIM's
# plans serve the tests below too (eta, guided; the empty prompt, unguided).
OTHERS = [scheduler for scheduler in sorted(TORCH_SCHEDULERS) if scheduler != "ddim"]
CASES = [("sd1", "ddim", 1.0), ("sd1", "ddim", 6.0)]
CASES += [("sd1", scheduler, (6.0, 1.0)[k % 2]) for k, scheduler in enumerate(OTHERS)]
CASES += [("sd2v", "ddim", 6.0), ("sd2v", "euler_a", 6.0), ("turbo", "euler", 0.0), ("turbo", "euler_a", 0.0)]
# A small distilled model as published: SDXS-512's tiny UNet and its own tiny autoencoder, one step, no guidance.
CASES += [("sdxs", "euler", 0.0), ("sdxs", "dpm++2m", 6.0)]
STEPS = {"turbo": 2, "sdxs": 1}
_PAIRS: dict = {}


def load_pair(variant: str, tmp_path_factory):
    """The diffusers reference and our engine on the same saved folder, built once per variant."""
    if variant not in _PAIRS:
        folder = tmp_path_factory.mktemp(variant)
        reference = tiny_pipeline.write(variant, folder)
        reference.saved_scheduler_config = reference.scheduler.config  # each test switches from this one
        _PAIRS[variant] = reference, load_pipeline(folder)
    return _PAIRS[variant]


def ancestral_noise(seeds: list[int], steps: int, shape: tuple[int, int, int]) -> list[torch.Tensor]:
    """The per-step noise our engine draws for euler_a, as diffusers' NCHW tensors."""
    keys = image_keys(np.asarray(seeds, np.uint32))
    out = []
    for i in range(steps):
        step = [jax.random.normal(jax.random.fold_in(k, i + 1), shape) for k in keys]
        out.append(torch.from_numpy(np.stack(step).transpose(0, 3, 1, 2).copy()))
    return out


def run_reference(reference, scheduler, guidance, latents, seeds, steps, prompt, negative):
    cls, extra = TORCH_SCHEDULERS[scheduler]
    reference.scheduler = cls.from_config(reference.saved_scheduler_config, **extra)
    noise = iter(ancestral_noise(seeds, steps, (latents.shape[2], latents.shape[3], latents.shape[1])))
    target = "diffusers.schedulers.scheduling_euler_ancestral_discrete.randn_tensor"
    with mock.patch(target, side_effect=lambda *a, **k: next(noise)), torch.no_grad():
        return reference(
            prompt,
            negative_prompt=negative,
            num_inference_steps=steps,
            guidance_scale=guidance,
            latents=torch.from_numpy(latents),
            height=latents.shape[2] * 8,  # the size the latents are for (SIZE in this file)
            width=latents.shape[3] * 8,
            num_images_per_prompt=latents.shape[0],
            output_type="np",
        ).images


@pytest.mark.parametrize("variant, scheduler, guidance", CASES)
def test_images_match_diffusers(variant, scheduler, guidance, tmp_path_factory):
    reference, ours = load_pair(variant, tmp_path_factory)
    steps = STEPS.get(variant, 4)
    latents = np.random.default_rng(0).standard_normal((2, 4, SIZE // 8, SIZE // 8)).astype(np.float32)
    prompt, negative = "a red circle on a blue background", "blurry photo"
    want = run_reference(reference, scheduler, guidance, latents, [7, 8], steps, prompt, negative)
    got = ours.generate(
        prompt,
        negative_prompt=negative,
        seed=7,
        num_inference_steps=steps,
        guidance_scale=guidance,
        height=SIZE,
        width=SIZE,
        num_images=2,
        scheduler=scheduler,
        latents=latents,
    )
    assert got.arrays.shape == want.shape
    assert np.abs(got.arrays - want).max() < TOLERANCE
    assert got.arrays.std() > 0.01  # a real picture, not a constant that matches trivially


def test_empty_prompt_generates_unconditionally(tmp_path_factory):
    reference, ours = load_pair("sd1", tmp_path_factory)
    # Two pictures, as the unguided DDIM case above draws: its programs serve, where one picture compiled its own.
    latents = np.random.default_rng(1).standard_normal((2, 4, SIZE // 8, SIZE // 8)).astype(np.float32)
    want = run_reference(reference, "ddim", 1.0, latents, [0, 1], 3, "", None)
    got = ours.generate(
        "",
        num_inference_steps=3,
        guidance_scale=1.0,
        height=SIZE,
        width=SIZE,
        num_images=2,
        scheduler="ddim",
        latents=latents,
    )
    assert np.abs(got.arrays - want).max() < TOLERANCE


def test_ddim_eta_matches_diffusers_and_never_compiles(tmp_path_factory):
    """`eta` as diffusers' pipelines pass it to DDIMScheduler.step, its `variance_noise` being the noise our engine
    draws at the same step; a new eta changes table values, not the program."""
    reference, ours = load_pair("sd1", tmp_path_factory)
    reference.scheduler = DDIMScheduler.from_config(reference.saved_scheduler_config)
    latents = np.random.default_rng(2).standard_normal((2, 4, SIZE // 8, SIZE // 8)).astype(np.float32)
    prompt, negative, steps = "a red circle on a blue background", "blurry photo", 4
    args = dict(num_inference_steps=steps, guidance_scale=6.0, height=SIZE, width=SIZE)
    pictures, errors, compiled = {}, {}, None
    for eta in (0.0, 0.5, 1.0):
        noise = ancestral_noise([7, 8], steps, (SIZE // 8, SIZE // 8, 4))
        target = "diffusers.schedulers.scheduling_ddim.randn_tensor"
        with mock.patch(target, side_effect=noise), torch.no_grad():
            want = reference(
                prompt,
                negative_prompt=negative,
                eta=eta,
                latents=torch.from_numpy(latents),
                num_images_per_prompt=2,
                output_type="np",
                **args,
            ).images
        got = ours.generate(
            prompt, negative_prompt=negative, seed=7, num_images=2, scheduler="ddim", latents=latents, eta=eta, **args
        )
        errors[eta] = float(np.abs(got.arrays - want).max())
        compiled = ours.compile_count if compiled is None else compiled
        pictures[eta] = got.arrays
    assert max(errors.values()) < TOLERANCE, errors
    assert ours.compile_count == compiled
    assert np.abs(pictures[1.0] - pictures[0.0]).max() > 0.01  # eta did reach the steps
    print("DDIM eta max abs errors:", errors)


def test_plans_differing_in_scheduler_or_guidance_share_one_decode(tmp_path_factory):
    """A new scheduler, or guidance switched off, is a new plan (new admit and advance programs) but the same VAE
    decode: the second and third plans compile no decode, and their pictures still equal diffusers'."""
    reference, ours = load_pair("sd1", tmp_path_factory)
    size, steps = 80, 3  # a size no other test here draws: the first plan compiles its decode afresh
    latents = np.random.default_rng(3).standard_normal((2, 4, size // 8, size // 8)).astype(np.float32)
    prompt, negative = "a red circle on a blue background", "blurry photo"
    plans, decodes = ours.compile_count, ours.programs.decode_compile_count
    for scheduler, guidance in [("euler", 6.0), ("ddim", 6.0), ("ddim", 1.0)]:
        want = run_reference(reference, scheduler, guidance, latents, [7, 8], steps, prompt, negative)
        got = ours.generate(
            prompt,
            negative_prompt=negative,
            seed=7,
            num_inference_steps=steps,
            guidance_scale=guidance,
            height=size,
            width=size,
            num_images=2,
            scheduler=scheduler,
            latents=latents,
        )
        assert got.compiled
        assert np.abs(got.arrays - want).max() < TOLERANCE, (scheduler, guidance)
        assert got.arrays.std() > 0.01
    assert ours.compile_count == plans + 3
    assert ours.programs.decode_compile_count == decodes + 1
