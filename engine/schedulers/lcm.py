"""Latent consistency models: diffusers' LCMScheduler, step for step (Luo et al. 2023, "Latent Consistency Models").

Timesteps: the distillation ran on the grid of `original_inference_steps` (50) training timesteps k - 1,
2k - 1, ..., T - 1 with k = T // original_inference_steps; n steps take n of them, evenly spaced in index from
the top (`set_timesteps`: floor(linspace(0, len, n, endpoint=False))).

A step is the consistency function with its boundary-condition scalings (sigma_data = 0.5, t scaled by
`timestep_scaling`, 10):

    c_skip = sigma_data^2 / ((10 t)^2 + sigma_data^2),    c_out = 10 t / sqrt((10 t)^2 + sigma_data^2)
    x0 = (x - sqrt(1 - a_t) eps) / sqrt(a_t)            (or from v / the sample itself, as diffusers)
    denoised = c_out x0 + c_skip x

and, unless it is the last, a fresh forward diffusion to the next timestep (multistep consistency sampling):

    x' = sqrt(a') denoised + sqrt(1 - a') z,    z ~ N(0, I) fresh at every step but the last

The last step returns `denoised` itself: diffusers' `prev_sample` on the last step is `denoised`, which is
what `LatentConsistencyModelPipeline` decodes.

Image-to-image follows `LatentConsistencyModelImg2ImgPipeline`: `set_timesteps(n, strength=)` shortens the
grid itself to its first int(original_inference_steps * strength) points and takes n steps from it (all n
run, none skipped), starting from add_noise(image, noise, first timestep). Note that diffusers' generic
img2img pipelines with an LCMScheduler cut the full grid instead (`get_timesteps`), a different schedule.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from . import common
from .common import Array, Schedule, State, Tables

CLASS_NAME = "LCMScheduler"
DEFAULTS: dict[str, Any] = {
    **dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear"),
    **dict(trained_betas=None, original_inference_steps=50, clip_sample=False, clip_sample_range=1.0),
    **dict(set_alpha_to_one=True, prediction_type="epsilon", thresholding=False, timestep_scaling=10.0),
    **dict(rescale_betas_zero_snr=False),
}
PREDICTIONS = common.EVS
ONLY: dict[str, Any] = {}
FORCED: dict[str, dict[str, Any]] = {}
STOCHASTIC = True  # z: the caller draws it at every step; the last step ignores it
SIGMA_DATA = 0.5


def alphas_cumprod(s: dict[str, Any]) -> np.ndarray:
    return common.alphas_cumprod(s)


def grid(s: dict[str, Any], n: int, strength: float = 1.0) -> np.ndarray:
    """diffusers' LCM/TCD `set_timesteps(n, strength=)` without custom timesteps: int64, descending."""
    T, original = s["num_train_timesteps"], s["original_inference_steps"]
    if original > T:
        raise ValueError(f"original_inference_steps {original} exceeds num_train_timesteps {T}")
    origin = np.arange(1, int(original * strength) + 1, dtype=np.int64) * (T // original) - 1
    if len(origin) // n < 1:
        raise ValueError(
            f"original_inference_steps x strength = {original} x {strength} leaves fewer than {n} timesteps; "
            "lower the steps or raise the strength"
        )
    if n > original:
        raise ValueError(f"num_inference_steps {n} exceeds original_inference_steps {original}")
    origin = origin[::-1]
    return origin[np.floor(np.linspace(0, len(origin), num=n, endpoint=False)).astype(np.int64)]


def renoise(ac: np.ndarray, prev: np.ndarray, final: np.float32) -> tuple[np.ndarray, np.ndarray]:
    """sqrt(a'), sqrt(1 - a') of where each step lands, in float32 as torch takes them; 1, 0 at the last."""
    a_prev = common.alpha_at(ac, prev, final)
    keep, fresh = np.sqrt(a_prev), np.sqrt(np.float32(1) - a_prev)
    keep[-1], fresh[-1] = 1, 0
    return keep, fresh


def schedule(s: dict[str, Any], n: int, strength: float | None, eta: float) -> Schedule:
    """The grid's timesteps, a_t, the boundary-condition scalings, and the renoising to the next timestep."""
    ac = alphas_cumprod(s)
    ts = grid(s, n, 1.0 if strength is None else strength)
    # Like torch: t * timestep_scaling and the scalings in float32.
    scaled = ts.astype(np.float32) * np.float32(s["timestep_scaling"])
    denom = scaled**2 + np.float32(SIGMA_DATA**2)
    c_skip = np.float32(SIGMA_DATA**2) / denom
    c_out = scaled / np.sqrt(denom)
    keep, fresh = renoise(ac, np.concatenate([ts[1:], ts[-1:]]), common.final_alpha(s, ac))
    signal, noise = common.ddpm_noising(ac, ts)
    options = {"clip_sample_range": float(s["clip_sample_range"])} if s["clip_sample"] else {}
    return Schedule(
        timesteps=ts,
        signal=signal,
        noise=noise,
        coefficients=dict(alpha_t=ac[ts], c_skip=c_skip, c_out=c_out, keep=keep, fresh=fresh),
        options=options,
    )


def init_state(latents: Array) -> State:
    return State()


def scale_model_input(t: Tables, i: Array, sample: Array) -> Array:
    return sample


def step(t: Tables, state: State, i: Array, model_output: Array, x: Array, noise: Array | None) -> tuple[Array, State]:
    x0, _ = common.x0_eps(t, common.at(t, "alpha_t", i), model_output, x)
    clip = t.option("clip_sample_range")
    if clip is not None:
        x0 = jnp.clip(x0, -clip, clip)
    denoised = common.at(t, "c_out", i) * x0 + common.at(t, "c_skip", i) * x
    return common.at(t, "keep", i) * denoised + common.at(t, "fresh", i) * noise, state
