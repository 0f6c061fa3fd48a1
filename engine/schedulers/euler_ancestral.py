"""Euler ancestral: diffusers' EulerAncestralDiscreteScheduler (k-diffusion's sample_euler_ancestral), step for step.

Each step splits the way down from sigma to sigma' into a deterministic part and fresh noise of the same total
variance (Karras et al. 2022, eq. 6 run backwards):

    sigma_up = sqrt(sigma'^2 (sigma^2 - sigma'^2) / sigma^2),    sigma_down = sqrt(sigma'^2 - sigma_up^2)
    x' = x + (x - x0) / sigma * (sigma_down - sigma) + sigma_up * z,    z ~ N(0, I) fresh at every step

Euler's sigma schedule and model-input scaling, with this class's own defaults (no Karras sigmas, last sigma 0).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from . import common, euler
from .common import Array, Schedule, State, Tables

CLASS_NAME = "EulerAncestralDiscreteScheduler"
DEFAULTS: dict[str, Any] = {**common.COMMON, "timestep_spacing": "linspace", "rescale_betas_zero_snr": False}
PREDICTIONS = common.EV
ONLY: dict[str, Any] = {}
FORCED: dict[str, dict[str, Any]] = {}
STOCHASTIC = True  # z: the caller draws it, standard normal and shaped like the sample, at every step


def alphas_cumprod(s: dict[str, Any]) -> np.ndarray:
    return common.alphas_cumprod(s, finite_sigmas=True)


def schedule(s: dict[str, Any], n: int, strength: float | None, eta: float) -> Schedule:
    return euler.sigma_schedule(s, n, strength)


def init_state(latents: Array) -> State:
    return State()


scale_model_input = euler.scale_model_input


def step(t: Tables, state: State, i: Array, model_output: Array, x: Array, noise: Array | None) -> tuple[Array, State]:
    sigma, sigma_next = common.at(t, "sigmas", i), common.at(t, "sigmas", i + 1)
    derivative = (x - euler.x0(t, sigma, model_output, x)) / sigma
    # Ancestral step: go deterministically down to sigma_down, then add fresh noise of std sigma_up.
    sigma_up = (sigma_next**2 * (sigma**2 - sigma_next**2) / sigma**2) ** 0.5
    sigma_down = jnp.maximum(sigma_next**2 - sigma_up**2, 0.0) ** 0.5  # >= 0 in exact arithmetic; rounding can dip
    return x + derivative * (sigma_down - sigma) + noise * sigma_up, state
