"""Slow: real published weights against diffusers, where a copy is on this machine.

Set JAX_SD_REAL_MODEL to a diffusers-format folder (for example a local download of
stable-diffusion-v1-5/stable-diffusion-v1-5); otherwise these tests are skipped. They load the
same folder in both and compare one guided generation from the same latents, in f32.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

FOLDER = os.environ.get("JAX_SD_REAL_MODEL")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not FOLDER or not Path(FOLDER).is_dir(), reason="set JAX_SD_REAL_MODEL to a model folder"),
]


def test_a_real_model_draws_what_diffusers_draws():
    import torch
    from diffusers import DiffusionPipeline

    from engine import load_pipeline

    ours = load_pipeline(FOLDER, dtype="float32")
    reference = DiffusionPipeline.from_pretrained(FOLDER, torch_dtype=torch.float32, safety_checker=None)
    size = ours.defaults["height"] // 2  # half size keeps a CPU run within minutes
    latents = np.random.default_rng(0).standard_normal((1, 4, size // 8, size // 8)).astype(np.float32)
    settings = dict(num_inference_steps=4, guidance_scale=7.5, height=size, width=size)
    with torch.no_grad():
        want = reference(
            "a photo of an astronaut riding a horse", latents=torch.from_numpy(latents), output_type="np", **settings
        ).images
    got = ours.generate(
        "a photo of an astronaut riding a horse",
        latents=latents,
        num_images=1,
        scheduler=ours.defaults["scheduler"],
        **settings,
    )
    assert np.abs(got.arrays - want).max() < 1e-2
