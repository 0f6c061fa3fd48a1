"""Trajectory consistency distillation: diffusers' TCDScheduler, step for step (Zheng et al. 2024, "TCD").

Timesteps: LCM's grid (`lcm.grid`) on `original_inference_steps`. A step predicts x0 and eps as DDIM does,
goes to an intermediate timestep s below the next one t', and diffuses forward from s to t' with fresh noise;
gamma (diffusers' `eta`, the call's `tables(..., eta=)`) sets how far below:

    s = floor((1 - gamma) t')                                   (t' = 0 after the last step)
    x_s = sqrt(a_s) x0 + sqrt(1 - a_s) eps                      (`pred_noised_sample`)
    x' = sqrt(a' / a_s) x_s + sqrt(1 - a' / a_s) z,   z ~ N(0, I), when gamma > 0 and not the last step
    x' = x_s                                         otherwise

gamma = 0 is deterministic (s = t', DDIM's step); the last step returns x_s, which the pipeline decodes.
The per-step a_s, sqrt(a' / a_s) and sqrt(1 - a' / a_s) are computed on the host from the call's gamma, so a
new gamma changes table values only, never the compiled program.

Image-to-image is diffusers' generic pipelines' (TCD has none of its own): the full grid cut at `get_timesteps`'
start step, as `tables(..., strength=)` does for the other kinds.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import common, lcm
from .common import Array, Schedule, State, Tables

CLASS_NAME = "TCDScheduler"
DEFAULTS: dict[str, Any] = {
    **dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear"),
    **dict(trained_betas=None, original_inference_steps=50, set_alpha_to_one=True, prediction_type="epsilon"),
    **dict(rescale_betas_zero_snr=False),
}
PREDICTIONS = common.EVS
ONLY: dict[str, Any] = {}
FORCED: dict[str, dict[str, Any]] = {}
STOCHASTIC = True  # z: the caller draws it at every step; gamma = 0 and the last step ignore it


def alphas_cumprod(s: dict[str, Any]) -> np.ndarray:
    return common.alphas_cumprod(s)


def schedule(s: dict[str, Any], n: int, strength: float | None, eta: float) -> Schedule:
    """The grid's timesteps, a_t, a_s of the intermediate timestep, and the renoising from s to t'."""
    ac = alphas_cumprod(s)
    ts = lcm.grid(s, n)[common.first_step(n, strength) :]
    prev = np.concatenate([ts[1:], [0]]).astype(np.int64)
    # Like torch: (1 - gamma) * t' in float32, then floor.
    mid = np.floor(np.float32(1 - eta) * prev.astype(np.float32)).astype(np.int64)
    final = common.final_alpha(s, ac)
    a_prev, a_s = common.alpha_at(ac, prev, final), ac[mid]
    ratio = a_prev / a_s
    keep, fresh = np.sqrt(ratio), np.sqrt(np.float32(1) - ratio)
    if eta <= 0:
        keep[:], fresh[:] = 1, 0
    keep[-1], fresh[-1] = 1, 0
    signal, noise = common.ddpm_noising(ac, ts)
    return Schedule(
        timesteps=ts,
        signal=signal,
        noise=noise,
        coefficients=dict(alpha_t=ac[ts], alpha_s=a_s, keep=keep, fresh=fresh),
    )


def init_state(latents: Array) -> State:
    return State()


def scale_model_input(t: Tables, i: Array, sample: Array) -> Array:
    return sample


def step(t: Tables, state: State, i: Array, model_output: Array, x: Array, noise: Array | None) -> tuple[Array, State]:
    x0, eps = common.x0_eps(t, common.at(t, "alpha_t", i), model_output, x)
    a_s = common.at(t, "alpha_s", i)
    noised = a_s**0.5 * x0 + (1 - a_s) ** 0.5 * eps
    return common.at(t, "keep", i) * noised + common.at(t, "fresh", i) * noise, state
