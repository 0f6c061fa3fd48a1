"""Live previews of the 2026 families against diffusers: one request through diffusers' pipeline (its step callback
keeping each step's latents) and through our engine (its `Preview` events), from the same initial latents.

Per family (the tiny folders of tests/test_flux2_klein.py, test_z_image.py and test_flux_kontext.py): the picture
size, each side's arguments, and how the pipeline holds its latents (Klein's and Z-Image's NCHW as given, FLUX.1
Kontext's packed in 2x2 patches; Klein's callback sees its grid as tokens). Used by those modules' preview tests
(the model's own VAE: the fitted map) and by tests/test_previews_2026.py (a tiny VAE: its decoded pictures).
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import FluxKontextPipeline
from PIL import Image

from engine import GenerationRequest, Preview, Progress
from engine.sampling.preview import PreviewMap

PROMPT = "a red circle on a blue background"
STEPS = 3  # previews after steps 1 and 2; the third's is the picture
SIZES = {"klein": 32, "zimage": 32, "kontext": 512}  # Kontext's factor-32 VAE: 8 tokens a side at least


def _smooth_picture(side: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:side, 0:side] / side
    waves = [np.sin(2 * np.pi * (f * x + g * y) + p) for f, g, p in rng.uniform(0, 6, (3, 3))]
    return Image.fromarray(np.uint8(np.clip(np.stack(waves, -1) * 0.4 + 0.5, 0, 1) * 255))


EDITED = _smooth_picture(64, seed=3)  # Kontext edits one picture, auto-resized as the pipeline does
# Each family's way: Klein's distilled folder and Z-Image-Turbo unguided (ZImagePipeline's scale g is our g + 1),
# Kontext (FLUX.1-dev) guided by its embedded scale
DIFFUSERS_ARGS = {
    "klein": {},
    "zimage": {"guidance_scale": 0.0},
    "kontext": {"guidance_scale": 3.5, "image": EDITED, "max_area": 512 * 512},
}
OUR_ARGS = {"klein": {}, "zimage": {"guidance_scale": 1.0}, "kontext": {"guidance_scale": 3.5, "references": (EDITED,)}}


def start(name: str, engine) -> np.ndarray:
    """Initial latents [1, channels, side, side] on the steps' grid (Klein's: 2x2 patches of its VAE's latents)."""
    side = SIZES[name] // engine.model.vae_scale_factor
    shape = (1, engine.model.latent_channels, side, side)
    return np.random.default_rng(4).standard_normal(shape).astype(np.float32)


def _pipeline_latents(name: str, start: np.ndarray) -> torch.Tensor:
    x = torch.from_numpy(start)
    return FluxKontextPipeline._pack_latents(x, *start.shape) if name == "kontext" else x


def _step_grid(name: str, pipe, latents: torch.Tensor, side: int) -> torch.Tensor:
    """A step's latents as the callback sees them -> NCHW on the steps' grid."""
    if name == "kontext":
        return pipe._unpack_latents(latents, SIZES[name], SIZES[name], pipe.vae_scale_factor)
    if name == "klein":  # tokens in rows
        return latents.reshape(latents.shape[0], side, side, -1).permute(0, 3, 1, 2)
    return latents


def run_diffusers(name: str, pipe, start: np.ndarray) -> tuple[np.ndarray, dict[int, torch.Tensor]]:
    """diffusers' picture from our latents, and its latents after each step (1-based), NCHW."""
    seen = {}

    def callback(p, i, t, values):
        seen[i + 1] = _step_grid(name, p, values["latents"], start.shape[-1]).clone()
        return {}

    with torch.no_grad():
        images = pipe(
            prompt=PROMPT, latents=_pipeline_latents(name, start), height=SIZES[name], width=SIZES[name],
            num_inference_steps=STEPS, output_type="np", callback_on_step_end=callback, **DIFFUSERS_ARGS[name],
        ).images  # fmt: skip
    return images, seen


def run_ours(name: str, engine, start: np.ndarray) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """Our picture and previews, keyed by the step they follow."""
    request = GenerationRequest(
        PROMPT, latents=start, height=SIZES[name], width=SIZES[name], num_inference_steps=STEPS, **OUR_ARGS[name]
    )
    ticket = engine.submit(request)
    previews, step = {}, 0
    for event in ticket.events(timeout=300):
        if isinstance(event, Progress):
            step = event.step
        elif isinstance(event, Preview):
            previews[step] = event.images[0]
    return ticket.result(60).arrays, previews


def assert_fitted_previews(name: str, reference, engine) -> None:
    """With the model's own VAE (an engine whose previews come after every step, `preview_every_s=0`): a map fitted
    over every channel of the steps' latents, and each preview that map of diffusers' latents after that step, one
    pixel per latent, within a byte."""
    preview = engine.preview  # waits for the fit that started at load
    assert isinstance(preview, PreviewMap) and preview.weight.shape == (engine.model.latent_channels, 3)
    assert np.isfinite(preview.fit_error) and preview.fit_error < 0.2  # RMS in 0..1: a rough picture, a preview
    noise = start(name, engine)
    _, seen = run_diffusers(name, reference, noise)
    _, previews = run_ours(name, engine, noise)
    assert sorted(previews) == list(range(1, STEPS))
    side = noise.shape[-1]
    for i, got in previews.items():
        assert got.shape == (side, side, 3) and got.dtype == np.uint8
        want = preview(seen[i][0].numpy().transpose(1, 2, 0)).astype(np.int16)
        assert np.abs(got.astype(np.int16) - want).max() <= 1, f"step {i}"
