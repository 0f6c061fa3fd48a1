"""Euler: diffusers' EulerDiscreteScheduler, step for step.

In the variance-exploding parameterisation x / sqrt(a_t), with sigma = sqrt((1 - a_t) / a_t), the probability
flow ODE is dx/dsigma = (x - x0) / sigma. Euler's method on it (Karras et al. 2022, Alg. 2, without churn):

    x' = x + (x - x0) / sigma * (sigma' - sigma),    x0 = x - sigma eps  (epsilon prediction)

The UNet sees x / sqrt(sigma^2 + 1), back at unit variance, at float (possibly fractional) timesteps.
`sigma_schedule` is shared with Euler ancestral.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import common
from .common import Array, Schedule, State, Tables

CLASS_NAME = "EulerDiscreteScheduler"
DEFAULTS: dict[str, Any] = {
    **common.COMMON,
    **common.SIGMA_OPTIONS,
    **dict(interpolation_type="linear", timestep_spacing="linspace", timestep_type="discrete"),
    **dict(rescale_betas_zero_snr=False, final_sigmas_type="zero"),
}
PREDICTIONS = (*common.EVS, "original_sample")
ONLY: dict[str, Any] = {}
FORCED: dict[str, dict[str, Any]] = {}
STOCHASTIC = False


def alphas_cumprod(s: dict[str, Any]) -> np.ndarray:
    return common.alphas_cumprod(s, finite_sigmas=True)


def sigma_schedule(s: dict[str, Any], n: int, strength: float | None) -> Schedule:
    """Float timesteps and the sigmas they sit at, plus the sigma the last step lands on (0 or sigma_min).

    Euler indexes its sigmas from `begin_index`, so image-to-image cuts the sigmas as the timesteps; the
    noising is Euler's add_noise, x0 + sigma noise.
    """
    T = s["num_train_timesteps"]
    ac = alphas_cumprod(s)
    train_sigmas = np.sqrt((1 - ac) / ac)  # float32, ascending in t
    last_sigma = train_sigmas[0] if s.get("final_sigmas_type") == "sigma_min" else 0.0
    ts = common.spaced(s, n).astype(np.float32)  # Euler feeds the UNet float (possibly fractional) timesteps
    sigmas = np.interp(ts, np.arange(T), train_sigmas)
    if s.get("use_karras_sigmas"):  # Euler ramps between the spaced schedule's own end points
        sigmas = common.karras(s, sigmas[-1].item(), sigmas[0].item(), n)
        ts = common.sigma_to_t(sigmas, np.log(train_sigmas)).astype(np.float32)
    sigmas = np.concatenate([sigmas, [last_sigma]]).astype(np.float32)
    top = sigmas.max()
    # "leading" starts below sigma_max, so diffusers scales the initial noise to the x_T's full variance
    init_noise_sigma = top if s["timestep_spacing"] != "leading" else np.sqrt(top**2 + 1)
    start = common.first_step(n, strength)
    ts, sigmas = ts[start:], sigmas[start:]
    noise = np.asarray(sigmas[: len(ts)], np.float32)
    return Schedule(
        timesteps=ts,
        signal=np.ones_like(noise),
        noise=noise,
        coefficients={"sigmas": sigmas},
        init_noise_sigma=init_noise_sigma,
    )


def schedule(s: dict[str, Any], n: int, strength: float | None, eta: float) -> Schedule:
    return sigma_schedule(s, n, strength)


def init_state(latents: Array) -> State:
    return State()


def scale_model_input(t: Tables, i: Array, sample: Array) -> Array:
    """x / sqrt(sigma^2 + 1): the variance-preserving x_t the UNet was trained on."""
    return sample / (common.at(t, "sigmas", i) ** 2 + 1) ** 0.5


def x0(t: Tables, sigma: Array, model_output: Array, x: Array) -> Array:
    """The data prediction, from the model output at noise level sigma."""
    if t.prediction_type == "epsilon":
        return x - sigma * model_output
    if t.prediction_type == "sample":
        return model_output
    return model_output * (-sigma / (sigma**2 + 1) ** 0.5) + (x / (sigma**2 + 1))  # v_prediction


def step(t: Tables, state: State, i: Array, model_output: Array, x: Array, noise: Array | None) -> tuple[Array, State]:
    sigma, sigma_next = common.at(t, "sigmas", i), common.at(t, "sigmas", i + 1)
    derivative = (x - x0(t, sigma, model_output, x)) / sigma
    return x + derivative * (sigma_next - sigma), state
