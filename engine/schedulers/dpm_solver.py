"""DPM-Solver++(2M): diffusers' DPMSolverMultistepScheduler (dpmsolver++, solver_order 2), step for step.

Two kinds share this module: "dpm++2m" on the config's own sigmas and "dpm++2m_karras" on Karras sigmas; the
kind's name fixes the algorithm, the order and the sigma ramp, whatever the folder says (`FORCED`).

DPM-Solver++ (Lu et al. 2022) in the variance-preserving x_t = alpha_t x0 + sigma_t eps, with
alpha = 1 / sqrt(sigma_ve^2 + 1), sigma = sigma_ve alpha and lambda = log(alpha / sigma):

    h = lambda' - lambda,    first order:  x' = (sigma' / sigma) x - alpha' (e^-h - 1) D0
    second order (2M):       x' = (sigma' / sigma) x - alpha' (e^-h - 1) (D0 + D1 / 2)          (midpoint)
                             x' = (sigma' / sigma) x - alpha' (e^-h - 1) D0 + alpha' ((e^-h - 1) / h + 1) D1
                                                                                                (heun)
    D0 = x0 now,  D1 = (x0 - x0_prev) / r0,  r0 = (lambda - lambda_prev) / h

The first step is first order (no history yet); so is the last when `lower_order_final` (below 15 steps),
`euler_at_final`, or when it lands on sigma = 0 (lambda = inf).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from . import common
from .common import Array, Schedule, State, Tables

CLASS_NAME = "DPMSolverMultistepScheduler"
DEFAULTS: dict[str, Any] = {
    **common.COMMON,
    **common.SIGMA_OPTIONS,
    **dict(solver_order=2, thresholding=False, algorithm_type="dpmsolver++", solver_type="midpoint"),
    **dict(lower_order_final=True, euler_at_final=False, use_lu_lambdas=False, use_flow_sigmas=False),
    **dict(final_sigmas_type="zero", lambda_min_clipped=-float("inf"), variance_type=None),
    **dict(timestep_spacing="linspace", rescale_betas_zero_snr=False, use_dynamic_shifting=False),
}
PREDICTIONS = common.EVS
ONLY: dict[str, Any] = {}
_DPM = dict(algorithm_type="dpmsolver++", solver_order=2)
FORCED: dict[str, dict[str, Any]] = {
    "dpm++2m": {**_DPM, "use_karras_sigmas": False},
    "dpm++2m_karras": {**_DPM, "use_karras_sigmas": True},
}
STOCHASTIC = False


def alphas_cumprod(s: dict[str, Any]) -> np.ndarray:
    return common.alphas_cumprod(s, finite_sigmas=True)


def schedule(s: dict[str, Any], n: int, strength: float | None, eta: float) -> Schedule:
    """Integer timesteps (fractional on cosine betas with Karras sigmas), their sigmas plus the last one's
    landing sigma, and the order of each step. Image-to-image restarts at first order, as diffusers does."""
    T = s["num_train_timesteps"]
    ac = alphas_cumprod(s)
    train_sigmas = np.sqrt((1 - ac) / ac)  # float32, ascending in t
    last_sigma = train_sigmas[0] if s["final_sigmas_type"] == "sigma_min" else 0.0
    if s["use_karras_sigmas"]:  # DPM ramps over the whole training range, ignoring timestep_spacing
        sigmas = common.karras(s, train_sigmas[0].item(), train_sigmas[-1].item(), n)
        ts = common.sigma_to_t(sigmas, np.log(train_sigmas))
        ts = (ts if s["beta_schedule"] == "squaredcos_cap_v2" else np.round(ts)).astype(np.int64)
    else:
        if s["timestep_spacing"] == "linspace":  # DPM spaces n + 1 points and drops the last
            ts = np.round(np.linspace(0, T - 1, n + 1))[::-1][:-1]
        elif s["timestep_spacing"] == "leading":
            ts = (np.arange(n + 1) * (T // (n + 1)))[::-1][:-1] + s["steps_offset"]
        else:
            ts = common.spaced(s, n)
        ts = ts.astype(np.int64)
        sigmas = np.interp(ts, np.arange(T), train_sigmas)
    sigmas = np.concatenate([sigmas, [last_sigma]]).astype(np.float32)
    order = np.full(len(ts), 2, np.int32)
    # The last step is first order when asked, and always when it lands on sigma = 0 (lambda = inf).
    if s["euler_at_final"] or (s["lower_order_final"] and len(ts) < 15) or s["final_sigmas_type"] == "zero":
        order[-1] = 1
    start = common.first_step(n, strength)  # DPM indexes its sigmas from `begin_index`: cut them alike
    ts, sigmas, order = ts[start:], sigmas[start:], order[start:].copy()
    order[0] = 1  # no history yet
    sigma = np.asarray(sigmas[: len(ts)], np.float32)
    alpha = 1 / np.sqrt(sigma**2 + 1)  # variance preserving: add_noise is alpha_t x0 + sigma_t noise
    return Schedule(
        timesteps=ts,
        signal=alpha,
        noise=sigma * alpha,
        coefficients={"sigmas": sigmas, "order": order},
        options={"solver_type": s["solver_type"]},
    )


def init_state(latents: Array) -> State:
    return State(prev_x0=jnp.zeros(latents.shape, jnp.float32))


def scale_model_input(t: Tables, i: Array, sample: Array) -> Array:
    return sample


def step(t: Tables, state: State, i: Array, model_output: Array, x: Array, noise: Array | None) -> tuple[Array, State]:
    def coefficients(j: Array) -> tuple[Array, Array, Array]:
        # alpha, sigma of the variance-preserving x at noise level sigmas[j], and lambda = log(alpha / sigma)
        alpha = 1 / (common.at(t, "sigmas", j) ** 2 + 1) ** 0.5
        sigma = common.at(t, "sigmas", j) * alpha
        return alpha, sigma, jnp.log(alpha) - jnp.log(sigma)

    alpha_t, sigma_t, lambda_t = coefficients(i + 1)  # where this step lands
    alpha_s0, sigma_s0, lambda_s0 = coefficients(i)
    _, _, lambda_s1 = coefficients(jnp.maximum(i - 1, 0))  # the previous step's level
    if t.prediction_type == "epsilon":
        x0 = (x - sigma_s0 * model_output) / alpha_s0
    elif t.prediction_type == "sample":
        x0 = model_output
    else:
        x0 = alpha_s0 * x - sigma_s0 * model_output
    h = lambda_t - lambda_s0
    r0 = (lambda_s0 - lambda_s1) / h
    d1 = (1.0 / r0) * (x0 - state.prev_x0)  # inf/nan where order is 1; `where` discards it
    first = (sigma_t / sigma_s0) * x - (alpha_t * (jnp.exp(-h) - 1.0)) * x0
    if t.option("solver_type") == "midpoint":
        second = first - 0.5 * (alpha_t * (jnp.exp(-h) - 1.0)) * d1
    else:
        second = first + (alpha_t * ((jnp.exp(-h) - 1.0) / h + 1.0)) * d1
    return jnp.where(common.at(t, "order", i) == 2, second, first), State(prev_x0=x0)
