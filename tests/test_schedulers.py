"""engine.schedulers matches diffusers' PyTorch schedulers step by step, and reads configs as diffusers does.

The reference loop is the one diffusers pipelines run (set_timesteps, init_noise_sigma, scale_model_input,
step); ours is one jitted lax.fori_loop whose step count is traced. A fixed elementwise "model" stands in for
the UNet so that the trajectories are non-trivial and identical on both sides.
"""

from __future__ import annotations

import inspect
import json

import diffusers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers.schedulers import scheduling_ddim, scheduling_euler_ancestral_discrete, scheduling_lcm, scheduling_tcd

from engine import schedulers as S
from engine.errors import ConfigError

MAX_STEPS = 32
STEP_COUNTS = (1, 2, 4, 10, 25)  # 2-10 take DPM's lower-order final step; >= 4 reach PLMS's 4th order
SHAPE = (2, 4, 8, 8)
BASE = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
LATENTS = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
NOISE = np.random.default_rng(2).standard_normal((MAX_STEPS + 1, *SHAPE)).astype(np.float32)

SD = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", num_train_timesteps=1000)
CONFIGS = {
    # runwayml/stable-diffusion-v1-5 scheduler/scheduler_config.json
    "sd15": {
        **dict(_class_name="PNDMScheduler", _diffusers_version="0.6.0", **SD, clip_sample=False),
        **dict(set_alpha_to_one=False, skip_prk_steps=True, steps_offset=1, trained_betas=None),
    },
    # stabilityai/stable-diffusion-2-1 (768px, v-prediction)
    "sd21_v": {
        **dict(_class_name="PNDMScheduler", **SD, clip_sample=False, prediction_type="v_prediction"),
        **dict(set_alpha_to_one=False, skip_prk_steps=True, steps_offset=1, timestep_spacing="leading"),
    },
    # stabilityai/sd-turbo
    "turbo_trailing": {
        **dict(_class_name="EulerDiscreteScheduler", **SD, clip_sample=False, interpolation_type="linear"),
        **dict(prediction_type="epsilon", sample_max_value=1.0, set_alpha_to_one=False, skip_prk_steps=True),
        **dict(steps_offset=1, timestep_spacing="trailing", trained_betas=None, use_karras_sigmas=False),
    },
    # A fresh diffusers scheduler; PNDM's own default (a Runge-Kutta warm-up) is unsupported.
    "defaults": {"skip_prk_steps": True},
    # Karras sigmas ending at sigma_min with a second-order last step, cosine betas, Heun-type correction,
    # and DDIM's default clip_sample with a wider range.
    "karras_cosine": {
        **dict(_class_name="DPMSolverMultistepScheduler", beta_schedule="squaredcos_cap_v2"),
        **dict(use_karras_sigmas=True, final_sigmas_type="sigma_min", lower_order_final=False),
        **dict(solver_type="heun", clip_sample_range=2.0, skip_prk_steps=True),
    },
    # Zero terminal SNR (Lin et al. 2024) with v-prediction and trailing spacing.
    "zero_snr_v": {
        **dict(_class_name="DDIMScheduler", **SD, rescale_betas_zero_snr=True, prediction_type="v_prediction"),
        **dict(timestep_spacing="trailing", clip_sample=False, set_alpha_to_one=False, skip_prk_steps=True),
    },
}
CLASSES = {
    "pndm": diffusers.PNDMScheduler,
    "ddim": diffusers.DDIMScheduler,
    "euler": diffusers.EulerDiscreteScheduler,
    "euler_a": diffusers.EulerAncestralDiscreteScheduler,
    "dpm++2m": diffusers.DPMSolverMultistepScheduler,
    "dpm++2m_karras": diffusers.DPMSolverMultistepScheduler,
    "lcm": diffusers.LCMScheduler,
    "tcd": diffusers.TCDScheduler,
}
DISCRETE = tuple(kind for kind in S.SCHEDULERS if not S.is_flow(kind))  # flow kinds: tests/test_flow_match.py
# diffusers gives NaN here: its sigma_down = sqrt(sigma_to^2 - sigma_up^2) is sqrt of a rounded-negative number.
DIFFUSERS_NAN = {("euler_a", "karras_cosine", 4)}
DPM = dict(algorithm_type="dpmsolver++", solver_order=2)
FORCED = {"dpm++2m": {**DPM, "use_karras_sigmas": False}, "dpm++2m_karras": {**DPM, "use_karras_sigmas": True}}


def reference_scheduler(raw: dict, kind: str, tmp_path) -> diffusers.SchedulerMixin:
    """What a diffusers user gets: load the folder's scheduler, then switch with `Other.from_config(config)`."""
    (tmp_path / "scheduler_config.json").write_text(json.dumps(raw))
    loaded_cls = getattr(diffusers, raw.get("_class_name", CLASSES[kind].__name__))
    loaded = loaded_cls.from_pretrained(tmp_path)
    return CLASSES[kind].from_config(loaded.config, **FORCED.get(kind, {}))


def torch_model(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return 0.1 * x + 0.5 * torch.sin(0.01 * t.float() + torch.from_numpy(BASE))


def jax_model(x: jax.Array, t: jax.Array) -> jax.Array:
    return 0.1 * x + 0.5 * jnp.sin(0.01 * t + BASE)


def same_draws(monkeypatch) -> list[int]:
    """The stochastic schedulers draw their step noise from NOISE in order, as we hand ours NOISE[i]."""
    draws = []

    def randn_tensor(*args, **kwargs):
        draws.append(len(draws))
        return torch.from_numpy(NOISE[len(draws) - 1])

    for module in (scheduling_ddim, scheduling_euler_ancestral_discrete, scheduling_lcm, scheduling_tcd):
        monkeypatch.setattr(module, "randn_tensor", randn_tensor)
    return draws


def step_kwargs(scheduler, eta: float = 0.0) -> dict:
    """What diffusers' pipelines pass to `step` besides the sample (`prepare_extra_step_kwargs`): eta, 0 by default."""
    return {"eta": eta} if "eta" in inspect.signature(scheduler.step).parameters else {}


def reference_loop(scheduler, n: int, monkeypatch) -> tuple[np.ndarray, np.ndarray]:
    same_draws(monkeypatch)
    scheduler.set_timesteps(n)
    if hasattr(scheduler, "set_begin_index"):
        # diffusers finds where to start by looking the first timestep up, and when that timestep repeats
        # (DPM Karras on cosine betas) takes its second occurrence; start at 0 as its img2img pipelines do.
        scheduler.set_begin_index(0)
    x = torch.from_numpy(LATENTS) * scheduler.init_noise_sigma
    for t in scheduler.timesteps:
        x = scheduler.step(
            torch_model(scheduler.scale_model_input(x, t), t), t, x, **step_kwargs(scheduler)
        ).prev_sample
    return scheduler.timesteps.numpy(), x.numpy()


def _loop(kind: str, tables: S.Tables, x: jax.Array, noise: jax.Array) -> jax.Array:
    # Static: kind (and the config options Tables keeps as static fields). Traced: the step count.
    def body(i, carry):
        x, state = carry
        model_output = jax_model(S.scale_model_input(kind, tables, i, x), S.timestep(tables, i))
        return S.step(kind, tables, state, i, model_output, x, noise[i])

    return jax.lax.fori_loop(0, tables.num_loop_steps, body, (x, S.init_state(kind, x)))[0]


def _denoise(kind: str, tables: S.Tables, latents: jax.Array, noise: jax.Array) -> jax.Array:
    return _loop(kind, tables, latents * tables.init_noise_sigma, noise)


denoise = jax.jit(_denoise, static_argnames="kind")
loop = jax.jit(_loop, static_argnames="kind")


def assert_matches_diffusers(kind: str, raw: dict, n: int, tmp_path, monkeypatch, diffusers_nan: bool = False):
    want_timesteps, want = reference_loop(reference_scheduler(raw, kind, tmp_path), n, monkeypatch)

    tables = S.tables(S.SchedulerConfig.from_dict(raw), kind, n, MAX_STEPS)
    got = np.asarray(denoise(kind, tables, LATENTS, NOISE))

    assert int(tables.num_loop_steps) == len(want_timesteps)
    np.testing.assert_array_equal(tables.timesteps[: len(want_timesteps)], want_timesteps.astype(np.float32))
    if diffusers_nan:
        assert np.isnan(want).all() and np.isfinite(got).all()
        return
    # Both sides round in f32 differently (XLA fuses multiply-adds, torch does not), which costs a few ulps of
    # the largest intermediate, the initial noise; beyond that we ask for 1e-5 relative.
    peak = np.float32(tables.init_noise_sigma * np.abs(LATENTS).max())
    atol = 1e-5 * max(1.0, float(np.abs(want).max())) + 4 * float(np.spacing(peak))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("n", STEP_COUNTS)
@pytest.mark.parametrize("config_name", CONFIGS)
@pytest.mark.parametrize("kind", DISCRETE)
def test_matches_diffusers_step_by_step(kind, config_name, n, tmp_path, monkeypatch):
    nan = (kind, config_name, n) in DIFFUSERS_NAN
    assert_matches_diffusers(kind, CONFIGS[config_name], n, tmp_path, monkeypatch, diffusers_nan=nan)


# x0-predicting models, given betas, and DPM's euler_at_final, on the kinds that accept "sample".
SAMPLE_PREDICTION = {
    **dict(prediction_type="sample", trained_betas=np.linspace(1e-4, 0.02, 1000).tolist()),
    **dict(euler_at_final=True, final_sigmas_type="sigma_min", timestep_spacing="linspace"),
}


@pytest.mark.parametrize("n", [4, 25])
@pytest.mark.parametrize("kind", ["ddim", "euler", "dpm++2m", "dpm++2m_karras"])
def test_sample_prediction_matches_diffusers(kind, n, tmp_path, monkeypatch):
    assert_matches_diffusers(kind, SAMPLE_PREDICTION, n, tmp_path, monkeypatch)


@pytest.mark.parametrize("n", [14, 15])
def test_dpm_last_step_is_first_order_below_15_steps(n, tmp_path, monkeypatch):
    # Landing on sigma_min (not 0) leaves the order to lower_order_final, which diffusers applies below 15 steps.
    assert_matches_diffusers("dpm++2m", {"final_sigmas_type": "sigma_min"}, n, tmp_path, monkeypatch)


def test_one_compilation_serves_every_step_count():
    # A function of its own: jax shares compilation caches between jit wrappers of one function.
    fn = jax.jit(lambda tables, latents, noise: _denoise("pndm", tables, latents, noise))
    config = S.SchedulerConfig.from_dict(CONFIGS["sd15"])
    for n in STEP_COUNTS:
        fn(S.tables(config, "pndm", n, MAX_STEPS), LATENTS, NOISE).block_until_ready()
    assert fn._cache_size() == 1


@pytest.mark.parametrize("config_name", CONFIGS)
@pytest.mark.parametrize("kind", DISCRETE)
def test_settings_are_those_of_diffusers_from_config(kind, config_name, tmp_path):
    want = reference_scheduler(CONFIGS[config_name], kind, tmp_path).config
    got = S.settings(S.SchedulerConfig.from_dict(CONFIGS[config_name]), kind)
    assert got == {k: want.get(k) for k in got}


def test_keys_the_saving_class_defaulted_are_not_kept(tmp_path):
    raw = {"_class_name": "PNDMScheduler", "timestep_spacing": "leading", "skip_prk_steps": True}
    raw["_use_default_values"] = ["timestep_spacing"]
    config = S.SchedulerConfig.from_dict(raw)
    assert config.timestep_spacing is None
    assert S.settings(config, "euler")["timestep_spacing"] == "linspace"
    assert reference_scheduler(raw, "euler", tmp_path).config.timestep_spacing == "linspace"
    assert S.settings(config, "pndm")["timestep_spacing"] == "leading"


def test_from_json_reads_a_folder_file(tmp_path):
    path = tmp_path / "scheduler_config.json"
    path.write_text(json.dumps(CONFIGS["sd15"]))
    config = S.SchedulerConfig.from_json(path)
    assert config == S.SchedulerConfig.from_dict(CONFIGS["sd15"])
    assert (config.class_name, config.steps_offset, config.timestep_spacing) == ("PNDMScheduler", 1, None)
    hash(config)  # frozen, so usable as a static jit argument


@pytest.mark.parametrize(
    ("class_name", "karras", "kind"),
    [
        ("PNDMScheduler", None, "pndm"),
        ("DDIMScheduler", None, "ddim"),
        ("EulerDiscreteScheduler", True, "euler"),
        ("EulerAncestralDiscreteScheduler", None, "euler_a"),
        ("DPMSolverMultistepScheduler", None, "dpm++2m"),
        ("DPMSolverMultistepScheduler", True, "dpm++2m_karras"),
        ("LCMScheduler", None, "lcm"),
        ("TCDScheduler", None, "tcd"),
        ("LMSDiscreteScheduler", None, None),
        (None, None, None),
    ],
)
def test_default_kind_follows_the_class_name(class_name, karras, kind):
    raw = {"_class_name": class_name, "use_karras_sigmas": karras}
    assert S.SchedulerConfig.from_dict(raw).default_kind == kind


def test_every_key_of_a_stable_diffusion_scheduler_is_accepted():
    compatible = [e.name for e in diffusers.schedulers.scheduling_utils.KarrasDiffusionSchedulers]
    keys = set()
    for name in [*compatible, "DDPMScheduler", "LCMScheduler", "TCDScheduler"]:
        keys |= set(inspect.signature(getattr(diffusers, name).__init__).parameters) - {"self", "args", "kwargs"}
    S.SchedulerConfig.from_dict(dict.fromkeys(keys))


def test_unknown_config_key_is_a_config_error():
    with pytest.raises(ConfigError, match="bogus_key"):
        S.SchedulerConfig.from_dict({"_class_name": "PNDMScheduler", "bogus_key": 1})


@pytest.mark.parametrize(
    ("kind", "raw", "option"),
    [
        ("pndm", {}, "skip_prk_steps"),
        ("ddim", {"thresholding": True}, "thresholding"),
        ("dpm++2m", {"thresholding": True}, "thresholding"),
        ("euler", {"use_exponential_sigmas": True}, "use_exponential_sigmas"),
        ("euler", {"interpolation_type": "log_linear"}, "interpolation_type"),
        ("euler_a", {"prediction_type": "sample"}, "prediction_type"),
        ("dpm++2m", {"use_lu_lambdas": True}, "use_lu_lambdas"),
        ("dpm++2m", {"prediction_type": "flow_prediction"}, "prediction_type"),
        ("ddim", {"beta_schedule": "sigmoid"}, "beta_schedule"),
    ],
)
def test_unsupported_options_name_the_option(kind, raw, option):
    with pytest.raises(ValueError, match=option):
        S.tables(S.SchedulerConfig.from_dict(raw), kind, 10, MAX_STEPS)


@pytest.mark.parametrize(
    ("raw", "n", "message"),
    [
        ({}, 0, "between 1 and max_steps"),
        ({}, MAX_STEPS + 1, "between 1 and max_steps"),
        ({"num_train_timesteps": 10}, 11, "num_train_timesteps"),
    ],
)
def test_bad_step_counts_are_refused(raw, n, message):
    with pytest.raises(ValueError, match=message):
        S.tables(S.SchedulerConfig.from_dict(raw), "euler", n, MAX_STEPS)


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="unknown scheduler 'lms'"):
        S.tables(S.SchedulerConfig(), "lms", 10, MAX_STEPS)
    with pytest.raises(ValueError, match="unknown scheduler"):
        S.init_state("heun", jnp.zeros(SHAPE))


def test_euler_ancestral_needs_noise():
    tables = S.tables(S.SchedulerConfig(), "euler_a", 4, MAX_STEPS)
    x = jnp.zeros(SHAPE)
    with pytest.raises(ValueError, match="noise"):
        S.step("euler_a", tables, S.init_state("euler_a", x), jnp.int32(0), x, x, None)


def test_low_precision_model_output_is_stepped_in_float32():
    tables = S.tables(S.SchedulerConfig(), "dpm++2m", 4, MAX_STEPS)
    x = jnp.asarray(LATENTS)
    step = jax.jit(S.step, static_argnums=0)
    out, state = step("dpm++2m", tables, S.init_state("dpm++2m", x), jnp.int32(0), x.astype(jnp.bfloat16), x)
    assert out.dtype == state.prev_x0.dtype == jnp.float32


def test_trailing_spacing_runs_the_steps_asked_for(tmp_path):
    # At 61 steps diffusers' np.arange yields a 62nd "trailing" timestep of -1 (an extra step from a_999);
    # we run the 61 asked for, which agree with diffusers' first 61.
    n = 61
    scheduler = reference_scheduler(CONFIGS["turbo_trailing"], "ddim", tmp_path)
    scheduler.set_timesteps(n)
    assert scheduler.timesteps.numpy()[-1] == -1
    tables = S.tables(S.SchedulerConfig.from_dict(CONFIGS["turbo_trailing"]), "ddim", n, 64)
    assert int(tables.num_loop_steps) == n
    np.testing.assert_array_equal(tables.timesteps[:n], scheduler.timesteps.numpy()[:n])


# SimianLuo/LCM_Dreamshaper_v7 scheduler/scheduler_config.json; TCD runs on the same SD betas.
LCM_FOLDER = {
    **dict(_class_name="LCMScheduler", **SD, clip_sample=False, original_inference_steps=50),
    **dict(prediction_type="epsilon", rescale_betas_zero_snr=False, set_alpha_to_one=True, steps_offset=1),
    **dict(thresholding=False, timestep_scaling=10.0, timestep_spacing="leading", trained_betas=None),
}
FEW_STEP_COUNTS = (1, 2, 4, 8)
FEW_STEP_CASES = [("lcm", 0.0), ("tcd", 0.0), ("tcd", 0.3)]
IMAGE = np.random.default_rng(3).standard_normal(SHAPE).astype(np.float32)
one_step = jax.jit(S.step, static_argnums=0)


def assert_close(got, want):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max())))


@pytest.mark.parametrize("n", FEW_STEP_COUNTS)
@pytest.mark.parametrize(("kind", "eta"), FEW_STEP_CASES)
def test_few_step_samplers_match_diffusers_at_every_step(kind, eta, n, tmp_path, monkeypatch):
    # Each step from the same sample, model output and noise on both sides, so errors cannot compound.
    draws = same_draws(monkeypatch)
    reference = reference_scheduler(LCM_FOLDER, kind, tmp_path)
    reference.set_timesteps(n)
    tables = S.tables(S.SchedulerConfig.from_dict(LCM_FOLDER), kind, n, MAX_STEPS, eta=eta)
    assert int(tables.num_loop_steps) == n
    np.testing.assert_array_equal(tables.timesteps[:n], reference.timesteps.numpy().astype(np.float32))
    x = torch.from_numpy(LATENTS)
    state = S.init_state(kind, jnp.asarray(LATENTS))
    for i, t in enumerate(reference.timesteps):
        model_output = torch_model(x, t)
        out = reference.step(model_output, t, x, **step_kwargs(reference, eta))
        got, state = one_step(kind, tables, state, jnp.int32(i), model_output.numpy(), x.numpy(), NOISE[i])
        assert_close(got, out.prev_sample.numpy())
        x = out.prev_sample
    # The last step lands on what the pipelines decode: LCM's `denoised`, TCD's x_s (its `prev_sample`).
    assert_close(got, (out.denoised if kind == "lcm" else out.pred_noised_sample).numpy())
    assert len(draws) == (n - 1 if kind == "lcm" or eta > 0 else 0)


@pytest.mark.parametrize("strength", [0.3, 0.6, 1.0])
@pytest.mark.parametrize(("kind", "eta"), [("lcm", 0.0), ("tcd", 0.3)])
def test_few_step_image_to_image_matches_diffusers(kind, eta, strength, tmp_path, monkeypatch):
    # LCM as LatentConsistencyModelImg2ImgPipeline (`set_timesteps(n, strength=)` shortens the grid, all n steps
    # run); TCD as the generic img2img pipelines (the full grid cut at `get_timesteps`' start step).
    n = 4
    same_draws(monkeypatch)
    reference = reference_scheduler(LCM_FOLDER, kind, tmp_path)
    if kind == "lcm":
        reference.set_timesteps(n, strength=strength)
        timesteps = reference.timesteps
    else:
        reference.set_timesteps(n)
        start = S.start_step(n, strength)
        timesteps = reference.timesteps[start:]
        reference.set_begin_index(start)
    x = reference.add_noise(torch.from_numpy(IMAGE), torch.from_numpy(LATENTS), timesteps[:1])
    for t in timesteps:
        x = reference.step(torch_model(x, t), t, x, **step_kwargs(reference, eta)).prev_sample

    tables = S.tables(S.SchedulerConfig.from_dict(LCM_FOLDER), kind, n, MAX_STEPS, strength=strength, eta=eta)
    assert int(tables.num_loop_steps) == len(timesteps)
    np.testing.assert_array_equal(tables.timesteps[: len(timesteps)], timesteps.numpy().astype(np.float32))
    got = loop(kind, tables, tables.init_signal * IMAGE + tables.init_noise_sigma * LATENTS, NOISE)
    assert_close(got, x.numpy())


def test_lcm_strength_that_leaves_too_few_grid_points_is_refused():
    with pytest.raises(ValueError, match="strength"):  # int(50 * 0.05) = 2 grid points for 4 steps
        S.tables(S.SchedulerConfig.from_dict(LCM_FOLDER), "lcm", 4, MAX_STEPS, strength=0.05)
    with pytest.raises(ValueError, match="original_inference_steps"):
        S.tables(S.SchedulerConfig.from_dict({**LCM_FOLDER, "original_inference_steps": 8}), "lcm", 10, MAX_STEPS)


# Not zero-SNR at eta = 1: its first step's sqrt(1 - a' - s^2) is the root of a rounding error (s^2 = 1 - a' there),
# which one ulp of s turns from 0 into 2e-4 on either side.
DDIM_ETA_CASES = [("sd15", 0.3), ("sd15", 1.0), ("karras_cosine", 1.0), ("zero_snr_v", 0.3)]


@pytest.mark.parametrize("n", [1, 4, 10])
@pytest.mark.parametrize(("config_name", "eta"), DDIM_ETA_CASES)
def test_ddim_eta_matches_diffusers_with_the_same_noise(config_name, eta, n, tmp_path, monkeypatch):
    # DDIM's stochastic step (eq. 16: sigma_t(eta)) with diffusers' `variance_noise` drawn from NOISE, as ours is
    # handed NOISE[i]: each step from the same sample, model output and noise, then the whole loop.
    draws = same_draws(monkeypatch)
    reference = reference_scheduler(CONFIGS[config_name], "ddim", tmp_path)
    reference.set_timesteps(n)
    tables = S.tables(S.SchedulerConfig.from_dict(CONFIGS[config_name]), "ddim", n, MAX_STEPS, eta=eta)
    x = torch.from_numpy(LATENTS)
    state = S.init_state("ddim", jnp.asarray(LATENTS))
    for i, t in enumerate(reference.timesteps):
        model_output = torch_model(x, t)
        out = reference.step(model_output, t, x, eta=eta).prev_sample
        got, state = one_step("ddim", tables, state, jnp.int32(i), model_output.numpy(), x.numpy(), NOISE[i])
        assert_close(got, out.numpy())
        x = out
    assert len(draws) == n
    if n > 1:  # one step lands past t = 0, where the variance is 0 with set_alpha_to_one
        assert np.abs(x.numpy() - reference_loop(reference, n, monkeypatch)[1]).max() > 1e-3  # eta changed it
    assert_close(denoise("ddim", tables, LATENTS, NOISE), x.numpy())


def test_a_new_eta_is_new_table_values_not_a_new_program():
    for kind, config in (("tcd", S.SchedulerConfig.from_dict(LCM_FOLDER)), ("ddim", S.SchedulerConfig())):
        fn = jax.jit(lambda tables, latents, noise, kind=kind: _denoise(kind, tables, latents, noise))
        for eta in (0.0, 0.3, 1.0):
            fn(S.tables(config, kind, 4, MAX_STEPS, eta=eta), LATENTS, NOISE).block_until_ready()
        assert fn._cache_size() == 1
        with pytest.raises(ValueError, match="eta"):
            S.tables(config, kind, 4, MAX_STEPS, eta=1.5)


def test_the_registry_names_one_module_per_algorithm():
    assert S.SCHEDULERS == tuple(S.ALGORITHMS)
    assert [kind for kind in S.SCHEDULERS if S.stochastic(kind)] == ["ddim", "euler_a", "lcm", "tcd"]
    interface = "CLASS_NAME DEFAULTS PREDICTIONS ONLY FORCED STOCHASTIC alphas_cumprod schedule init_state".split()
    for kind in S.SCHEDULERS:
        module = S.get(kind)
        assert all(hasattr(module, name) for name in [*interface, "scale_model_input", "step"]), kind
        assert list(inspect.signature(module.step).parameters) == ["t", "state", "i", "model_output", "x", "noise"]
    with pytest.raises(ValueError, match="unknown scheduler"):
        S.stochastic("heun")
