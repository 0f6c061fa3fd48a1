"""FLUX.1's transformer equals diffusers' `FluxTransformer2DModel` fed as FluxPipeline feeds it (f32, same weights)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import FluxPipeline
from diffusers import FluxTransformer2DModel as TorchFlux
from flax import nnx
from reference import nchw, nhwc, randomize, randomized, rel_error, state_dict_numpy
from test_precision import assert_all_bf16, f32, heavy_ops, in_bf16

from engine.errors import ConfigError
from engine.loading.weights import load_model
from engine.models.transformer_flux import FluxTransformer2DModel, FluxTransformerConfig, pack, unpack
from engine.nn.layers import shapes_only

TOL = 1e-5  # tiny configs, f32
REAL_TOL = 1e-4  # test_models.py's UNet tolerance

TINY = dict(
    patch_size=1,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    axes_dims_rope=(4, 4, 8),
)
LAYOUTS = {  # in_channels = 4 x the latent channels, as FluxPipeline packs them
    "schnell": dict(TINY, in_channels=16, guidance_embeds=False),
    "dev": dict(TINY, in_channels=64, guidance_embeds=True),
}
FLUX1_DEV = dict(  # black-forest-labs/FLUX.1-dev transformer/config.json: 19 double and 38 single blocks, 11.9B
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
FLUX1 = dict(FLUX1_DEV, num_layers=1, num_single_layers=1)  # one block of each kind


def ours_from_torch(ref: TorchFlux) -> FluxTransformer2DModel:
    cfg = FluxTransformerConfig.from_dict(dict(ref.config))
    return load_model(lambda: FluxTransformer2DModel(cfg, nnx.Rngs(0)), state_dict_numpy(ref))


def inputs(cfg: FluxTransformerConfig, size: tuple[int, int], tokens: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    values = dict(
        x=rng.standard_normal((2, *size, cfg.latent_channels)).astype(np.float32),
        timestep=np.array([1.0, 0.37], np.float32),  # t / 1000, as FluxPipeline passes it
        encoder_hidden_states=rng.standard_normal((2, tokens, cfg.joint_attention_dim)).astype(np.float32),
        pooled_projections=rng.standard_normal((2, cfg.pooled_projection_dim)).astype(np.float32),
    )
    if cfg.guidance_embeds:
        values["guidance"] = np.array([3.5, 1.0], np.float32)  # the guidance scale itself
    return values


def diffusers_prediction(ref: TorchFlux, x, timestep, encoder_hidden_states, pooled_projections, guidance=None):
    """The transformer's output as FluxPipeline gets it: packed latents and ids in, unpacked to NHWC out."""
    b, h, w, c = x.shape
    packed = FluxPipeline._pack_latents(nchw(x), b, c, h, w)
    img_ids = FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, "cpu", torch.float32)
    txt_ids = torch.zeros(encoder_hidden_states.shape[1], 3)
    with torch.no_grad():
        out = ref(
            hidden_states=packed,
            encoder_hidden_states=torch.from_numpy(encoder_hidden_states),
            pooled_projections=torch.from_numpy(pooled_projections),
            timestep=torch.from_numpy(timestep),
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=None if guidance is None else torch.from_numpy(guidance),
        ).sample
    vae_scale_factor = 8  # _unpack_latents takes the picture's size
    return nhwc(FluxPipeline._unpack_latents(out, h * vae_scale_factor, w * vae_scale_factor, vae_scale_factor))


def ours_prediction(
    ours: FluxTransformer2DModel, x, timestep, encoder_hidden_states, pooled_projections, guidance=None
):
    context = ours.project_context(encoder_hidden_states)  # once per request, as the server runs it
    return np.asarray(ours(x, timestep, context, pooled_projections, guidance))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("size", [(8, 8), (6, 10)])
def test_flux_matches_diffusers(layout, size):
    """Raw text in both: diffusers' forward embeds it, ours through `project_context`, then `__call__`."""
    ref = randomize(TorchFlux(**LAYOUTS[layout]))
    ours = ours_from_torch(ref)
    values = inputs(ours.config, size, tokens=7)
    want = diffusers_prediction(ref, **values)
    got = ours_prediction(ours, **values)
    assert got.shape == (2, *size, ours.config.latent_channels)
    assert rel_error(got, want) < TOL, np.abs(got - want).max()


@pytest.mark.slow  # about 25 s on two cores: 500M parameters, drawn, copied and run twice (7 GB at the peak)
def test_flux1_block_shapes_match_diffusers():
    start = time.perf_counter()
    # std 0.02 keeps the activations near 1 at FLUX.1's width (3072); the default 0.1 grows them 5x per layer.
    ref = randomized(TorchFlux, std=0.02, **FLUX1)
    ours = ours_from_torch(ref)
    # The widths are the claim, not the sequence: 8 x 8 packed patches (rotary positions along both axes, as at
    # 32 x 32) and 8 text tokens: a quarter of the tokens, of the runs' arithmetic and of the activations.
    values = inputs(ours.config, (16, 16), tokens=8)
    want = diffusers_prediction(ref, **values)
    del ref
    got = ours_prediction(ours, **values)
    assert rel_error(got, want) < REAL_TOL, (np.abs(got - want).max(), time.perf_counter() - start)


def test_pack_and_unpack_are_flux_pipelines():
    x = np.random.default_rng(1).standard_normal((2, 6, 10, 4)).astype(np.float32)
    want = FluxPipeline._pack_latents(nchw(x), 2, 4, 6, 10).numpy()
    np.testing.assert_array_equal(np.asarray(pack(x)), want)
    np.testing.assert_array_equal(np.asarray(unpack(pack(x), 6, 10)), x)


def test_the_latent_channels_are_the_unpacked_ones():
    assert FluxTransformerConfig().latent_channels == 16  # FLUX.1's VAE; in_channels 64 packs 2x2 of them
    assert FluxTransformerConfig.from_dict(dict(FLUX1, num_layers=19, num_single_layers=38)).inner_dim == 3072


def test_an_unknown_config_key_is_refused():
    with pytest.raises(ConfigError, match="unknown keys.*qk_norm"):
        FluxTransformerConfig.from_dict(dict(TINY, qk_norm="rms_norm"))


def test_rope_dims_must_fill_a_head():
    with pytest.raises(ConfigError, match="must sum to attention_head_dim"):
        FluxTransformerConfig.from_dict(dict(TINY, axes_dims_rope=(4, 4, 4)))


@pytest.fixture(scope="module")
def tiny_dev():
    """Parameters as shapes only: the inputs are checked before any weight is read."""
    with shapes_only():
        return FluxTransformer2DModel(FluxTransformerConfig.from_dict(LAYOUTS["dev"]), nnx.Rngs(0))


def checked_inputs(model: FluxTransformer2DModel, size: tuple[int, int]) -> dict[str, np.ndarray]:
    values = inputs(model.config, size, tokens=3)
    values["encoder_hidden_states"] = np.zeros((2, 3, model.config.inner_dim), np.float32)  # as projected
    return values


def test_odd_latent_sides_are_refused(tiny_dev):
    x, t, context, pooled, guidance = checked_inputs(tiny_dev, (8, 7)).values()
    with pytest.raises(ValueError, match="8x7 must be even"):
        tiny_dev(x, t, context, pooled, guidance)


def test_guidance_goes_with_guidance_embeds(tiny_dev):
    x, t, context, pooled, _ = checked_inputs(tiny_dev, (4, 4)).values()
    with pytest.raises(ValueError, match="pass guidance"):
        tiny_dev(x, t, context, pooled)


def test_jitted_bf16_is_near_f32():
    """As the engine runs it on an accelerator: bf16 weights, under jit (the RoPE tables are constants)."""
    ref = randomize(TorchFlux(**LAYOUTS["dev"]))
    values = inputs(FluxTransformerConfig.from_dict(LAYOUTS["dev"]), (6, 10), tokens=7)
    want = diffusers_prediction(ref, **values)
    cfg = FluxTransformerConfig.from_dict(LAYOUTS["dev"])
    ours = load_model(lambda: FluxTransformer2DModel(cfg, nnx.Rngs(0)), state_dict_numpy(ref), dtype=jnp.bfloat16)
    graphdef, params = nnx.split(ours)

    @jax.jit
    def step(params, x, t, text, pooled, g):
        model = nnx.merge(graphdef, params)
        return model(x, t, model.project_context(text), pooled, g)

    got = step(params, *values.values())
    assert got.dtype == jnp.bfloat16
    assert rel_error(np.asarray(got, np.float32), want) < 3e-2  # 7.5e-3 measured


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_flux_runs_in_bf16_from_f32_inputs(layout):
    cfg = FluxTransformerConfig.from_dict(LAYOUTS[layout])
    graphdef, params = in_bf16(lambda: FluxTransformer2DModel(cfg, nnx.Rngs(0)))

    def call(params, x, t, text, pooled, g):
        model = nnx.merge(graphdef, params)
        return model(x, t, model.project_context(text), pooled, g)

    guidance = f32(2) if cfg.guidance_embeds else None
    text = f32(2, 7, cfg.joint_attention_dim)
    assert_all_bf16(heavy_ops(call, params, f32(2, 8, 8, cfg.latent_channels), f32(2), text, f32(2, 32), guidance))
