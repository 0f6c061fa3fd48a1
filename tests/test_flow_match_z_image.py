"""The flow-matching Euler kind runs ZImagePipeline's schedule as diffusers does, bit for bit.

ZImagePipeline hands `set_timesteps` its own sigmas, torch.linspace(1, 1/n, n) in float32
(`get_default_z_image_sigmas`), and `mu` from the picture's token count, which a scheduler without dynamic shifting
ignores. Z-Image-Turbo's scheduler shifts by 3 and the base model's by 6, both statically: their
scheduler/scheduler_config.json (Tongyi-MAI/Z-Image-Turbo, Tongyi-MAI/Z-Image) hold num_train_timesteps 1000,
use_dynamic_shifting false and shift 3.0 / 6.0, as the public copies of those files read (ComfyUI and
ai-toolkit plugins' presets; the Hub itself is not reachable from here).
"""

from __future__ import annotations

import diffusers
import numpy as np
import pytest
import torch
from diffusers.pipelines.z_image.pipeline_z_image import calculate_shift, get_default_z_image_sigmas
from test_flow_match import LATENTS, MAX_STEPS, loop, torch_model

from engine import schedulers as S
from engine.schedulers.flow_match_euler import torch_linspace, uniform_sigmas

FLOW = dict(_class_name="FlowMatchEulerDiscreteScheduler", num_train_timesteps=1000)
CONFIGS = {
    "turbo": {**FLOW, "use_dynamic_shifting": False, "shift": 3.0},  # Tongyi-MAI/Z-Image-Turbo
    "base": {**FLOW, "use_dynamic_shifting": False, "shift": 6.0},  # Tongyi-MAI/Z-Image
    "dynamic": {**FLOW, "use_dynamic_shifting": True},  # diffusers' defaults: mu from the token count
}
# (config, steps, latent height and width): Turbo's 9 steps and the base model's 50, as their model cards run them
CASES = [("turbo", 9, (128, 128)), ("turbo", 8, (96, 160)), ("base", 50, (128, 128)), ("dynamic", 9, (64, 96))]


def reference(raw: dict, n: int, latent_size: tuple[int, int]):
    """ZImagePipeline's steps 5 and 6: its sigmas and mu to `set_timesteps`, then the loop's scheduler steps."""
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_config(raw)
    image_seq_len = (latent_size[0] // 2) * (latent_size[1] // 2)
    c = scheduler.config
    mu = calculate_shift(
        image_seq_len,
        c.get("base_image_seq_len", 256),
        c.get("max_image_seq_len", 4096),
        c.get("base_shift", 0.5),
        c.get("max_shift", 1.15),
    )
    scheduler.set_timesteps(sigmas=get_default_z_image_sigmas(n), mu=mu)
    scheduler.set_begin_index(0)
    x = torch.from_numpy(LATENTS)
    for t in scheduler.timesteps:
        x = scheduler.step(torch_model(x, t), t, x).prev_sample
    return scheduler.timesteps.numpy(), scheduler.sigmas.numpy(), x.numpy()


@pytest.mark.parametrize(("config_name", "n", "latent_size"), CASES)
def test_the_schedule_is_z_image_pipelines(config_name, n, latent_size):
    want_timesteps, want_sigmas, want = reference(CONFIGS[config_name], n, latent_size)
    tokens = (latent_size[0] // 2) * (latent_size[1] // 2)
    config = S.SchedulerConfig.from_dict(CONFIGS[config_name])
    tables = S.tables(config, "flow_euler", n, MAX_STEPS + 40, image_tokens=tokens, uniform_sigmas="torch")
    assert int(tables.num_loop_steps) == n
    np.testing.assert_array_equal(tables.timesteps[:n], want_timesteps)
    np.testing.assert_array_equal(tables.coefficients["sigmas"][: n + 1], want_sigmas)
    np.testing.assert_allclose(loop(tables, LATENTS), want, rtol=1e-5, atol=1e-5)


def test_turbo_spends_its_nine_steps_at_high_noise():
    """Shift 3 moves linspace(1, 1/9, 9) up, 3s / (1 + 2s): the middle sigma 5/9 to 15/19, the last 1/9 to 3/11."""
    tables = S.tables(S.SchedulerConfig.from_dict(CONFIGS["turbo"]), "flow_euler", 9, 9, uniform_sigmas="torch")
    sigmas = tables.coefficients["sigmas"][:10]
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0
    np.testing.assert_allclose(sigmas[[4, 8]], [15 / 19, 3 / 11], rtol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 3, 9, 10, 14, 30, 50, 77, 100])
def test_torch_linspace_is_torchs_to_the_bit(n):
    want = torch.linspace(1.0, 1 / n, n).numpy()
    np.testing.assert_array_equal(torch_linspace(1.0, 1 / n, n), want)
    np.testing.assert_array_equal(uniform_sigmas(n, "torch"), np.asarray(get_default_z_image_sigmas(n), np.float32))


def test_numpys_and_torchs_linspace_differ_in_the_last_bit():
    """Why the pipelines' two kinds are told apart: at 10 steps, 5 of the 10 sigmas differ."""
    numpy_kind, torch_kind = uniform_sigmas(10, True), uniform_sigmas(10, "torch")
    assert 0 < np.sum(numpy_kind != torch_kind) and np.allclose(numpy_kind, torch_kind, rtol=1e-7, atol=0)


def test_an_unknown_linspace_is_refused():
    with pytest.raises(ValueError, match="numpy or torch"):
        uniform_sigmas(4, "jax")
