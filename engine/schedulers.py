"""Noise schedulers as pure functions over arrays, matching diffusers' PyTorch schedulers step for step.

Kinds: "pndm" PNDMScheduler with skip_prk_steps (PLMS, the SD1.x default); "ddim" DDIMScheduler, eta = 0;
"euler" EulerDiscreteScheduler; "euler_a" EulerAncestralDiscreteScheduler; "dpm++2m" DPMSolverMultistepScheduler
(dpmsolver++, solver_order 2) and "dpm++2m_karras", the same on Karras sigmas.

With a_t = prod(1 - beta) ("alphas_cumprod") and sigma = sqrt((1 - a_t) / a_t):
  DDIM (Song et al. 2021, eq. 12):      x0 = (x - sqrt(1 - a_t) eps) / sqrt(a_t), x' = sqrt(a') x0 + sqrt(1 - a') eps
  PLMS (Liu et al. 2022, eqs. 9, 12):   eps' = (55 e_0 - 59 e_1 + 37 e_2 - 9 e_3) / 24 (lower orders first),
                                        then DDIM's step written without x0
  Euler (Karras et al. 2022, Alg. 2):   x' = x + (x - x0) / sigma * (sigma' - sigma)
  Euler ancestral (k-diffusion):        the same step down to sigma_down, plus sigma_up * z
  DPM-Solver++(2M) (Lu et al. 2022):    lambda = log(alpha / sigma), h = lambda' - lambda,
                                        x' = (sigma' / sigma) x - alpha' (e^-h - 1) (D0 + D1 / 2)

`tables` runs on the host: it computes every per-step number in numpy, as diffusers' `set_timesteps` does,
and pads it to `max_steps + 1` entries, so that the step count is traced. `timestep`, `scale_model_input` and
`step` index those tables at the traced loop index `i` inside one `lax.fori_loop`. Pass the Tables as a jit
argument, not as a closure constant, or every step count compiles anew.

`SchedulerConfig` keeps only the keys a scheduler_config.json sets; `settings(config, kind)` takes the kind's
own diffusers defaults for the rest, as `Other.from_config(pipe.scheduler.config)` does.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .errors import ConfigError
from .models.config import _FromJson

Array = jax.Array

SCHEDULERS: tuple[str, ...] = ("pndm", "ddim", "euler", "euler_a", "dpm++2m", "dpm++2m_karras")

_KIND_OF_CLASS = {"PNDMScheduler": "pndm", "DDIMScheduler": "ddim", "EulerDiscreteScheduler": "euler"}
_KIND_OF_CLASS |= {"EulerAncestralDiscreteScheduler": "euler_a", "DPMSolverMultistepScheduler": "dpm++2m"}

# Keys of other diffusers schedulers (DDPM, LMS, Heun, UniPC, DEIS, LCM, ...) and options that only matter
# together with an unsupported one: a folder may carry them, none of our kinds reads them.
_IGNORED_KEYS = frozenset(
    "disable_corrector dynamic_thresholding_ratio flow_shift original_inference_steps predict_x0 rho"
    " sample_max_value shift_terminal sigma_data sigma_schedule solver_p time_shift_type timestep_scaling".split()
)


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
    clip_sample: bool | None = None  # DDIM: clip x0 to +-clip_sample_range
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
        kind = _KIND_OF_CLASS.get(self.class_name or "")
        return "dpm++2m_karras" if kind == "dpm++2m" and self.use_karras_sigmas else kind


# Each diffusers class's own `__init__` defaults; keys outside a kind's table are ignored by that kind,
# as diffusers' from_config ignores them. DPM also reads sigma_min/sigma_max if the file has them.
_COMMON = {
    **dict(num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear", trained_betas=None),
    **dict(prediction_type="epsilon", steps_offset=0),
}
_SIGMA_OPTIONS = dict(
    use_karras_sigmas=False, use_exponential_sigmas=False, use_beta_sigmas=False, sigma_min=None, sigma_max=None
)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "pndm": {**_COMMON, "skip_prk_steps": False, "set_alpha_to_one": False, "timestep_spacing": "leading"},
    "ddim": {
        **_COMMON,
        **dict(clip_sample=True, set_alpha_to_one=True, thresholding=False, clip_sample_range=1.0),
        **dict(timestep_spacing="leading", rescale_betas_zero_snr=False),
    },
    "euler": {
        **_COMMON,
        **_SIGMA_OPTIONS,
        **dict(interpolation_type="linear", timestep_spacing="linspace", timestep_type="discrete"),
        **dict(rescale_betas_zero_snr=False, final_sigmas_type="zero"),
    },
    "euler_a": {**_COMMON, "timestep_spacing": "linspace", "rescale_betas_zero_snr": False},
    "dpm": {
        **_COMMON,
        **_SIGMA_OPTIONS,
        **dict(solver_order=2, thresholding=False, algorithm_type="dpmsolver++", solver_type="midpoint"),
        **dict(lower_order_final=True, euler_at_final=False, use_lu_lambdas=False, use_flow_sigmas=False),
        **dict(final_sigmas_type="zero", lambda_min_clipped=-math.inf, variance_type=None),
        **dict(timestep_spacing="linspace", rescale_betas_zero_snr=False, use_dynamic_shifting=False),
    },
}
_EV, _EVS = ("epsilon", "v_prediction"), ("epsilon", "v_prediction", "sample")
_PREDICTIONS = dict(pndm=_EV, ddim=_EVS, euler=(*_EVS, "original_sample"), euler_a=_EV, dpm=_EVS)
_UNSUPPORTED = {  # option: the only value we support
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


def _family(kind: str) -> str:
    if kind not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {kind!r}; choose one of {', '.join(SCHEDULERS)}")
    return "dpm" if kind.startswith("dpm") else kind


def settings(config: SchedulerConfig, kind: str) -> dict[str, Any]:
    """The effective options of `kind`: the file's keys where set, the kind's diffusers defaults elsewhere."""
    family = _family(kind)
    s = {k: default if getattr(config, k) is None else getattr(config, k) for k, default in _DEFAULTS[family].items()}
    if family == "dpm":  # the kind's name fixes these, whatever the folder says
        s.update(algorithm_type="dpmsolver++", solver_order=2, use_karras_sigmas=kind == "dpm++2m_karras")
    for name, only in _UNSUPPORTED.items():
        if name in s and s[name] != only:
            raise ConfigError(f"scheduler {kind!r}: {name}={s[name]!r} is not supported (only {only!r})")
    for name, choices in [*_CHOICES.items(), ("prediction_type", _PREDICTIONS[family])]:
        if name in s and s[name] not in choices:
            raise ConfigError(f"scheduler {kind!r}: {name}={s[name]!r} is not supported (one of {choices})")
    if family == "pndm" and not s["skip_prk_steps"]:
        raise ConfigError("scheduler 'pndm': skip_prk_steps=False (Runge-Kutta warm-up) is not supported")
    if s["trained_betas"] is not None and len(s["trained_betas"]) != s["num_train_timesteps"]:
        raise ConfigError("trained_betas must have num_train_timesteps entries")
    return s


def _alphas_cumprod(s: dict[str, Any], family: str) -> np.ndarray:
    """a_t for t = 0..T-1, float32 as diffusers keeps it."""
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
    if s.get("rescale_betas_zero_snr") and family != "ddim":
        ac[-1] = 2.0**-24  # keeps sigma_T finite for the sigma-based schedulers, as diffusers does
    return ac


def alphas_cumprod(config: SchedulerConfig, kind: str = "ddim") -> np.ndarray:
    """The noise schedule a_t, t = 0..T-1, that `config` describes: what a model is trained against."""
    return _alphas_cumprod(settings(config, kind), _family(kind))


def _spaced(s: dict[str, Any], n: int) -> np.ndarray:
    """The n training timesteps an n-step schedule visits, descending, float64 ("linspace" unrounded)."""
    T, spacing = s["num_train_timesteps"], s["timestep_spacing"]
    if spacing == "linspace":
        return np.linspace(0, T - 1, n)[::-1]
    if spacing == "leading":
        return (np.arange(n) * (T // n))[::-1] + float(s["steps_offset"])
    # For some n (61, 103, ...) np.arange also yields a last value that rounds to 0, i.e. a timestep of -1;
    # diffusers then runs an extra step (DDIM indexes a_{-1} = a_999). We keep the n steps asked for.
    return np.round(np.arange(T, 0, -T / n))[:n] - 1


def _alpha_at(ac: np.ndarray, t: np.ndarray, final: np.float32) -> np.ndarray:
    # DDIM/PNDM land past t = 0 on `final_alpha_cumprod`.
    if (t >= len(ac)).any():
        raise ValueError(f"timestep {t.max()} is outside the {len(ac)} training timesteps (steps_offset too big?)")
    return np.where(t >= 0, ac[np.clip(t, 0, None)], final).astype(np.float32)


def _sigma_to_t(sigmas: np.ndarray, log_sigmas: np.ndarray) -> np.ndarray:
    """Fractional training timestep of each sigma, by interpolating log-sigma (diffusers' `_sigma_to_t`)."""
    log_sigma = np.log(np.maximum(sigmas, 1e-10))
    dists = log_sigma - log_sigmas[:, None]  # [T, n]
    low = np.cumsum(dists >= 0, axis=0).argmax(axis=0).clip(max=len(log_sigmas) - 2)
    w = np.clip((log_sigmas[low] - log_sigma) / (log_sigmas[low] - log_sigmas[low + 1]), 0, 1)
    return (1 - w) * low + w * (low + 1)


def _karras(s: dict[str, Any], sigma_min: float, sigma_max: float, n: int) -> np.ndarray:
    """Karras et al. 2022, eq. 5 with rho = 7: evenly spaced in sigma^(1/rho)."""
    lo = (s["sigma_min"] if s["sigma_min"] is not None else sigma_min) ** (1 / 7.0)
    hi = (s["sigma_max"] if s["sigma_max"] is not None else sigma_max) ** (1 / 7.0)
    return (hi + np.linspace(0, 1, n) * (lo - hi)) ** 7.0


def _ddim_alphas(ts: np.ndarray, family: str, ac: np.ndarray, final: np.float32, gap: int) -> dict[str, np.ndarray]:
    """a_t of the timestep each loop step starts from and lands on; both step by T // n whatever the spacing.

    PNDM's call 1 redoes the step before it (from `t + gap` to `t`), whatever the timesteps are: diffusers
    counts calls, so an image-to-image schedule cut short does the same from its own first step.
    """
    cur, prev = ts.copy(), ts - gap
    if family == "pndm":
        cur[1:2], prev[1:2] = ts[1:2] + gap, ts[1:2]
    return dict(alpha_t=_alpha_at(ac, cur, final), alpha_prev=_alpha_at(ac, prev, final))


def start_step(num_inference_steps: int, strength: float) -> int:
    """diffusers' `get_timesteps`: image-to-image skips the first steps; strength 1 runs them all."""
    init = min(int(num_inference_steps * strength), num_inference_steps)
    return max(num_inference_steps - init, 0)


def _cut(sched: dict[str, Any], s: dict[str, Any], family: str, n: int, start: int) -> dict[str, Any]:
    """The schedule from loop step `start` on, as diffusers' pipelines slice `scheduler.timesteps` (order 1).

    Solvers restart there: DPM-Solver++ takes a first-order step first (no history yet), PNDM counts its
    calls from zero. Euler and DPM index their sigmas from `begin_index`, so the sigmas are cut the same way.
    """
    if start == 0:
        return sched
    out = {k: v[start:] for k, v in sched.items() if k != "init_noise_sigma"}
    out["init_noise_sigma"] = sched["init_noise_sigma"]
    if family in ("pndm", "ddim"):
        ac = _alphas_cumprod(s, family)
        final = np.float32(1.0) if s.get("set_alpha_to_one") else ac[0]
        out.update(_ddim_alphas(out["timesteps"], family, ac, final, s["num_train_timesteps"] // n))
    if family == "dpm":
        out["order"] = out["order"].copy()
        out["order"][0] = 1
    return out


def _noising(s: dict[str, Any], family: str, sched: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """`scheduler.add_noise(x0, noise, t)` = signal * x0 + noise_scale * noise at each loop step's timestep."""
    if family in ("pndm", "ddim"):  # DDPM's add_noise at the integer timestep
        a = _alphas_cumprod(s, family)[np.asarray(sched["timesteps"], np.int64)].astype(np.float32)
        return np.sqrt(a), np.sqrt(1 - a)
    sigmas = np.asarray(sched["sigmas"][: len(sched["timesteps"])], np.float32)
    if family == "dpm":  # variance preserving: alpha_t x0 + sigma_t noise
        alpha = 1 / np.sqrt(sigmas**2 + 1)
        return alpha, sigmas * alpha
    return np.ones_like(sigmas), sigmas  # Euler: x0 + sigma noise


def _schedule(s: dict[str, Any], family: str, n: int) -> dict[str, Any]:
    """Unpadded per-step tables for one step count, computed in diffusers' order and dtypes."""
    T = s["num_train_timesteps"]
    ac = _alphas_cumprod(s, family)
    final_alpha = np.float32(1.0) if s.get("set_alpha_to_one") else ac[0]
    train_sigmas = np.sqrt((1 - ac) / ac)  # float32, ascending in t
    last_sigma = train_sigmas[0] if s.get("final_sigmas_type") == "sigma_min" else 0.0
    out: dict[str, Any] = {"init_noise_sigma": 1.0}
    if family in ("pndm", "ddim"):
        ts = np.round(_spaced(s, n)).astype(np.int64)
        if family == "pndm":  # PLMS visits t_1 twice: call 1 redoes t_0 -> t_1 with two outputs averaged (Heun)
            ts = np.concatenate([ts[:1], ts[1:2], ts[1:]]) if n > 1 else ts
        out.update(timesteps=ts, **_ddim_alphas(ts, family, ac, final_alpha, T // n))
    elif family in ("euler", "euler_a"):
        ts = _spaced(s, n).astype(np.float32)  # Euler feeds the UNet float (possibly fractional) timesteps
        sigmas = np.interp(ts, np.arange(T), train_sigmas)
        if s.get("use_karras_sigmas"):  # Euler ramps between the spaced schedule's own end points
            sigmas = _karras(s, sigmas[-1].item(), sigmas[0].item(), n)
            ts = _sigma_to_t(sigmas, np.log(train_sigmas)).astype(np.float32)
        sigmas = np.concatenate([sigmas, [last_sigma]]).astype(np.float32)
        top = sigmas.max()
        out.update(timesteps=ts, sigmas=sigmas)
        # "leading" starts below sigma_max, so diffusers scales the initial noise to the x_T's full variance
        out["init_noise_sigma"] = top if s["timestep_spacing"] != "leading" else np.sqrt(top**2 + 1)
    else:
        if s["use_karras_sigmas"]:  # DPM ramps over the whole training range, ignoring timestep_spacing
            sigmas = _karras(s, train_sigmas[0].item(), train_sigmas[-1].item(), n)
            ts = _sigma_to_t(sigmas, np.log(train_sigmas))
            ts = (ts if s["beta_schedule"] == "squaredcos_cap_v2" else np.round(ts)).astype(np.int64)
        else:
            if s["timestep_spacing"] == "linspace":  # DPM spaces n + 1 points and drops the last
                ts = np.round(np.linspace(0, T - 1, n + 1))[::-1][:-1]
            elif s["timestep_spacing"] == "leading":
                ts = (np.arange(n + 1) * (T // (n + 1)))[::-1][:-1] + s["steps_offset"]
            else:
                ts = _spaced(s, n)
            ts = ts.astype(np.int64)
            sigmas = np.interp(ts, np.arange(T), train_sigmas)
        sigmas = np.concatenate([sigmas, [last_sigma]]).astype(np.float32)
        order = np.full(len(ts), 2, np.int32)
        order[0] = 1  # no history yet
        # The last step is first order when asked, and always when it lands on sigma = 0 (lambda = inf).
        if s["euler_at_final"] or (s["lower_order_final"] and len(ts) < 15) or s["final_sigmas_type"] == "zero":
            order[-1] = 1
        out.update(timesteps=ts, sigmas=sigmas, order=order)
    return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tables:
    """Per-step numbers for one step count, padded to L = max_steps + 1 entries; a pytree of arrays.

    The static fields are config options that change the formula: like `kind`, they recompile.
    """

    timesteps: Array  # [L] f32: what the UNet is fed at loop step i
    sigmas: Array  # [L] f32: Euler/DPM noise level at step i; i + 1 is where step i lands
    alpha_t: Array  # [L] f32: DDIM/PNDM a_t of the timestep step i starts from
    alpha_prev: Array  # [L] f32: DDIM/PNDM a_t of the timestep step i lands on
    order: Array  # [L] i32: DPM-Solver++ order at step i (1 or 2)
    num_loop_steps: Array  # [] i32: UNet evaluations (PNDM: n + 1 for n > 1)
    num_inference_steps: Array  # [] i32: the n asked for
    init_noise_sigma: Array  # [] f32: initial latents are standard normal times this (plus the image's part)
    init_signal: Array  # [] f32: image modes start from init_signal * image latents + init_noise_sigma * noise
    blend_signal: Array  # [L] f32: 4-channel inpainting's known latents after step i are blend_signal * image
    blend_noise: Array  # [L] f32: ... + blend_noise * noise (add_noise at the next timestep; the clean image last)
    prediction_type: str = dataclasses.field(default="epsilon", metadata=dict(static=True))
    clip_sample_range: float | None = dataclasses.field(default=None, metadata=dict(static=True))  # DDIM x0 clip
    solver_type: str = dataclasses.field(default="midpoint", metadata=dict(static=True))  # DPM second order


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class State:
    """What a multistep solver carries between loop steps; None for the fields its kind does not use."""

    ets: Array | None = None  # PNDM: last four model outputs, oldest first  [4, *latents.shape]
    cur_sample: Array | None = None  # PNDM: x_{t_0}, which the second (Heun) call steps from again
    prev_x0: Array | None = None  # DPM-Solver++: the previous step's data prediction


def tables(
    config: SchedulerConfig,
    kind: str,
    num_inference_steps: int,
    max_steps: int,
    strength: float | None = None,
    inpaint: bool = False,
) -> Tables:
    """Host-side schedule for `num_inference_steps`, padded to the static `max_steps`.

    With `strength` (image-to-image and inpainting), the schedule starts at the step that strength selects
    and the initial latents are `add_noise(image latents, noise, first timestep)`, as diffusers' img2img
    pipelines do; inpainting at strength 1 starts from pure noise, as `StableDiffusionInpaintPipeline` does.
    """
    s, family = settings(config, kind), _family(kind)
    n = int(num_inference_steps)
    if not 1 <= n <= max_steps:
        raise ValueError(f"num_inference_steps must be between 1 and max_steps={max_steps}, got {n}")
    if n > s["num_train_timesteps"]:
        raise ValueError(f"num_inference_steps {n} exceeds num_train_timesteps {s['num_train_timesteps']}")
    start = 0 if strength is None else start_step(n, strength)
    if start >= n:
        raise ValueError(f"strength {strength} leaves no step of {n}; raise the strength or the steps")
    sched = _cut(_schedule(s, family, n), s, family, n, start)
    signal, noise = _noising(s, family, sched)
    sched["blend_signal"] = np.concatenate([signal[1:], [1.0]])
    sched["blend_noise"] = np.concatenate([noise[1:], [0.0]])
    init_signal = 0.0
    if strength is not None and not (inpaint and strength == 1.0):
        init_signal, sched["init_noise_sigma"] = signal[0], noise[0]

    def pad(name: str, dtype: Any) -> np.ndarray:
        # Repeating the last entry keeps never-used padding finite.
        x = np.asarray(sched.get(name, [0]), dtype)
        return np.concatenate([x, np.full(max_steps + 1 - len(x), x[-1], dtype)])

    clip = s["clip_sample_range"] if family == "ddim" and s["clip_sample"] else None
    return Tables(
        **{name: pad(name, np.float32) for name in ("timesteps", "sigmas", "alpha_t", "alpha_prev")},
        order=pad("order", np.int32),
        num_loop_steps=np.int32(len(sched["timesteps"])),
        num_inference_steps=np.int32(n),
        init_noise_sigma=np.float32(sched["init_noise_sigma"]),
        init_signal=np.float32(init_signal),
        blend_signal=pad("blend_signal", np.float32),
        blend_noise=pad("blend_noise", np.float32),
        prediction_type="sample" if s["prediction_type"] == "original_sample" else s["prediction_type"],
        clip_sample_range=None if clip is None else float(clip),
        solver_type=s.get("solver_type", "midpoint"),
    )


def init_state(kind: str, latents: Array) -> State:
    """Empty solver history, shaped like the latents (any layout)."""
    family = _family(kind)
    zeros = jnp.zeros(latents.shape, jnp.float32)
    if family == "pndm":
        return State(ets=jnp.zeros((4, *latents.shape), jnp.float32), cur_sample=zeros)
    if family == "dpm":
        return State(prev_x0=zeros)
    return State()


def _at(table: Array, i: Array) -> Array:
    return jnp.asarray(table)[i]


def timestep(t: Tables, i: Array) -> Array:
    """The timestep fed to the UNet at loop step i (f32; integer-valued except for Euler)."""
    return _at(t.timesteps, i)


def scale_model_input(kind: str, t: Tables, i: Array, sample: Array) -> Array:
    """Euler variants feed the UNet x / sqrt(sigma^2 + 1), i.e. back at unit variance; the others feed x."""
    sample = sample.astype(jnp.float32)
    if _family(kind) in ("euler", "euler_a"):
        return sample / (_at(t.sigmas, i) ** 2 + 1) ** 0.5
    return sample


def _x0_eps(t: Tables, a_t: Array, model_output: Array, x: Array) -> tuple[Array, Array]:
    """Data and noise predictions from the model output, for the a_t-parameterised DDIM."""
    b_t = 1 - a_t
    if t.prediction_type == "epsilon":
        return (x - b_t**0.5 * model_output) / a_t**0.5, model_output
    if t.prediction_type == "sample":
        return model_output, (x - a_t**0.5 * model_output) / b_t**0.5
    return a_t**0.5 * x - b_t**0.5 * model_output, a_t**0.5 * model_output + b_t**0.5 * x  # v_prediction


def _pndm(t: Tables, state: State, i: Array, model_output: Array, x: Array) -> tuple[Array, State]:
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
    a_t, a_prev = _at(t.alpha_t, i), _at(t.alpha_prev, i)
    b_t, b_prev = 1 - a_t, 1 - a_prev
    if t.prediction_type == "v_prediction":
        eps = a_t**0.5 * eps + b_t**0.5 * base
    # PNDM's transfer (Liu et al. 2022, eq. 9), algebraically DDIM's step written without x0.
    denom = a_t * b_prev**0.5 + (a_t * b_t * a_prev) ** 0.5
    return (a_prev / a_t) ** 0.5 * base - (a_prev - a_t) * eps / denom, state


def _ddim(t: Tables, i: Array, model_output: Array, x: Array) -> Array:
    a_prev = _at(t.alpha_prev, i)
    x0, eps = _x0_eps(t, _at(t.alpha_t, i), model_output, x)
    if t.clip_sample_range is not None:
        x0 = jnp.clip(x0, -t.clip_sample_range, t.clip_sample_range)
    return a_prev**0.5 * x0 + (1 - a_prev) ** 0.5 * eps


def _euler_x0(t: Tables, sigma: Array, model_output: Array, x: Array) -> Array:
    if t.prediction_type == "epsilon":
        return x - sigma * model_output
    if t.prediction_type == "sample":
        return model_output
    return model_output * (-sigma / (sigma**2 + 1) ** 0.5) + (x / (sigma**2 + 1))  # v_prediction


def _dpm(t: Tables, state: State, i: Array, model_output: Array, x: Array) -> tuple[Array, State]:
    def coefficients(j: Array) -> tuple[Array, Array, Array]:
        # alpha, sigma of the variance-preserving x at noise level sigmas[j], and lambda = log(alpha / sigma)
        alpha = 1 / (_at(t.sigmas, j) ** 2 + 1) ** 0.5
        sigma = _at(t.sigmas, j) * alpha
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
    if t.solver_type == "midpoint":
        second = first - 0.5 * (alpha_t * (jnp.exp(-h) - 1.0)) * d1
    else:
        second = first + (alpha_t * ((jnp.exp(-h) - 1.0) / h + 1.0)) * d1
    return jnp.where(_at(t.order, i) == 2, second, first), State(prev_x0=x0)


def step(
    kind: str, t: Tables, state: State, i: Array, model_output: Array, sample: Array, noise: Array | None = None
) -> tuple[Array, State]:
    """One scheduler step at loop index i: returns the f32 sample for loop step i + 1 and the new state.

    `noise` (standard normal, shaped like `sample`) is used by "euler_a" only, which requires it.
    """
    family = _family(kind)
    model_output, x = model_output.astype(jnp.float32), sample.astype(jnp.float32)
    if family == "pndm":
        return _pndm(t, state, i, model_output, x)
    if family == "ddim":
        return _ddim(t, i, model_output, x), state
    if family == "dpm":
        return _dpm(t, state, i, model_output, x)
    sigma, sigma_next = _at(t.sigmas, i), _at(t.sigmas, i + 1)
    derivative = (x - _euler_x0(t, sigma, model_output, x)) / sigma
    if family == "euler":
        return x + derivative * (sigma_next - sigma), state
    if noise is None:
        raise ValueError("scheduler 'euler_a' needs `noise` (standard normal, shaped like the sample)")
    # Ancestral step: go deterministically down to sigma_down, then add fresh noise of std sigma_up.
    sigma_up = (sigma_next**2 * (sigma**2 - sigma_next**2) / sigma**2) ** 0.5
    sigma_down = jnp.maximum(sigma_next**2 - sigma_up**2, 0.0) ** 0.5  # >= 0 in exact arithmetic; rounding can dip
    return x + derivative * (sigma_down - sigma) + noise.astype(jnp.float32) * sigma_up, state
