"""DDIM with eta = 0: diffusers' DDIMScheduler, step for step.

DDIM (Song et al. 2021, eq. 12), deterministic (eta = 0):

    x0 = (x - sqrt(1 - a_t) eps) / sqrt(a_t),    x' = sqrt(a') x0 + sqrt(1 - a') eps

where a' is a_t of the timestep the step lands on (`final_alpha_cumprod` past t = 0). With clip_sample
(diffusers' default, off in SD folders), x0 is clipped to +-clip_sample_range first. Stochastic DDIM
(eta > 0) is not implemented: `tables(..., eta=)` does not reach this algorithm.
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
STOCHASTIC = False


def alphas_cumprod(s: dict[str, Any]) -> np.ndarray:
    return common.alphas_cumprod(s)


def schedule(s: dict[str, Any], n: int, strength: float | None, eta: float) -> Schedule:
    """Integer timesteps, and a_t of where each step starts from and lands on: T // n lower, whatever the
    spacing (diffusers' `prev_timestep = t - T // n`)."""
    ac = alphas_cumprod(s)
    ts = np.round(common.spaced(s, n)).astype(np.int64)[common.first_step(n, strength) :]
    final = common.final_alpha(s, ac)
    prev = ts - s["num_train_timesteps"] // n
    signal, noise = common.ddpm_noising(ac, ts)
    alphas = dict(alpha_t=common.alpha_at(ac, ts, final), alpha_prev=common.alpha_at(ac, prev, final))
    options = {"clip_sample_range": float(s["clip_sample_range"])} if s["clip_sample"] else {}
    return Schedule(timesteps=ts, signal=signal, noise=noise, coefficients=alphas, options=options)


def init_state(latents: Array) -> State:
    return State()


def scale_model_input(t: Tables, i: Array, sample: Array) -> Array:
    return sample


def step(t: Tables, state: State, i: Array, model_output: Array, x: Array, noise: Array | None) -> tuple[Array, State]:
    a_prev = common.at(t, "alpha_prev", i)
    x0, eps = common.x0_eps(t, common.at(t, "alpha_t", i), model_output, x)
    clip = t.option("clip_sample_range")
    if clip is not None:
        x0 = jnp.clip(x0, -clip, clip)
    return a_prev**0.5 * x0 + (1 - a_prev) ** 0.5 * eps, state
