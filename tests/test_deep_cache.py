"""DeepCache (`deep_cache=N`): the UNet runs whole every N steps and between them only its first level, over the deep
features of its last whole step (`UNet2DConditionModel.shallow`, `Plan.deep_cache`).

The reference is diffusers' own UNet modules: the deep features are what its last up block receives in a whole
forward pass, and the first level alone is its conv_in, first down block (without the downsampler), last up block
and conv_out, called on those features. A diffusers pipeline whose UNet does that every N-th call draws the picture
the engine draws with `deep_cache=N`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tiny_pipeline
import torch
from diffusers import DDIMScheduler, EulerDiscreteScheduler, UNet2DConditionModel
from flax import nnx

from engine import load_pipeline
from engine.errors import InvalidRequest
from engine.families.loader import load_model_folder

SIZE = 64
PROMPT = "a red circle on a blue background"
TOLERANCE = 1 / 255
DEFAULTS = dict(num_inference_steps=4, guidance_scale=0.0, height=64, width=64, scheduler="euler", num_images=1)


def torch_whole(unet, sample, timestep, context, forward=None, **kwargs):
    """diffusers' whole UNet pass (`forward`: its own forward, where `unet.forward` is replaced), and the deep
    features: what its last up block receives."""
    seen = {}

    def keep(module, args, kw):
        seen["deep"] = kw["hidden_states"] if "hidden_states" in kw else args[0]

    hook = unet.up_blocks[-1].register_forward_pre_hook(keep, with_kwargs=True)
    try:
        out = (forward or unet)(sample, timestep, context, **kwargs, return_dict=False)[0]
    finally:
        hook.remove()
    return out, seen["deep"]


def torch_first_level(unet, sample, timestep, context, deep, timestep_cond=None):
    """diffusers' UNet modules of the first level alone, `deep` standing for the levels below."""
    t = torch.as_tensor(timestep).reshape(-1).expand(sample.shape[0])
    emb = unet.time_embedding(unet.time_proj(t).to(sample.dtype), timestep_cond)
    x = unet.conv_in(sample)
    skips, block = (x,), unet.down_blocks[0]
    for i, resnet in enumerate(block.resnets):
        x = resnet(x, emb)
        if getattr(block, "attentions", None) is not None:
            x = block.attentions[i](x, encoder_hidden_states=context, return_dict=False)[0]
        skips += (x,)
    up = unet.up_blocks[-1]
    if getattr(up, "attentions", None) is not None:
        x = up(hidden_states=deep, res_hidden_states_tuple=skips, temb=emb, encoder_hidden_states=context)
    else:
        x = up(hidden_states=deep, res_hidden_states_tuple=skips, temb=emb)
    return unet.conv_out(unet.conv_act(unet.conv_norm_out(x)))


def deep_cached(unet, every: int) -> None:
    """Has diffusers' UNet run whole at every `every`-th call and its first level alone between."""
    forward, state = unet.forward, {"calls": 0, "deep": None}

    def call(sample, timestep, encoder_hidden_states, *, timestep_cond=None, return_dict=True, **kwargs):
        k, state["calls"] = state["calls"], state["calls"] + 1
        if k % every == 0:
            out, state["deep"] = torch_whole(
                unet, sample, timestep, encoder_hidden_states, forward, timestep_cond=timestep_cond, **kwargs
            )
        else:
            out = torch_first_level(unet, sample, timestep, encoder_hidden_states, state["deep"], timestep_cond)
        return (out,)

    unet.forward = call


def nhwc(a) -> np.ndarray:
    return np.asarray(a).transpose(0, 2, 3, 1)


@pytest.fixture(scope="module", params=["sd1", "turbo"])
def folder(request, tmp_path_factory):
    """A tiny SD 1.x folder (CrossAttn blocks at the first level, guidance) and an SD-Turbo one (SD 2.x layout), and
    our engine serving it (one per folder, closed after: an engine holds threads and compiled programs)."""
    path = tmp_path_factory.mktemp(f"deep-cache-{request.param}")
    tiny_pipeline.write(request.param, path)
    ours = load_pipeline(path)
    yield request.param, path, ours
    ours.close()


def test_the_first_level_over_another_step_s_deep_features_is_diffusers(folder):
    _, path, _ = folder
    torch_unet = UNet2DConditionModel.from_pretrained(path / "unet").eval()
    model = load_model_folder(path, "float32")
    unet = nnx.merge(model.graphdef, model.params).unet
    r = np.random.default_rng(0)
    x1, x2 = (r.standard_normal((2, 4, 8, 8)).astype(np.float32) for _ in range(2))
    context = r.standard_normal((2, 77, torch_unet.config.cross_attention_dim)).astype(np.float32)
    with torch.no_grad():
        _, deep = torch_whole(torch_unet, torch.from_numpy(x1), torch.tensor(800), torch.from_numpy(context))
        want = torch_first_level(torch_unet, torch.from_numpy(x2), torch.tensor(600), torch.from_numpy(context), deep)
    _, our_deep = unet(nhwc(x1), np.float32(800), context, keep_deep=True)
    assert our_deep.shape == unet.deep_shape(2, 8, 8)
    np.testing.assert_allclose(np.asarray(our_deep), nhwc(deep.numpy()), atol=1e-4, rtol=1e-4)
    got = unet.shallow(nhwc(x2), np.float32(600), context, our_deep)
    np.testing.assert_allclose(np.asarray(got), nhwc(want.numpy()), atol=1e-4, rtol=1e-4)
    # Over this very step's deep features the first level gives the whole UNet's prediction: the split loses nothing.
    whole, this_step = unet(nhwc(x2), np.float32(600), context, keep_deep=True)
    np.testing.assert_allclose(unet.shallow(nhwc(x2), np.float32(600), context, this_step), whole, atol=1e-5)


# SD 1.x with its unconditional rows, SD-Turbo without; each folder's pictures are drawn with these.
PICTURE_SETTINGS = {
    "sd1": dict(guidance_scale=7.5, scheduler="ddim"),
    "turbo": dict(guidance_scale=0.0, scheduler="euler"),
}
# One reuse period per folder: each period is a program of its own (Plan.deep_cache) while every period runs the same
# code, the step's multiple of N choosing whole or first level. Both kinds of reuse are still drawn: SD 1.x's first
# level twice in a row over the same deep features (N=3), SD-Turbo's once between whole steps (N=2).
PICTURE_EVERY = {"sd1": 3, "turbo": 2}


def test_a_deep_cached_picture_is_diffusers_with_the_same_reuse(folder):
    variant, path, ours = folder
    every = PICTURE_EVERY[variant]
    guidance, scheduler = PICTURE_SETTINGS[variant]["guidance_scale"], PICTURE_SETTINGS[variant]["scheduler"]
    reference = tiny_pipeline.write(variant, path.parent / f"{path.name}-reference")
    reference.scheduler = (DDIMScheduler if scheduler == "ddim" else EulerDiscreteScheduler).from_config(
        reference.scheduler.config
    )
    deep_cached(reference.unet, every)
    latents = np.random.default_rng(1).standard_normal((2, 4, SIZE // 8, SIZE // 8)).astype(np.float32)
    kw = dict(num_inference_steps=5, guidance_scale=guidance, height=SIZE, width=SIZE)
    with torch.no_grad():
        want = reference(
            PROMPT, latents=torch.from_numpy(latents), num_images_per_prompt=2, output_type="np", **kw
        ).images
    got = ours.generate(PROMPT, seed=0, num_images=2, latents=latents, scheduler=scheduler, deep_cache=every, **kw)
    whole = ours.generate(PROMPT, seed=0, num_images=2, latents=latents, scheduler=scheduler, **kw)
    assert np.abs(got.arrays - want).max() < TOLERANCE
    assert np.abs(got.arrays - whole.arrays).max() > TOLERANCE  # the reuse changed the picture: it ran


def test_deep_cache_1_is_every_step_whole(folder):
    variant, _, ours = folder
    # The pictures' batch, scheduler and guidance: the whole UNet's programs drawn above serve, none compiles anew.
    kw = dict(seed=3, num_inference_steps=3, height=SIZE, width=SIZE, num_images=2, **PICTURE_SETTINGS[variant])
    np.testing.assert_array_equal(ours.generate(PROMPT, deep_cache=1, **kw).arrays, ours.generate(PROMPT, **kw).arrays)


@pytest.mark.parametrize("value", [-1, 11, 2.5, "2", True])
def test_a_deep_cache_out_of_range_is_refused_by_name(folder, value):
    ours = folder[2]
    with pytest.raises(InvalidRequest, match="deep_cache must be a whole number from 0"):
        ours.generate(PROMPT, deep_cache=value, height=SIZE, width=SIZE)


def test_deep_cache_is_refused_with_a_controlnet_and_for_a_denoiser_without_levels():
    from PIL import Image

    from engine.request import GenerationRequest, Limits

    limits = Limits(schedulers=("euler",), side_multiple=8, max_side=512, max_clip_skip=0, devices=1)
    with_unet = dataclasses.replace(limits, max_deep_cache=10, control=True)
    request = GenerationRequest(PROMPT, deep_cache=2)
    with pytest.raises(InvalidRequest, match="no UNet levels"):
        limits.check(limits.resolve(request, DEFAULTS))
    controlled = dataclasses.replace(request, control_image=Image.new("RGB", (64, 64)))
    with pytest.raises(InvalidRequest, match="ControlNet"):
        with_unet.check(with_unet.resolve(controlled, DEFAULTS))
    with_unet.check(with_unet.resolve(request, DEFAULTS))  # a UNet without a ControlNet takes it
