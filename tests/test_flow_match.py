"""The flow-matching Euler kind matches diffusers' FlowMatchEulerDiscreteScheduler as SD3 and FLUX.1 run it.

SD3's pipeline calls `set_timesteps(n)` (with `mu` when the config shifts dynamically), FLUX.1's hands it the
sigmas linspace(1, 1/n, n) and `mu` from the picture's token count; the img2img pipelines of both start at
`int(n - n * strength)` from `scale_noise(image, noise, sigma)`. A fixed elementwise "model" stands in for the
transformer, as in test_schedulers.py.
"""

from __future__ import annotations

import diffusers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from engine import schedulers as S
from engine.errors import ConfigError

MAX_STEPS = 32
SHAPE = (2, 16, 8, 8)
BASE = np.random.default_rng(0).standard_normal(SHAPE).astype(np.float32)
LATENTS = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
IMAGE = np.random.default_rng(3).standard_normal(SHAPE).astype(np.float32)

FLOW = dict(_class_name="FlowMatchEulerDiscreteScheduler", num_train_timesteps=1000)
CONFIGS = {
    "sd3": {**FLOW, "shift": 3.0},  # stabilityai/stable-diffusion-3.5-medium scheduler/scheduler_config.json
    "sd3_dynamic": {**FLOW, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.16},
    "flux": {  # black-forest-labs/FLUX.1-dev
        **FLOW,
        **dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15),
        **dict(base_image_seq_len=256, max_image_seq_len=4096),
    },
    "linear_terminal": {**FLOW, "use_dynamic_shifting": True, "time_shift_type": "linear", "shift_terminal": 0.1},
    "unshifted": FLOW,
}
# (config, uniform sigmas as FluxPipeline passes them, the picture's token count)
CASES = [
    ("sd3", False, None),
    ("sd3_dynamic", False, 1024),
    ("flux", True, 4096),
    ("flux", True, 256),
    ("linear_terminal", True, 1024),
    ("unshifted", False, None),
]


def torch_model(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return 0.1 * x + 0.5 * torch.sin(0.01 * t.float() + torch.from_numpy(BASE))


def jax_model(x: jax.Array, t: jax.Array) -> jax.Array:
    return 0.1 * x + 0.5 * jnp.sin(0.01 * t + BASE)


def reference(raw: dict, n: int, uniform: bool, tokens: int | None, strength: float | None = None):
    """What the SD3 / FLUX pipelines run: their set_timesteps call, img2img's start and scale_noise, the loop."""
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_config(raw)
    kwargs = {}
    if scheduler.config.use_dynamic_shifting:
        c = scheduler.config
        kwargs["mu"] = calculate_shift(tokens, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    if uniform:
        kwargs["sigmas"] = np.linspace(1.0, 1 / n, n)
        scheduler.set_timesteps(**kwargs)
    else:
        scheduler.set_timesteps(n, **kwargs)
    timesteps, x = scheduler.timesteps, torch.from_numpy(LATENTS)
    if strength is not None:
        start = int(max(n - min(n * strength, n), 0))
        timesteps = timesteps[start:]
        scheduler.set_begin_index(start)
        x = scheduler.scale_noise(torch.from_numpy(IMAGE), timesteps[:1].repeat(SHAPE[0]), x)
    for t in timesteps:
        x = scheduler.step(torch_model(x, t), t, x).prev_sample
    return timesteps.numpy(), x.numpy()


@jax.jit
def loop(tables: S.Tables, x: jax.Array) -> jax.Array:
    def body(i, x):
        out = jax_model(S.scale_model_input("flow_euler", tables, i, x), S.timestep(tables, i))
        return S.step("flow_euler", tables, S.State(), i, out, x)[0]

    return jax.lax.fori_loop(0, tables.num_loop_steps, body, x)


def ours(raw: dict, n: int, uniform: bool, tokens: int | None, strength: float | None = None) -> S.Tables:
    config = S.SchedulerConfig.from_dict(raw)
    return S.tables(config, "flow_euler", n, MAX_STEPS, strength=strength, image_tokens=tokens, uniform_sigmas=uniform)


@pytest.mark.parametrize("n", [1, 4, 28])
@pytest.mark.parametrize(("config_name", "uniform", "tokens"), CASES)
def test_text_to_image_matches_diffusers(config_name, uniform, tokens, n):
    if config_name == "linear_terminal" and n == 1:  # diffusers divides by zero; we refuse
        with pytest.raises(ValueError, match="at least 2 steps"):
            ours(CONFIGS[config_name], n, uniform, tokens)
        return
    want_timesteps, want = reference(CONFIGS[config_name], n, uniform, tokens)
    tables = ours(CONFIGS[config_name], n, uniform, tokens)
    assert int(tables.num_loop_steps) == n and float(tables.init_noise_sigma) == 1.0
    np.testing.assert_array_equal(tables.timesteps[:n], want_timesteps)
    np.testing.assert_allclose(loop(tables, LATENTS * tables.init_noise_sigma), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("n", "strength"), [(28, 0.6), (4, 0.5), (10, 0.95), (4, 1.0)])
@pytest.mark.parametrize(("config_name", "uniform", "tokens"), [CASES[0], CASES[2]])
def test_image_to_image_starts_where_the_pipelines_do(config_name, uniform, tokens, n, strength):
    want_timesteps, want = reference(CONFIGS[config_name], n, uniform, tokens, strength)
    tables = ours(CONFIGS[config_name], n, uniform, tokens, strength)
    assert int(tables.num_loop_steps) == len(want_timesteps)
    np.testing.assert_array_equal(tables.timesteps[: len(want_timesteps)], want_timesteps)
    start = tables.init_signal * IMAGE + tables.init_noise_sigma * LATENTS
    np.testing.assert_allclose(loop(tables, start), want, rtol=1e-5, atol=1e-5)


def test_the_shift_follows_the_token_count_in_table_values_not_programs():
    config = CONFIGS["flux"]
    small, large = ours(config, 4, True, 256), ours(config, 4, True, 4096)
    assert small.timesteps[1] < large.timesteps[1]  # more tokens: more steps spent at high noise
    loop(small, LATENTS).block_until_ready(), loop(large, LATENTS).block_until_ready()
    assert loop._cache_size() == 1


def test_a_dynamically_shifted_schedule_needs_the_token_count():
    with pytest.raises(ValueError, match="token count"):
        ours(CONFIGS["flux"], 4, True, None)


def test_flow_models_take_flow_kinds_and_the_others_take_theirs():
    flow = S.SchedulerConfig.from_dict(CONFIGS["sd3"])
    assert S.default_kind(flow) == "flow_euler" and S.compatible(flow) == ("flow_euler",)
    discrete = S.SchedulerConfig.from_dict({"_class_name": "EulerDiscreteScheduler"})
    assert "flow_euler" not in S.compatible(discrete) and "euler" in S.compatible(discrete)


@pytest.mark.parametrize(
    ("option", "value"), [("stochastic_sampling", True), ("use_karras_sigmas", True), ("invert_sigmas", True)]
)
def test_options_we_do_not_implement_are_refused_by_name(option, value):
    with pytest.raises(ConfigError, match=option):
        ours({**CONFIGS["sd3"], option: value}, 4, False, None)


def test_a_time_shift_type_we_do_not_know_is_refused():
    with pytest.raises(ConfigError, match="time_shift_type"):
        ours({**CONFIGS["flux"], "time_shift_type": "cubic"}, 4, True, 1024)
