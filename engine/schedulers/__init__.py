"""Noise schedulers as pure functions over arrays, matching diffusers' PyTorch schedulers step for step.

One module per algorithm, named in the `ALGORITHMS` registry by the kinds it serves; `common` holds what
they share (the config, a_t, timestep spacing, the `Tables` and `State` pytrees). This package may import
numpy, jax, `engine.errors` and `engine.models.config` (for `_FromJson`), nothing above it: not loading,
families, sampling or serving. Adding an algorithm is one new module and one line in `ALGORITHMS`; nothing
here or in the sampling loop names an algorithm.

Each algorithm module provides:
  CLASS_NAME            the diffusers class it matches; a folder saved with it defaults to this kind
  DEFAULTS              that class's `__init__` defaults for the keys it reads (`settings`)
  PREDICTIONS, ONLY     the prediction types it supports; options whose only supported value it names
  FORCED                kind -> options the kind's name fixes, whatever the folder says (may be empty)
  STOCHASTIC            whether its step needs fresh standard-normal `noise`, shaped like the sample, per step
  alphas_cumprod(s)     a_t, t = 0..T-1, as the algorithm's diffusers class computes it
  schedule(s, n, strength, eta) -> common.Schedule
                        every per-step number, on the host in numpy, as diffusers' `set_timesteps` (and the
                        pipelines' strength handling) computes it
  init_state(latents), scale_model_input(tables, i, sample), step(tables, state, i, model_output, x, noise)

`tables` runs on the host: it pads the schedule to `max_steps + 1` entries, so that the step count is traced.
`timestep`, `scale_model_input` and `step` index those tables at the traced loop index `i` inside one
`lax.fori_loop`. Pass the Tables as a jit argument, not as a closure constant, or every step count compiles
anew.

`SchedulerConfig` keeps only the keys a scheduler_config.json sets; `settings(config, kind)` takes the kind's
own diffusers defaults for the rest, as `Other.from_config(pipe.scheduler.config)` does.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import jax.numpy as jnp
import numpy as np

from . import ddim, dpm_solver, euler, euler_ancestral, flow_match_euler, lcm, pndm, tcd
from .common import Array, SchedulerConfig, State, Tables, start_step, validate

__all__ = [
    "ALGORITHMS",
    "SCHEDULERS",
    "SchedulerConfig",
    "State",
    "Tables",
    "alphas_cumprod",
    "default_kind",
    "get",
    "compatible",
    "init_state",
    "is_flow",
    "scale_model_input",
    "settings",
    "start_step",
    "step",
    "stochastic",
    "tables",
    "timestep",
]

ALGORITHMS: dict[str, ModuleType] = {
    "pndm": pndm,  # PNDMScheduler with skip_prk_steps (PLMS), the SD 1.x default
    "ddim": ddim,  # DDIMScheduler, with its eta
    "euler": euler,  # EulerDiscreteScheduler
    "euler_a": euler_ancestral,  # EulerAncestralDiscreteScheduler
    "dpm++2m": dpm_solver,  # DPMSolverMultistepScheduler, dpmsolver++ of order 2
    "dpm++2m_karras": dpm_solver,  # the same on Karras sigmas
    "lcm": lcm,  # LCMScheduler
    "tcd": tcd,  # TCDScheduler
    "flow_euler": flow_match_euler,  # FlowMatchEulerDiscreteScheduler: rectified-flow models (SD3, FLUX.1)
}
SCHEDULERS: tuple[str, ...] = tuple(ALGORITHMS)


def get(kind: str) -> ModuleType:
    """The module that implements `kind`; ValueError naming the choices for an unknown kind."""
    if kind not in ALGORITHMS:
        raise ValueError(f"unknown scheduler {kind!r}; choose one of {', '.join(SCHEDULERS)}")
    return ALGORITHMS[kind]


def is_flow(kind: str) -> bool:
    """Whether `kind` samples a rectified-flow model (velocity prediction on sigma in [0, 1]); the other kinds
    sample noise-predicting models trained on a_t. A model takes the kinds of its own side only."""
    return bool(getattr(get(kind), "FLOW", False))


def compatible(config: SchedulerConfig) -> tuple[str, ...]:
    """The kinds a model saved with `config` can sample with: the flow kinds for a flow model, the others else."""
    own = default_kind(config)
    flow = own is not None and is_flow(own)
    return tuple(kind for kind in SCHEDULERS if is_flow(kind) == flow)


def stochastic(kind: str) -> bool:
    """Whether `step` for `kind` needs fresh standard-normal noise at every loop step."""
    return bool(get(kind).STOCHASTIC)


def default_kind(config: SchedulerConfig) -> str | None:
    """The kind a folder saved with `config.class_name` runs by default, or None when we have no such kind.

    Kinds that share a class are told apart by the sigma ramp their names fix (`use_karras_sigmas`).
    """
    kinds = [kind for kind, module in ALGORITHMS.items() if module.CLASS_NAME == config.class_name]
    karras = bool(config.use_karras_sigmas)
    named = [k for k in kinds if ALGORITHMS[k].FORCED.get(k, {}).get("use_karras_sigmas") == karras]
    return (named or kinds or [None])[0]


def settings(config: SchedulerConfig, kind: str) -> dict[str, Any]:
    """The effective options of `kind`: the file's keys where set, the kind's diffusers defaults elsewhere."""
    module = get(kind)
    s = {k: default if getattr(config, k) is None else getattr(config, k) for k, default in module.DEFAULTS.items()}
    s.update(module.FORCED.get(kind, {}))
    validate(kind, s, module.PREDICTIONS, module.ONLY, getattr(module, "CHOICES", None))
    return s


def alphas_cumprod(config: SchedulerConfig, kind: str = "ddim") -> np.ndarray:
    """The noise schedule a_t, t = 0..T-1, that `config` describes: what a model is trained against."""
    return get(kind).alphas_cumprod(settings(config, kind))


def tables(
    config: SchedulerConfig,
    kind: str,
    num_inference_steps: int,
    max_steps: int,
    strength: float | None = None,
    inpaint: bool = False,
    eta: float = 0.0,
    image_tokens: int | None = None,
    uniform_sigmas: bool | str = False,
    mu: float | None = None,
) -> Tables:
    """Host-side schedule for `num_inference_steps`, padded to the static `max_steps`.

    With `strength` (image-to-image and inpainting), the schedule starts at the step that strength selects
    and the initial latents are `add_noise(image latents, noise, first timestep)`, as diffusers' img2img
    pipelines do; inpainting at strength 1 starts from pure noise, as `StableDiffusionInpaintPipeline` does.
    `eta` in [0, 1] is the stochasticity diffusers' pipelines pass to `step` (DDIM's eta, TCD's gamma); kinds without
    one ignore it, as the pipelines do. It changes table values only, never the compiled program.
    The flow kinds read two more: `image_tokens`, the picture's token count a dynamically shifted schedule
    shifts by, and `uniform_sigmas`, the sigmas linspace(1, 1/n, n) that FluxPipeline (True or "numpy") or
    ZImagePipeline ("torch": torch's float32 linspace) hands its scheduler, and `mu`, the dynamic shift a pipeline
    computes itself (Flux2KleinPipeline's, from the token and step counts) in place of the config's `calculate_shift`.
    """
    module, s = get(kind), settings(config, kind)
    n = int(num_inference_steps)
    if not 1 <= n <= max_steps:
        raise ValueError(f"num_inference_steps must be between 1 and max_steps={max_steps}, got {n}")
    if n > s["num_train_timesteps"]:
        raise ValueError(f"num_inference_steps {n} exceeds num_train_timesteps {s['num_train_timesteps']}")
    if not 0.0 <= eta <= 1.0:
        raise ValueError(f"eta must be between 0 and 1, got {eta}")
    flow = dict(image_tokens=image_tokens, uniform=uniform_sigmas, mu=mu) if getattr(module, "FLOW", False) else {}
    sched = module.schedule(s, n, strength, float(eta), **flow)
    signal, noise = sched.signal, sched.noise
    init_noise_sigma, init_signal = sched.init_noise_sigma, 0.0
    if strength is not None and not (inpaint and strength == 1.0):
        init_signal, init_noise_sigma = signal[0], noise[0]

    def pad(x: Any, dtype: Any = None) -> np.ndarray:
        # Repeating the last entry keeps never-used padding finite.
        x = np.asarray(x)
        x = x.astype(dtype or (np.int32 if np.issubdtype(x.dtype, np.integer) else np.float32))
        return np.concatenate([x, np.full(max_steps + 1 - len(x), x[-1], x.dtype)])

    return Tables(
        timesteps=pad(sched.timesteps, np.float32),
        coefficients={name: pad(values) for name, values in sched.coefficients.items()},
        num_loop_steps=np.int32(len(sched.timesteps)),
        num_inference_steps=np.int32(n),
        init_noise_sigma=np.float32(init_noise_sigma),
        init_signal=np.float32(init_signal),
        blend_signal=pad(np.concatenate([signal[1:], [1.0]]), np.float32),
        blend_noise=pad(np.concatenate([noise[1:], [0.0]]), np.float32),
        eta=np.float32(eta),
        prediction_type="sample" if s["prediction_type"] == "original_sample" else s["prediction_type"],
        options=tuple(sorted(sched.options.items())),
    )


def init_state(kind: str, latents: Array) -> State:
    """Empty solver history, shaped like the latents (any layout)."""
    return get(kind).init_state(latents)


def timestep(t: Tables, i: Array) -> Array:
    """The timestep fed to the UNet at loop step i (f32; integer-valued except for Euler)."""
    return jnp.asarray(t.timesteps)[i]


def scale_model_input(kind: str, t: Tables, i: Array, sample: Array) -> Array:
    """What the UNet is fed at loop step i, in f32: Euler variants feed x / sqrt(sigma^2 + 1), the others x."""
    return get(kind).scale_model_input(t, i, sample.astype(jnp.float32))


def step(
    kind: str, t: Tables, state: State, i: Array, model_output: Array, sample: Array, noise: Array | None = None
) -> tuple[Array, State]:
    """One scheduler step at loop index i: returns the f32 sample for loop step i + 1 and the new state.

    `noise` (standard normal, shaped like `sample`) is required by the stochastic kinds (`stochastic(kind)`)
    and ignored by the others.
    """
    module = get(kind)
    if module.STOCHASTIC and noise is None:
        raise ValueError(f"scheduler {kind!r} needs `noise` (standard normal, shaped like the sample)")
    noise = None if noise is None else noise.astype(jnp.float32)
    return module.step(t, state, i, model_output.astype(jnp.float32), sample.astype(jnp.float32), noise)
