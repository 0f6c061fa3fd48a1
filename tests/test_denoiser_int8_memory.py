"""`--quantize int8`'s DiT denoisers widen their int8 kernels one block at a time inside each step, not all at once.

Widened all at once (the whole transformer through `dequantize(after=x)` at the top of each step, as the sampling
program once did), XLA held every block's f32 kernels at once: Z-Image's 6B transformer is 24 GB in f32, and its first
picture at real shapes grew past 22 GB and was killed. Now the step leaves the blocks' kernels int8 (`dequantize(keep=
nn.int8_weights.widened_blocks(...))`: the block lists each transformer class names in `WIDENED_BLOCKS`) and the transformer's
block loop widens each block's once that block's input exists (`nn.int8_weights.widened`, as Qwen3's layers:
tests/test_qwen3_int8_memory.py); the embedders and final layer, small, are widened at the step's start.

What is proven, on a step as `pipeline.advance` runs it (a `fori_loop` whose body widens the tree after the carry,
`dequantize(after=x, keep=)`, and calls the family's `denoise`), for Z-Image (2 noise-refiner and 8 main blocks of
256 wide: 4.2 MB of f32 kernels a block) and FLUX.2 (2 double- and 8 single-stream blocks of 256 wide: 6.8 and 3.4
MB): XLA's temporaries of the compiled loop stay within two of the largest block's widened kernels, where widening
all at once needs at least every block's; and the latents after two steps are exactly those of the widened-all-at-once
program (the same int8 values times the same scales: the same kernels).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from engine.families import FAMILIES
from engine.families.base import Conditioning, Models
from engine.loading.quantize import Int8Kernel, dequantize, quantize_params
from engine.models.transformer_flux2 import Flux2Transformer2DModel, Flux2TransformerConfig
from engine.models.transformer_z_image import ZImageTransformer2DModel, ZImageTransformerConfig
from engine.nn.int8_weights import widened_blocks

WIDTH, TEXT = 256, 32
Z_IMAGE = ZImageTransformerConfig(
    dim=WIDTH,
    n_layers=8,
    n_refiner_layers=2,
    n_heads=4,
    n_kv_heads=4,
    cap_feat_dim=64,
    axes_dims=(16, 24, 24),
    axes_lens=(64, 32, 32),
)
FLUX2 = Flux2TransformerConfig(
    in_channels=16,
    num_layers=2,
    num_single_layers=8,
    attention_head_dim=128,
    num_attention_heads=2,
    joint_attention_dim=64,
    guidance_embeds=False,
)


def z_image_inputs(rng: np.random.Generator) -> tuple:
    """Latents [1, 8, 8, 16] and the step's projected text: (refined caption [1, 32, 256], its length)."""
    x = rng.standard_normal((1, 8, 8, 16), np.float32)
    return x, (rng.standard_normal((1, TEXT, WIDTH), np.float32), np.array([20], np.int32))


def flux2_inputs(rng: np.random.Generator) -> tuple:
    """Latents [1, 4, 4, 16] and the projected text [1, 32, 256]."""
    return rng.standard_normal((1, 4, 4, 16), np.float32), rng.standard_normal((1, TEXT, WIDTH), np.float32)


# family -> (the transformer, its inputs, the block lists a step runs: Z-Image's caption refiner runs once per request)
CASES = {
    "z-image": (lambda: ZImageTransformer2DModel(Z_IMAGE, nnx.Rngs(0)), z_image_inputs, ("noise_refiner", "layers")),
    "flux2": (
        lambda: Flux2Transformer2DModel(FLUX2, nnx.Rngs(0)),
        flux2_inputs,
        ("transformer_blocks", "single_transformer_blocks"),
    ),
}


def block_bytes(params: nnx.State, lists: tuple[str, ...]) -> list[int]:
    """The f32 bytes of each block's widened kernels, the blocks of the transformer's `lists`."""
    int8 = lambda x: isinstance(x, Int8Kernel)  # noqa: E731
    blocks = [block for name in lists for block in params["transformer"][name].values()]
    return [sum(4 * k.values.size for k in jax.tree.leaves(block, is_leaf=int8) if int8(k)) for block in blocks]


def step_loop(family: str, graphdef: nnx.GraphDef, keep: tuple):
    """`pipeline.advance`'s loop, its scheduler a plain Euler step: the tree widened after the carry in each turn."""
    denoise = FAMILIES[family].denoiser.denoise

    def run(params, x, kv, steps):
        def body(i, x):
            models = nnx.merge(graphdef, dequantize(params, after=x, keep=keep))
            t = jnp.broadcast_to(1000.0 - 400.0 * i, x.shape[:1])
            return x - 0.4 * denoise(models, x, t, kv, Conditioning(None), ())

        return jax.lax.fori_loop(0, steps, body, x)

    return jax.jit(run)


@pytest.mark.parametrize("family", sorted(CASES))
def test_each_step_widens_one_block_at_a_time(family):
    build, inputs, lists = CASES[family]
    graphdef, params = nnx.split(Models(transformer=build()))
    params = quantize_params(params, "transformer")  # what `--quantize int8` loads
    keep = widened_blocks(nnx.merge(graphdef, params))  # what the step program leaves int8
    assert {("transformer", name) for name in lists} <= set(keep)
    x, kv = inputs(np.random.default_rng(0))
    steps = np.int32(2)
    at_once, by_block = step_loop(family, graphdef, ()), step_loop(family, graphdef, keep)
    before, after = (
        run.lower(params, x, kv, steps).compile().memory_analysis().temp_size_in_bytes for run in (at_once, by_block)
    )
    blocks = block_bytes(params, lists)
    assert len(blocks) == 10
    print(f"{family} step temporaries: {before} bytes widened at once, {after} by block (blocks: {blocks})")
    assert before >= sum(blocks)  # what the bound below is measured against: every block wide at once
    assert after <= 2 * max(blocks)
    np.testing.assert_array_equal(by_block(params, x, kv, steps), at_once(params, x, kv, steps))
