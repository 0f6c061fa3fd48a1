"""What every scheduler algorithm shares: the config, the noise schedule a_t, timestep spacing, the tables.

With betas beta_t, t = 0..T-1, a_t = prod_{s <= t} (1 - beta_s) ("alphas_cumprod") is the signal fraction of
x_t = sqrt(a_t) x0 + sqrt(1 - a_t) eps, and sigma_t = sqrt((1 - a_t) / a_t) the noise level of x_t / sqrt(a_t).
The host (numpy) helpers compute these in diffusers' order and dtypes; `Tables` and `State` are the pytrees
the traced loop carries; `x0_eps` turns a model output into data and noise predictions.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ConfigError
from ..models.config import _FromJson

Array = jax.Array

# Keys of other diffusers schedulers (DDPM, LMS, Heun, UniPC, DEIS, ...) and options that only matter together
# with an unsupported one: a folder may carry them, none of our kinds reads them.
_IGNORED_KEYS = frozenset(
    "disable_corrector dynamic_thresholding_ratio flow_shift predict_x0 rho sample_max_value"
    " sigma_data sigma_schedule solver_p".split()
)
ANY = object()  # in an algorithm's ONLY: an option the common table refuses that this algorithm implements


@dataclasses.dataclass(frozen=True)
class SchedulerConfig(_FromJson):
    """The keys a scheduler_config.json sets, named as in diffusers; None means absent (a kind default applies)."""

    class_name: str | None = None  # `_class_name`: the diffusers class the folder was saved with
    num_train_timesteps: int | None = None
    beta_start: float | None = None
    beta_end: float | None = None
    beta_schedule: str | None = None  # linear | scaled_linear (sqrt-spaced, SD) | squaredcos_cap_v2
    trained_betas: tuple[float, ...] | None = None
    prediction_type: str | None = None  # epsilon | v_prediction | sample
    timestep_spacing: str | None = None  # leading | trailing | linspace
    steps_offset: int | None = None  # added to "leading" timesteps (SD folders: 1)
    set_alpha_to_one: bool | None = None  # DDIM/PNDM: a_prev past t=0 is 1, not a_0
    skip_prk_steps: bool | None = None  # PNDM: False means a Runge-Kutta warm-up, which we do not support
    clip_sample: bool | None = None  # DDIM/LCM: clip x0 to +-clip_sample_range
    clip_sample_range: float | None = None
    thresholding: bool | None = None
    rescale_betas_zero_snr: bool | None = None  # Lin et al. 2024: rescale so that a_T = 0
    interpolation_type: str | None = None
    timestep_type: str | None = None
    use_karras_sigmas: bool | None = None
    use_exponential_sigmas: bool | None = None
    use_beta_sigmas: bool | None = None
    use_lu_lambdas: bool | None = None
    use_flow_sigmas: bool | None = None
    use_dynamic_shifting: bool | None = None
    sigma_min: float | None = None  # Karras ramp end points; default: the schedule's own
    sigma_max: float | None = None
    final_sigmas_type: str | None = None  # zero | sigma_min: the noise level the last step lands on
    algorithm_type: str | None = None  # DPM: the kind fixes dpmsolver++
    solver_order: int | None = None  # DPM: the kind fixes 2
    solver_type: str | None = None  # DPM: midpoint | heun, the second-order correction
    lower_order_final: bool | None = None  # DPM: first order at the last step below 15 steps
    euler_at_final: bool | None = None  # DPM: always first order at the last step
    lambda_min_clipped: float | None = None
    variance_type: str | None = None
    original_inference_steps: int | None = None  # LCM/TCD: the distillation's step grid (T // it apart)
    timestep_scaling: float | None = None  # LCM: the boundary-condition scalings see t * timestep_scaling
    shift: float | None = None  # flow matching: the static shift of the sigmas towards noise (SD3: 3.0)
    base_shift: float | None = None  # flow matching's dynamic shift: mu at base_image_seq_len tokens ...
    max_shift: float | None = None  # ... and at max_image_seq_len tokens, linear in between
    base_image_seq_len: int | None = None
    max_image_seq_len: int | None = None
    shift_terminal: float | None = None  # flow matching: the schedule stretched to end at this sigma
    time_shift_type: str | None = None  # flow matching's dynamic shift: exponential | linear
    invert_sigmas: bool | None = None
    stochastic_sampling: bool | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "scheduler config") -> SchedulerConfig:
        # diffusers lists in `_use_default_values` the keys the saving class defaulted; a switch drops them.
        defaulted = set(raw.get("_use_default_values") or ())
        kept = {k: v for k, v in raw.items() if not k.startswith("_") and k not in defaulted}
        names = {f.name for f in dataclasses.fields(cls)} - {"class_name"}
        unknown = sorted(set(kept) - names - _IGNORED_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown scheduler keys: {', '.join(unknown)}")
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in kept.items() if k in names}
        return cls(class_name=raw.get("_class_name"), **fields)

    @property
    def default_kind(self) -> str | None:
        """The kind this folder's own scheduler class corresponds to, or None when we have no such kind."""
        from . import default_kind  # the registry imports this module

        return default_kind(self)


# Each diffusers class's own `__init__` defaults start from these; keys outside a kind's DEFAULTS are ignored
# by that kind, as diffusers' from_config ignores them.
COMMON = {
    **dict(num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear", trained_betas=None),
    **dict(prediction_type="epsilon", steps_offset=0),
}
SIGMA_OPTIONS = dict(
    use_karras_sigmas=False, use_exponential_sigmas=False, use_beta_sigmas=False, sigma_min=None, sigma_max=None
)
EV, EVS = ("epsilon", "v_prediction"), ("epsilon", "v_prediction", "sample")
_UNSUPPORTED = {  # option: the only value we support, for every kind that reads the option
    **dict(thresholding=False, use_exponential_sigmas=False, use_beta_sigmas=False, use_lu_lambdas=False),
    **dict(use_flow_sigmas=False, use_dynamic_shifting=False, variance_type=None, interpolation_type="linear"),
    **dict(timestep_type="discrete", lambda_min_clipped=-math.inf),
}
_CHOICES = dict(
    beta_schedule=("linear", "scaled_linear", "squaredcos_cap_v2"),
    timestep_spacing=("leading", "trailing", "linspace"),
    final_sigmas_type=("zero", "sigma_min"),
    solver_type=("midpoint", "heun"),
)


def validate(
    kind: str, s: dict[str, Any], predictions: tuple[str, ...], only: dict[str, Any], own_choices: dict | None = None
) -> None:
    """Refuses options we do not implement: `only` adds the algorithm's own single-valued options (`ANY`: one the
    algorithm implements whatever its value), `own_choices` its own multiple-choice ones."""
    for name, value in {**_UNSUPPORTED, **only}.items():
        if value is not ANY and name in s and s[name] != value:
            raise ConfigError(f"scheduler {kind!r}: {name}={s[name]!r} is not supported (only {value!r})")
    for name, choices in [*_CHOICES.items(), *(own_choices or {}).items(), ("prediction_type", predictions)]:
        if name in s and s[name] not in choices:
            raise ConfigError(f"scheduler {kind!r}: {name}={s[name]!r} is not supported (one of {choices})")
    if s.get("trained_betas") is not None and len(s["trained_betas"]) != s["num_train_timesteps"]:
        raise ConfigError("trained_betas must have num_train_timesteps entries")


def alphas_cumprod(s: dict[str, Any], finite_sigmas: bool = False) -> np.ndarray:
    """a_t for t = 0..T-1, float32 as diffusers keeps it.

    `finite_sigmas`: the sigma-based schedulers (Euler, DPM) put a_T = 2^-24, not 0, after a zero-SNR rescale,
    which keeps sigma_T finite.
    """
    T = s["num_train_timesteps"]
    f32 = np.float32
    if s["trained_betas"] is not None:
        betas = np.asarray(s["trained_betas"], f32)
    elif s["beta_schedule"] == "linear":  # torch.linspace in float32 agrees to one ulp
        betas = np.linspace(s["beta_start"], s["beta_end"], T).astype(f32)
    elif s["beta_schedule"] == "scaled_linear":
        betas = np.linspace(s["beta_start"] ** 0.5, s["beta_end"] ** 0.5, T).astype(f32) ** 2
    else:  # squaredcos_cap_v2 (Nichol & Dhariwal 2021), in float64 like diffusers' Python loop
        abar = [math.cos((i / T + 0.008) / 1.008 * math.pi / 2) ** 2 for i in range(T + 1)]
        betas = np.array([min(1 - abar[i + 1] / abar[i], 0.999) for i in range(T)], f32)

    def cumprod(alphas: np.ndarray) -> np.ndarray:  # torch.cumprod accumulates float32 in float64
        return np.cumprod(alphas.astype(np.float64)).astype(f32)

    if s.get("rescale_betas_zero_snr"):  # shift and scale sqrt(a_t) so that the last one is 0
        root = np.sqrt(cumprod(1 - betas))
        root = (root - root[-1]) * (root[0] / (root[0] - root[-1]))
        abar = root**2
        betas = 1 - np.concatenate([abar[:1], abar[1:] / abar[:-1]])
    ac = cumprod(1 - betas)
    if s.get("rescale_betas_zero_snr") and finite_sigmas:
        ac[-1] = 2.0**-24
    return ac


def final_alpha(s: dict[str, Any], ac: np.ndarray) -> np.float32:
    """The a_t a step lands on past t = 0 (`final_alpha_cumprod`): 1 with set_alpha_to_one, else a_0."""
    return np.float32(1.0) if s.get("set_alpha_to_one") else ac[0]


def alpha_at(ac: np.ndarray, t: np.ndarray, final: np.float32) -> np.ndarray:
    """a_t at integer timesteps t, `final` where t < 0."""
    if (t >= len(ac)).any():
        raise ValueError(f"timestep {t.max()} is outside the {len(ac)} training timesteps (steps_offset too big?)")
    return np.where(t >= 0, ac[np.clip(t, 0, None)], final).astype(np.float32)


def ddpm_noising(ac: np.ndarray, timesteps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DDPM's `add_noise(x0, noise, t)` = sqrt(a_t) x0 + sqrt(1 - a_t) noise at integer timesteps, float32."""
    a = ac[np.asarray(timesteps, np.int64)].astype(np.float32)
    return np.sqrt(a), np.sqrt(1 - a)


def spaced(s: dict[str, Any], n: int) -> np.ndarray:
    """The n training timesteps an n-step schedule visits, descending, float64 ("linspace" unrounded)."""
    T, spacing = s["num_train_timesteps"], s["timestep_spacing"]
    if spacing == "linspace":
        return np.linspace(0, T - 1, n)[::-1]
    if spacing == "leading":
        return (np.arange(n) * (T // n))[::-1] + float(s["steps_offset"])
    # For some n (61, 103, ...) np.arange also yields a last value that rounds to 0, i.e. a timestep of -1;
    # diffusers then runs an extra step (DDIM indexes a_{-1} = a_999). We keep the n steps asked for.
    return np.round(np.arange(T, 0, -T / n))[:n] - 1


def sigma_to_t(sigmas: np.ndarray, log_sigmas: np.ndarray) -> np.ndarray:
    """Fractional training timestep of each sigma, by interpolating log-sigma (diffusers' `_sigma_to_t`)."""
    log_sigma = np.log(np.maximum(sigmas, 1e-10))
    dists = log_sigma - log_sigmas[:, None]  # [T, n]
    low = np.cumsum(dists >= 0, axis=0).argmax(axis=0).clip(max=len(log_sigmas) - 2)
    w = np.clip((log_sigmas[low] - log_sigma) / (log_sigmas[low] - log_sigmas[low + 1]), 0, 1)
    return (1 - w) * low + w * (low + 1)


def karras(s: dict[str, Any], sigma_min: float, sigma_max: float, n: int) -> np.ndarray:
    """Karras et al. 2022, eq. 5 with rho = 7: evenly spaced in sigma^(1/rho)."""
    lo = (s["sigma_min"] if s["sigma_min"] is not None else sigma_min) ** (1 / 7.0)
    hi = (s["sigma_max"] if s["sigma_max"] is not None else sigma_max) ** (1 / 7.0)
    return (hi + np.linspace(0, 1, n) * (lo - hi)) ** 7.0


def start_step(num_inference_steps: int, strength: float) -> int:
    """diffusers' `get_timesteps`: image-to-image skips the first steps; strength 1 runs them all."""
    init = min(int(num_inference_steps * strength), num_inference_steps)
    return max(num_inference_steps - init, 0)


def first_step(n: int, strength: float | None) -> int:
    """The loop step an n-step schedule starts from: 0 without strength, else where diffusers' pipelines
    slice `scheduler.timesteps` (order 1) and `set_begin_index`. Solvers restart there."""
    start = 0 if strength is None else start_step(n, strength)
    if start >= n:
        raise ValueError(f"strength {strength} leaves no step of {n}; raise the strength or the steps")
    return start


@dataclasses.dataclass
class Schedule:
    """What an algorithm's host-side `schedule` returns: its loop steps, unpadded, numpy."""

    timesteps: np.ndarray  # what the UNet is fed at each loop step
    signal: np.ndarray  # `add_noise(x0, noise, t)` = signal * x0 + noise * noise at each loop step's timestep
    noise: np.ndarray
    coefficients: dict[str, np.ndarray]  # the algorithm's own per-step numbers (at least one per loop step)
    init_noise_sigma: float = 1.0  # text-to-image latents are standard normal times this
    options: dict[str, Any] = dataclasses.field(default_factory=dict)  # static: change the formula, recompile


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tables:
    """Per-step numbers for one step count, padded to L = max_steps + 1 entries; a pytree of arrays.

    `coefficients` holds the algorithm's own per-step arrays (Euler/DPM "sigmas", DDIM "alpha_t", ...), so
    its tree structure depends on the kind, which is static anyway. The static fields are config options that
    change the formula: like `kind`, they recompile.
    """

    timesteps: Array  # [L] f32: what the UNet is fed at loop step i
    coefficients: dict[str, Array]  # name -> [L] f32 or i32: what the algorithm's step reads at loop step i
    num_loop_steps: Array  # [] i32: UNet evaluations (PNDM: n + 1 for n > 1)
    num_inference_steps: Array  # [] i32: the n asked for
    init_noise_sigma: Array  # [] f32: initial latents are standard normal times this (plus the image's part)
    init_signal: Array  # [] f32: image modes start from init_signal * image latents + init_noise_sigma * noise
    blend_signal: Array  # [L] f32: 4-channel inpainting's known latents after step i are blend_signal * image
    blend_noise: Array  # [L] f32: ... + blend_noise * noise (add_noise at the next timestep; the clean image last)
    eta: Array  # [] f32: the stochasticity the call asked for (DDIM's eta, TCD's gamma); its coefficients are host-computed
    prediction_type: str = dataclasses.field(default="epsilon", metadata=dict(static=True))
    options: tuple[tuple[str, Any], ...] = dataclasses.field(default=(), metadata=dict(static=True))

    def option(self, name: str, default: Any = None) -> Any:
        """A static option the algorithm's schedule set (DDIM's "clip_sample_range", DPM's "solver_type")."""
        return dict(self.options).get(name, default)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class State:
    """What a multistep solver carries between loop steps; None for the fields its kind does not use."""

    ets: Array | None = None  # PNDM: last four model outputs, oldest first  [4, *latents.shape]
    cur_sample: Array | None = None  # PNDM: x_{t_0}, which the second (Heun) call steps from again
    prev_x0: Array | None = None  # DPM-Solver++: the previous step's data prediction


def at(t: Tables, name: str, i: Array) -> Array:
    """The algorithm's per-step coefficient `name` at (traced) loop index i."""
    return jnp.asarray(t.coefficients[name])[i]


def x0_eps(t: Tables, a_t: Array, model_output: Array, x: Array) -> tuple[Array, Array]:
    """Data and noise predictions from the model output, for the a_t-parameterised (DDIM-type) samplers:
    x = sqrt(a_t) x0 + sqrt(1 - a_t) eps, and v = sqrt(a_t) eps - sqrt(1 - a_t) x0 (Salimans & Ho 2022)."""
    b_t = 1 - a_t
    if t.prediction_type == "epsilon":
        return (x - b_t**0.5 * model_output) / a_t**0.5, model_output
    if t.prediction_type == "sample":
        return model_output, (x - a_t**0.5 * model_output) / b_t**0.5
    return a_t**0.5 * x - b_t**0.5 * model_output, a_t**0.5 * model_output + b_t**0.5 * x  # v_prediction
