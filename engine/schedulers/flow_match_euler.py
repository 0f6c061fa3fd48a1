"""Flow matching: diffusers' FlowMatchEulerDiscreteScheduler, step for step (SD3, SD 3.5, FLUX.1).

A rectified-flow model (Esser et al. 2024, "Scaling Rectified Flow Transformers") is trained on the straight
path x_sigma = (1 - sigma) x0 + sigma noise, sigma in [0, 1], and predicts its velocity v = noise - x0. Sampling
is Euler's method on dx/dsigma = v from sigma = 1 down to 0:

    x' = x + (sigma' - sigma) v

The model is fed x itself at timestep sigma * T (T = num_train_timesteps = 1000). The sigmas are spaced
evenly and then shifted towards the noisy end, `shift * s / (1 + (shift - 1) s)` (SD3: shift 3), or, with
`use_dynamic_shifting`, by an amount that grows with the picture's token count (`mu`, FLUX.1):
exp(mu) / (exp(mu) + (1 / s - 1)). As diffusers, the static shift is applied twice over: once to the training
sigmas whose ends the schedule spans, once to the spaced schedule.

Some pipelines hand `set_timesteps` sigmas of their own, linspace(1, 1/n, n), which are then shifted as above:
FluxPipeline computes them in numpy's float64 ("numpy"), ZImagePipeline in torch's float32 ("torch",
`get_default_z_image_sigmas`); the two differ in the last bit of about half the values, and so do the timesteps.

Image-to-image starts at the step `strength` selects, as diffusers' SD3 and FLUX img2img pipelines count it
(`int(n - n * strength)`, not the `n - int(n * strength)` of the SD pipelines), from
`scale_noise(image, noise, sigma) = (1 - sigma) image + sigma noise`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import common
from .common import Array, Schedule, State, Tables

CLASS_NAME = "FlowMatchEulerDiscreteScheduler"
FLOW = True  # for rectified-flow models only; the other kinds are for noise-predicting (DDPM-trained) ones
DEFAULTS: dict[str, Any] = {
    **dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False, base_shift=0.5, max_shift=1.15),
    **dict(base_image_seq_len=256, max_image_seq_len=4096, invert_sigmas=False, shift_terminal=None),
    **dict(use_karras_sigmas=False, use_exponential_sigmas=False, use_beta_sigmas=False),
    **dict(time_shift_type="exponential", stochastic_sampling=False, prediction_type="flow"),
}
PREDICTIONS = ("flow",)
ONLY: dict[str, Any] = {
    **dict(use_dynamic_shifting=common.ANY, invert_sigmas=False, stochastic_sampling=False),
    **dict(use_karras_sigmas=False, use_exponential_sigmas=False, use_beta_sigmas=False),
}
CHOICES = {"time_shift_type": ("exponential", "linear")}
FORCED: dict[str, dict[str, Any]] = {}
STOCHASTIC = False


def alphas_cumprod(s: dict[str, Any]) -> np.ndarray:
    raise ValueError("a flow-matching schedule has no alphas_cumprod: its models are trained on sigma directly")


def calculate_shift(s: dict[str, Any], image_tokens: int) -> float:
    """diffusers' `calculate_shift`: mu, linear in the picture's token count between the config's two anchors."""
    m = (s["max_shift"] - s["base_shift"]) / (s["max_image_seq_len"] - s["base_image_seq_len"])
    return image_tokens * m + (s["base_shift"] - m * s["base_image_seq_len"])


def _time_shift(s: dict[str, Any], mu: float, sigmas: np.ndarray) -> np.ndarray:
    if s["time_shift_type"] == "exponential":
        return math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1))
    return mu / (mu + (1 / sigmas - 1))


UNIFORM = ("numpy", "torch")  # whose linspace(1, 1/n, n) a pipeline hands the scheduler (True: "numpy")


def torch_linspace(start: float, end: float, n: int) -> np.ndarray:
    """`torch.linspace(start, end, n)` in float32 as torch computes it on the CPU, bit for bit: the step in float32,
    the first half counted up from `start` and the second down from `end`, each value rounded once from the exact
    `start + step * i` (its kernel's fused multiply-add; exact in float64, whose 53 bits hold the product)."""
    f32 = np.float32
    first, last = f32(start), f32(end)
    if n == 1:
        return np.array([first])
    step = f32((last - first) / f32(n - 1))
    i = np.arange(n)
    up = (np.float64(first) + np.float64(step) * i).astype(f32)
    down = (np.float64(last) - np.float64(step) * (n - 1 - i)).astype(f32)
    return np.where(i < n // 2, up, down)


def uniform_sigmas(n: int, uniform: bool | str) -> np.ndarray:
    """The sigmas linspace(1, 1/n, n) (float32) that a pipeline hands `set_timesteps`: FluxPipeline's numpy
    float64 ones ("numpy", or True) or ZImagePipeline's torch float32 ones ("torch")."""
    kind = "numpy" if uniform is True else uniform
    if kind not in UNIFORM:
        raise ValueError(f"uniform sigmas are computed as {' or '.join(UNIFORM)} computes them, not {uniform!r}")
    if kind == "torch":
        return torch_linspace(1.0, 1 / n, n)
    return np.linspace(1.0, 1 / n, n).astype(np.float32)


def sigmas_for(
    s: dict[str, Any], n: int, image_tokens: int | None, uniform: bool | str, mu: float | None = None
) -> np.ndarray:
    """The n shifted sigmas of `set_timesteps` (float32, descending), without the terminal 0.

    `uniform`: the sigmas a pipeline hands `set_timesteps`, linspace(1, 1/n, n) as `uniform_sigmas` computes them
    (True or "numpy": FluxPipeline's; "torch": ZImagePipeline's); False: the scheduler's own, evenly spaced between
    its training schedule's first and last sigma. `mu`: the dynamic shift where the pipeline computes it itself
    (Flux2KleinPipeline's `compute_empirical_mu`); None: `calculate_shift` from the config and the token count.
    """
    T, shift = s["num_train_timesteps"], s["shift"]
    if uniform:
        sigmas = uniform_sigmas(n, uniform)
    else:
        train = np.linspace(1, T, T, dtype=np.float32)[::-1] / T  # float32, as the torch tensor
        if not s["use_dynamic_shifting"]:
            train = shift * train / (1 + (shift - 1) * train)
        sigma_max, sigma_min = float(train[0]), float(train[-1])
        sigmas = (np.linspace(sigma_max * T, sigma_min * T, n) / T).astype(np.float64)
    if s["use_dynamic_shifting"]:
        if mu is None and image_tokens is None:
            raise ValueError("a dynamically shifted flow schedule needs the picture's token count")
        sigmas = _time_shift(s, calculate_shift(s, image_tokens) if mu is None else mu, sigmas)
    else:
        sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    if s["shift_terminal"]:
        one_minus = 1 - sigmas
        if one_minus[-1] == 0:  # diffusers divides by zero here and draws NaN
            raise ValueError(f"this model's schedule (shift_terminal) needs at least 2 steps, not {n}")
        sigmas = 1 - one_minus / (one_minus[-1] / (1 - s["shift_terminal"]))
    return np.asarray(sigmas, np.float32)


def start_step(n: int, strength: float | None) -> int:
    """Where the SD3 and FLUX image-to-image pipelines start an n-step schedule (`get_timesteps`)."""
    if strength is None:
        return 0
    start = int(max(n - min(n * strength, n), 0))
    if start >= n:
        raise ValueError(f"strength {strength} leaves no step of {n}; raise the strength or the steps")
    return start


def schedule(
    s: dict[str, Any],
    n: int,
    strength: float | None,
    eta: float,
    image_tokens: int | None = None,
    uniform=False,
    mu: float | None = None,
) -> Schedule:
    sigmas = sigmas_for(s, n, image_tokens, uniform, mu)
    timesteps = (sigmas * np.float32(s["num_train_timesteps"])).astype(np.float32)
    sigmas = np.concatenate([sigmas, np.zeros(1, np.float32)])
    start = start_step(n, strength)
    noise = sigmas[start:n]
    return Schedule(
        timesteps=timesteps[start:],
        signal=(1 - noise).astype(np.float32),
        noise=noise,
        coefficients={"sigmas": sigmas[start:]},
    )


def init_state(latents: Array) -> State:
    return State()


def scale_model_input(t: Tables, i: Array, sample: Array) -> Array:
    return sample  # the model reads x_sigma itself


def step(t: Tables, state: State, i: Array, model_output: Array, x: Array, noise: Array | None) -> tuple[Array, State]:
    sigma, sigma_next = common.at(t, "sigmas", i), common.at(t, "sigmas", i + 1)
    return x + (sigma_next - sigma) * model_output, state
