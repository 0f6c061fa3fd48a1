"""bf16 on accelerators means bf16 where the work is: every matmul and convolution takes bf16 operands.

A float32 value that leaks into a block (a timestep embedding, the f32 latents the scheduler
keeps, an f32 text embedding) promotes everything after it to f32 and halves the speed on a GPU
without changing a single output digit, so no parity test would notice. These tests read the
program XLA is handed, before any backend rewrites it, and name the first f32 op they find.
Attention logits may accumulate in f32 (`accumulation_type`); their operands must still be bf16.
"""

from __future__ import annotations

import re
from unittest import mock

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from reference import CLIP_COMMON, CLIP_LAYOUTS, UNET_LAYOUTS, VAE_LAYOUT

from engine.models.clip import CLIPTextModel
from engine.models.config import CLIPTextConfig, UNetConfig, VAEConfig
from engine.models.unet import UNet2DConditionModel
from engine.models.vae import AutoencoderKL
from engine.nn import onednn
from engine.nn.layers import shapes_only

HEAVY_OPS = re.compile(r"stablehlo\.(convolution|dot_general)\b.*? : \((tensor<[^>]*>), (tensor<[^>]*>)\)")


def in_bf16(make):
    """The module's graph and a bf16 copy of its parameter shapes, as the engine loads them on a GPU."""
    with shapes_only():
        module = make()
    graphdef, params = nnx.split(module)
    return graphdef, jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.bfloat16), params)


def heavy_ops(fn, *args) -> list[tuple[str, str, str]]:
    """The program's convolutions and dots as an accelerator gets them: on this CPU bf16 layers would otherwise
    lower to oneDNN's custom calls (engine/nn/onednn.py, tests/test_onednn.py), which cast to bf16 themselves."""
    with mock.patch.object(onednn, "handlers", lambda: None):
        text = jax.jit(fn).lower(*args).as_text()
    return HEAVY_OPS.findall(text)


def assert_all_bf16(ops):
    assert ops, "no convolution or matmul found: the pattern no longer matches the program text"
    f32 = [op for op in ops if not (op[1].endswith("xbf16>") and op[2].endswith("xbf16>"))]
    assert not f32, f"{len(f32)} of {len(ops)} heavy ops are not bf16, e.g. {f32[0]}"


def f32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


@pytest.mark.parametrize("layout", sorted(UNET_LAYOUTS))
def test_unet_runs_in_bf16_from_f32_inputs(layout):
    cfg = UNetConfig.from_dict(UNET_LAYOUTS[layout])
    graphdef, params = in_bf16(lambda: UNet2DConditionModel(cfg, nnx.Rngs(0)))
    extra = {}
    if cfg.addition_embed_type == "text_time":
        extra = dict(text_embeds=f32(2, 32), time_ids=f32(2, 6))

    def call(params, sample, t, context, extra):
        return nnx.merge(graphdef, params)(sample, t, context, **extra)

    # The pipeline hands the UNet f32 latents, f32 timesteps and f32 conditioning.
    ops = heavy_ops(call, params, f32(2, 16, 16, 4), f32(2), f32(2, 7, cfg.per_block("cross_attention_dim")[0]), extra)
    assert_all_bf16(ops)


def test_vae_decoder_runs_in_bf16_from_f32_latents():
    cfg = VAEConfig.from_dict(VAE_LAYOUT)
    graphdef, params = in_bf16(lambda: AutoencoderKL(cfg, nnx.Rngs(0)))
    ops = heavy_ops(lambda p, z: nnx.merge(graphdef, p).decode(z), params, f32(1, 8, 8, 4))
    assert_all_bf16(ops)


@pytest.mark.parametrize("layout", sorted(CLIP_LAYOUTS))
def test_text_encoder_runs_in_bf16(layout):
    cfg = CLIPTextConfig.from_dict({**CLIP_COMMON, **CLIP_LAYOUTS[layout]})
    graphdef, params = in_bf16(lambda: CLIPTextModel(cfg, nnx.Rngs(0), with_projection=True))
    ids = jax.ShapeDtypeStruct((2, 77), jnp.int32)
    ops = heavy_ops(lambda p, ids: nnx.merge(graphdef, p)(ids).pooled, params, ids)
    assert_all_bf16(ops)
