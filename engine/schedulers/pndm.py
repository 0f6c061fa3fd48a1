"""PNDM with skip_prk_steps, i.e. PLMS (the SD 1.x default): diffusers' PNDMScheduler, step for step.

PLMS (Liu et al. 2022, eqs. 9, 12): a linear multistep method on the noise prediction,

    eps' = (55 e_0 - 59 e_1 + 37 e_2 - 9 e_3) / 24   (lower orders first: e_0, (3 e_0 - e_1) / 2, ...)

followed by PNDM's transfer, which is DDIM's step written without x0:

    x' = sqrt(a' / a) x - (a' - a) eps' / (a sqrt(1 - a') + sqrt(a (1 - a) a'))

where a, a' are a_t of the timestep the step starts from and lands on. diffusers' PLMS visits t_1 twice: its
call 1 redoes t_0 -> t_1 from x_{t_0} with the two outputs averaged (a Heun step), so n > 1 steps take n + 1
UNet evaluations.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from . import common
from .common import Array, Schedule, State, Tables

CLASS_NAME = "PNDMScheduler"
DEFAULTS: dict[str, Any] = {
    **common.COMMON,
    **dict(skip_prk_steps=False, set_alpha_to_one=False, timestep_spacing="leading"),
}
PREDICTIONS = common.EV
ONLY = {"skip_prk_steps": True}  # False means diffusers' Runge-Kutta warm-up, which we do not implement
FORCED: dict[str, dict[str, Any]] = {}
STOCHASTIC = False


def alphas_cumprod(s: dict[str, Any]) -> np.ndarray:
    return common.alphas_cumprod(s)


def schedule(s: dict[str, Any], n: int, strength: float | None, eta: float) -> Schedule:
    """Integer timesteps with t_1 repeated, and a_t of where each call starts from and lands on.

    Both step by T // n whatever the spacing. Call 1 redoes the step before it (from `t + gap` to `t`),
    whatever the timesteps are: diffusers counts calls, so an image-to-image schedule cut short does the same
    from its own first step.
    """
    ac = alphas_cumprod(s)
    ts = np.round(common.spaced(s, n)).astype(np.int64)
    if n > 1:
        ts = np.concatenate([ts[:1], ts[1:2], ts[1:]])
    ts = ts[common.first_step(n, strength) :]
    gap = s["num_train_timesteps"] // n
    cur, prev = ts.copy(), ts - gap
    cur[1:2], prev[1:2] = ts[1:2] + gap, ts[1:2]
    final = common.final_alpha(s, ac)
    signal, noise = common.ddpm_noising(ac, ts)
    alphas = dict(alpha_t=common.alpha_at(ac, cur, final), alpha_prev=common.alpha_at(ac, prev, final))
    return Schedule(timesteps=ts, signal=signal, noise=noise, coefficients=alphas)


def init_state(latents: Array) -> State:
    zeros = jnp.zeros(latents.shape, jnp.float32)
    return State(ets=jnp.zeros((4, *latents.shape), jnp.float32), cur_sample=zeros)


def scale_model_input(t: Tables, i: Array, sample: Array) -> Array:
    return sample


def step(t: Tables, state: State, i: Array, model_output: Array, x: Array, noise: Array | None) -> tuple[Array, State]:
    e = state.ets  # e[3] is the newest
    mo = model_output
    # Call 1 averages with call 0's output (Heun); later calls use the PLMS formula of the order available.
    eps = jnp.select(
        [i == 0, i == 1, i == 2, i == 3],
        [mo, (mo + e[3]) / 2, (3 * mo - e[3]) / 2, (23 * mo - 16 * e[3] + 5 * e[2]) / 12],
        (1 / 24) * (55 * mo - 59 * e[3] + 37 * e[2] - 9 * e[1]),
    )
    base = jnp.where(i == 1, state.cur_sample, x)
    ets = jnp.where(i == 1, e, jnp.concatenate([e[1:], mo[None]]))
    state = State(ets=ets, cur_sample=jnp.where(i == 0, x, state.cur_sample))
    a_t, a_prev = common.at(t, "alpha_t", i), common.at(t, "alpha_prev", i)
    b_t, b_prev = 1 - a_t, 1 - a_prev
    if t.prediction_type == "v_prediction":
        eps = a_t**0.5 * eps + b_t**0.5 * base
    # PNDM's transfer (Liu et al. 2022, eq. 9), algebraically DDIM's step written without x0.
    denom = a_t * b_prev**0.5 + (a_t * b_t * a_prev) ** 0.5
    return (a_prev / a_t) ** 0.5 * base - (a_prev - a_t) * eps / denom, state
