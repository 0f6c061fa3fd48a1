"""SD 3 / 3.5's MMDiT equals diffusers' `SD3Transformer2DModel`: same state dict, f32, our NHWC against its NCHW."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import SD3Transformer2DModel as TorchSD3
from flax import nnx
from reference import nchw, nhwc, randomize, rel_error, state_dict_numpy
from test_models import fits
from test_precision import assert_all_bf16, f32, heavy_ops, in_bf16

from engine.errors import ConfigError
from engine.loading.weights import checkpoint_name, load_model
from engine.models.transformer_sd3 import SD3Transformer2DModel, SD3TransformerConfig, sincos_pos_embed
from engine.nn.layers import shapes_only

TOL = 1e-5  # tiny models, f32
REAL_TOL = 1e-4  # the UNet's tolerance in test_models.py, for the real widths

# Tiny layouts in the spirit of diffusers' own SD3 tests: SD 3 (no q/k norm, no dual attention) and SD 3.5 (RMS
# q/k norm, a second image-only attention). The text's width differs from the inner width, so a swapped
# projection cannot fit; sd35's position table is 10 tokens a side, so a 12x20 latent (6x10 patches) uses its
# full width and a crop of its height.
LAYOUTS = {
    "sd3": dict(
        sample_size=32,
        patch_size=1,
        in_channels=4,
        num_layers=3,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=32,
        caption_projection_dim=32,
        pooled_projection_dim=64,
        out_channels=4,
        pos_embed_max_size=96,
    ),
    "sd35": dict(
        sample_size=32,
        patch_size=2,
        in_channels=16,
        num_layers=3,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=40,
        caption_projection_dim=32,
        pooled_projection_dim=64,
        out_channels=16,
        pos_embed_max_size=10,
        dual_attention_layers=(0, 1),
        qk_norm="rms_norm",
    ),
}
# SD 3.5 medium's block shapes (stabilityai/stable-diffusion-3.5-medium transformer/config.json) with 2 layers.
SD35_MEDIUM_2_LAYERS = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    num_layers=2,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,
    out_channels=16,
    pos_embed_max_size=384,
    dual_attention_layers=(0,),
    qk_norm="rms_norm",
)
# The published transformer/config.json of each model, full size (their keys and values as the Hub folders state
# them; written here, not downloaded).
PUBLISHED = {
    "stable-diffusion-3-medium": dict(
        sample_size=128,
        patch_size=2,
        in_channels=16,
        num_layers=24,
        attention_head_dim=64,
        num_attention_heads=24,
        joint_attention_dim=4096,
        caption_projection_dim=1536,
        pooled_projection_dim=2048,
        out_channels=16,
        pos_embed_max_size=192,
    ),
    "stable-diffusion-3.5-medium": dict(
        SD35_MEDIUM_2_LAYERS, num_layers=24, dual_attention_layers=list(range(13)), qk_norm="rms_norm"
    ),
    "stable-diffusion-3.5-large": dict(
        SD35_MEDIUM_2_LAYERS,
        num_layers=38,
        num_attention_heads=38,
        caption_projection_dim=2432,
        pos_embed_max_size=192,
        dual_attention_layers=[],
        qk_norm="rms_norm",
    ),
}


def make_pair(layout: dict):
    ref = randomize(TorchSD3(**layout))
    cfg = SD3TransformerConfig.from_dict(dict(ref.config))
    ours = load_model(lambda: SD3Transformer2DModel(cfg, nnx.Rngs(0)), state_dict_numpy(ref))
    return ref, cfg, ours


def inputs(cfg: SD3TransformerConfig, size: tuple[int, int], text: int = 7, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, *size, cfg.in_channels)).astype(np.float32)
    t = np.array([999.0, 37.5], np.float32)  # the scheduler's sigma x 1000, fractional
    hidden = rng.standard_normal((2, text, cfg.joint_attention_dim)).astype(np.float32)
    pooled = rng.standard_normal((2, cfg.pooled_projection_dim)).astype(np.float32)
    return x, t, hidden, pooled


def theirs(ref, x, t, hidden, pooled) -> np.ndarray:
    with torch.no_grad():
        out = ref(nchw(x), torch.from_numpy(hidden), torch.from_numpy(pooled), torch.from_numpy(t)).sample
    return nhwc(out)


@nnx.jit
def forward(model, x, t, hidden, pooled):  # as the engine runs it: under jit, the text projected first
    return model(x, t, model.project_context(hidden), pooled)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("size", [(16, 16), (12, 20)])  # square, and not: each a crop of the position table
def test_transformer_matches_diffusers(layout, size):
    ref, cfg, ours = make_pair(LAYOUTS[layout])
    x, t, hidden, pooled = inputs(cfg, size)
    want = theirs(ref, x, t, hidden, pooled)
    got = forward(ours, x, t, hidden, pooled)
    assert got.shape == (2, *size, cfg.output_channels)
    assert rel_error(got, want) < TOL


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_project_context_is_the_context_embedder(layout):
    ref, cfg, ours = make_pair(LAYOUTS[layout])
    _, _, hidden, _ = inputs(cfg, (4, 4))
    with torch.no_grad():
        want = ref.context_embedder(torch.from_numpy(hidden)).numpy()
    got = ours.project_context(hidden)
    assert got.shape == (2, 7, cfg.caption_projection_dim)
    assert rel_error(got, want) < TOL


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_position_table_is_diffusers_buffer(layout):
    """The table is in the checkpoint (a persistent buffer, since pos_embed_max_size is set); ours computes the same
    numbers at init, for a model built without weights."""
    ref = TorchSD3(**LAYOUTS[layout])
    cfg = SD3TransformerConfig.from_dict(dict(ref.config))
    want = ref.pos_embed.pos_embed.numpy()
    table = sincos_pos_embed(cfg.inner_dim, cfg.pos_embed_max_size, cfg.sample_size // cfg.patch_size)
    assert table.dtype == np.float32 and table.shape == want.shape
    np.testing.assert_allclose(table, want, rtol=0, atol=1e-7)
    built = SD3Transformer2DModel(cfg, nnx.Rngs(0)).pos_embed.pos_embed[...]
    np.testing.assert_allclose(np.asarray(built), want, rtol=0, atol=1e-7)


@pytest.mark.slow
def test_sd35_medium_blocks_match_diffusers():
    """SD 3.5 medium's widths (24 heads of 64, T5's 4096, the 384-token table) with 2 layers, one of them dual."""
    ref, cfg, ours = make_pair(SD35_MEDIUM_2_LAYERS)
    # The widths are the claim, not the sequence: 8 x 8 patches (the table's centred crop, as 16 x 16 were) and 8
    # text tokens, a quarter of the tokens and of both runs' arithmetic.
    x, t, hidden, pooled = inputs(cfg, (16, 16), text=8)
    want = theirs(ref, x, t, hidden, pooled)
    got = forward(ours, x, t, hidden, pooled)
    assert rel_error(got, want) < REAL_TOL


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_give_diffusers_tensors(name):
    """Full size, without a weight in memory: every tensor diffusers' transformer of that config has, by name and
    shape, is one ours expects (the check `convert` makes when it loads a folder)."""
    raw = {"_class_name": "SD3Transformer2DModel", "_diffusers_version": "0.31.0", **PUBLISHED[name]}
    cfg = SD3TransformerConfig.from_dict(raw, where=name)
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in TorchSD3(**PUBLISHED[name]).state_dict().items()}
    with shapes_only():
        abstract = nnx.state(SD3Transformer2DModel(cfg, nnx.Rngs(0)))
    ours = {
        checkpoint_name(path): (str(path[-1]), tuple(var.get_value().shape))
        for path, var in nnx.to_flat_state(abstract)
    }
    assert set(ours) == set(want)
    misfits = [key for key, (leaf, shape) in ours.items() if not fits(leaf, want[key], shape)]
    assert not misfits, misfits


def test_runs_in_bf16_from_f32_inputs():
    cfg = SD3TransformerConfig.from_dict(LAYOUTS["sd35"])
    graphdef, params = in_bf16(lambda: SD3Transformer2DModel(cfg, nnx.Rngs(0)))

    def call(params, x, t, hidden, pooled):
        model = nnx.merge(graphdef, params)
        return model(x, t, model.project_context(hidden), pooled)

    ops = heavy_ops(call, params, f32(2, 12, 20, 16), f32(2), f32(2, 7, 40), f32(2, 64))
    assert_all_bf16(ops)


def test_bf16_stays_near_f32():
    ref = randomize(TorchSD3(**LAYOUTS["sd35"]))
    cfg = SD3TransformerConfig.from_dict(dict(ref.config))
    ours = load_model(lambda: SD3Transformer2DModel(cfg, nnx.Rngs(0)), state_dict_numpy(ref), dtype=jnp.bfloat16)
    x, t, hidden, pooled = inputs(cfg, (12, 20))
    got = forward(ours, x, t, hidden, pooled)
    assert got.dtype == jnp.bfloat16
    assert rel_error(got.astype(jnp.float32), theirs(ref, x, t, hidden, pooled)) < 0.05


def test_an_unknown_config_key_is_refused():
    with pytest.raises(ConfigError, match="unknown keys for SD3TransformerConfig: use_rope"):
        SD3TransformerConfig.from_dict({**LAYOUTS["sd3"], "use_rope": True})
    with pytest.raises(ConfigError, match="qk_norm 'layer_norm' is not supported"):
        SD3TransformerConfig.from_dict({**LAYOUTS["sd3"], "qk_norm": "layer_norm"})
    with pytest.raises(ConfigError, match="caption_projection_dim 48 must equal"):
        SD3TransformerConfig.from_dict({**LAYOUTS["sd3"], "caption_projection_dim": 48})


def test_a_latent_larger_than_the_position_table_is_refused():
    cfg = SD3TransformerConfig.from_dict(LAYOUTS["sd35"])  # 10 tokens of 2 a side: at most 20x20 latent pixels
    assert cfg.max_latent_side == 20
    ours = SD3Transformer2DModel(cfg, nnx.Rngs(0))
    x, t, hidden, pooled = inputs(cfg, (22, 8))
    with pytest.raises(ValueError, match=r"latent 22x8 is larger than .* at most 20x20 \(pos_embed_max_size 10"):
        ours(x, t, ours.project_context(hidden), pooled)
    x, t, hidden, pooled = inputs(cfg, (8, 7))
    with pytest.raises(ValueError, match="multiples of the patch size 2"):
        ours(x, t, ours.project_context(hidden), pooled)
