"""DDIM: diffusers' DDIMScheduler, step for step, with its `eta`.

DDIM (Song et al. 2021, eqs. 12 and 16):

    x0 = (x - sqrt(1 - a_t) eps) / sqrt(a_t)
    s = eta * sqrt((1 - a') / (1 - a_t) * (1 - a_t / a'))
    x' = sqrt(a') x0 + sqrt(1 - a' - s^2) eps + s z,    z ~ N(0, I) fresh at every step

where a' is a_t of the timestep the step lands on (`final_alpha_cumprod` past t = 0). eta = 0 (the pipelines'
default) is the deterministic DDIM, s = 0; eta = 1 adds DDPM's posterior variance. s is computed on the host
from the call's eta, so a new eta changes table values only, never the compiled program; the caller draws z
at every step (diffusers' `variance_noise`), which s = 0 multiplies away. With clip_sample (diffusers'
default, off in SD folders), x0 is clipped to +-clip_sample_range first; eps stays the model's
(`use_clipped_model_output` off, as the pipelines call it).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from . import common
from .common import Array, Schedule, State, Tables

CLASS_NAME = "DDIMScheduler"
DEFAULTS: dict[str, Any] = {
    **common.COMMON,
    **dict(clip_sample=True, set_alpha_to_one=True, thresholding=False, clip_sample_range=1.0),
    **dict(timestep_spacing="leading", rescale_betas_zero_snr=False),
}
PREDICTIONS = common.EVS
ONLY: dict[str, Any] = {}
FORCED: dict[str, dict[str, Any]] = {}
STOCHASTIC = True  # z: drawn at every step, multiplied by s (0 at eta = 0)


def alphas_cumprod(s: dict[str, Any]) -> np.ndarray:
    return common.alphas_cumprod(s)


def schedule(s: dict[str, Any], n: int, strength: float | None, eta: float) -> Schedule:
    """Integer timesteps, a_t of where each step starts from and lands on: T // n lower, whatever the
    spacing (diffusers' `prev_timestep = t - T // n`), and each step's noise scale s for `eta`."""
    ac = alphas_cumprod(s)
    ts = np.round(common.spaced(s, n)).astype(np.int64)[common.first_step(n, strength) :]
    final = common.final_alpha(s, ac)
    prev = ts - s["num_train_timesteps"] // n
    signal, noise = common.ddpm_noising(ac, ts)
    a_t, a_prev = common.alpha_at(ac, ts, final), common.alpha_at(ac, prev, final)
    one = np.float32(1)
    variance = (one - a_prev) / (one - a_t) * (one - a_t / a_prev)  # diffusers' `_get_variance`, float32
    std = (np.float32(eta) * np.sqrt(variance)).astype(np.float32)
    # sqrt(1 - a' - s^2) in float32 as torch rounds it: at a zero-SNR start (a_t = 0, eta = 1) s^2 = 1 - a', and
    # an in-graph square could land an ulp above it (NaN). A rounded-negative radicand is taken as 0.
    direction = np.sqrt(np.maximum(one - a_prev - std * std, 0)).astype(np.float32)
    alphas = dict(alpha_t=a_t, alpha_prev=a_prev, std=std, direction=direction)
    options = {"clip_sample_range": float(s["clip_sample_range"])} if s["clip_sample"] else {}
    return Schedule(timesteps=ts, signal=signal, noise=noise, coefficients=alphas, options=options)


def init_state(latents: Array) -> State:
    return State()


def scale_model_input(t: Tables, i: Array, sample: Array) -> Array:
    return sample


def step(t: Tables, state: State, i: Array, model_output: Array, x: Array, noise: Array | None) -> tuple[Array, State]:
    a_prev, std = common.at(t, "alpha_prev", i), common.at(t, "std", i)  # a', s
    x0, eps = common.x0_eps(t, common.at(t, "alpha_t", i), model_output, x)
    clip = t.option("clip_sample_range")
    if clip is not None:
        x0 = jnp.clip(x0, -clip, clip)
    return a_prev**0.5 * x0 + common.at(t, "direction", i) * eps + std * noise, state
