"""Token merging (`token_merging=r`, `nn.token_merging`): the first UNet level's self-attentions read the image's
tokens with the share r merged into similar ones, as the `tomesd` package does (`apply_patch(ratio=r,
use_rand=False)`, its defaults otherwise: the first level, self-attention only).

The reference is tomesd's own bipartite soft matching around diffusers' own transformer blocks.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import tiny_pipeline
import torch
from tomesd.merge import bipartite_soft_matching_random2d

from engine import load_pipeline
from engine.errors import InvalidRequest
from engine.nn.token_merging import bipartite_merge, partition
from engine.request import GenerationRequest, Limits

SIZE = 64
PROMPT = "a red circle on a blue background"
TOLERANCE = 1 / 255


@pytest.mark.parametrize("h, w, ratio", [(8, 8, 0.5), (5, 7, 0.3), (16, 12, 0.75), (4, 4, 0.9)])
def test_merge_and_unmerge_are_tomesd_s(h, w, ratio):
    r = np.random.default_rng(0)
    metric, x = (r.standard_normal((2, h * w, 16)).astype(np.float32) for _ in range(2))
    count = int(h * w * ratio)
    merge, unmerge = bipartite_soft_matching_random2d(torch.from_numpy(metric), w, h, 2, 2, count, no_rand=True)
    ours_merge, ours_unmerge = bipartite_merge(jnp.asarray(metric), h, w, count)
    want, got = merge(torch.from_numpy(x)).numpy(), np.asarray(ours_merge(jnp.asarray(x)))
    assert got.shape == want.shape == (2, h * w - min(count, len(partition(h, w)[0])), 16)
    # The same rows (tomesd orders the kept sources by similarity too, with ties broken its own way).
    np.testing.assert_allclose(np.sort(got, axis=1), np.sort(want, axis=1), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(ours_unmerge(ours_merge(jnp.asarray(x)))), unmerge(merge(torch.from_numpy(x))).numpy(), atol=1e-6
    )


def tome_block(block, size: tuple[int, int], ratio: float):
    """diffusers' `BasicTransformerBlock` (LayerNorm kind) with tomesd's merging around its self-attention."""
    h, w = size

    def forward(hidden_states, attention_mask=None, encoder_hidden_states=None, **_):
        merge, unmerge = bipartite_soft_matching_random2d(
            hidden_states, w, h, 2, 2, int(hidden_states.shape[1] * ratio), no_rand=True
        )
        x = unmerge(block.attn1(merge(block.norm1(hidden_states)))) + hidden_states
        x = block.attn2(block.norm2(x), encoder_hidden_states=encoder_hidden_states) + x
        return block.ff(block.norm3(x)) + x

    block.forward = forward


@pytest.fixture(scope="module", params=["sd1", "turbo"])
def folder(request, tmp_path_factory):
    """A tiny SD 1.x and an SD-Turbo folder, and our engine serving it (closed after)."""
    path = tmp_path_factory.mktemp(f"tome-{request.param}")
    tiny_pipeline.write(request.param, path)
    ours = load_pipeline(path)
    yield request.param, path, ours
    ours.close()


# One ratio per folder: each ratio is a program of its own (Plan.token_merging) while the two ratios run the same
# merging code, whose every ratio test_merge_and_unmerge_are_tomesd_s checks against tomesd op by op; what the
# folders add is guidance on and off, and a whole picture. Both ratios are still drawn: 32 of 64 tokens, and 19.
PICTURE_RATIOS = {"sd1": 0.5, "turbo": 0.3}


def test_a_token_merged_picture_is_diffusers_with_tomesd_s_merging(folder):
    variant, path, ours = folder
    ratio = PICTURE_RATIOS[variant]
    reference = tiny_pipeline.write(variant, path.parent / f"{path.name}-reference")
    latent = (SIZE // 8, SIZE // 8)
    first_level = [*reference.unet.down_blocks[0].attentions, *reference.unet.up_blocks[-1].attentions]
    assert first_level  # the tiny layouts attend at their first level, as SD 1.x and 2.x do
    for transformer in first_level:
        for block in transformer.transformer_blocks:
            tome_block(block, latent, ratio)
    guidance = 7.5 if variant == "sd1" else 0.0
    latents = np.random.default_rng(1).standard_normal((2, 4, *latent)).astype(np.float32)
    kw = dict(num_inference_steps=3, guidance_scale=guidance, height=SIZE, width=SIZE)
    with torch.no_grad():
        want = reference(PROMPT, latents=torch.from_numpy(latents), num_images_per_prompt=2, output_type="np", **kw)
    got = ours.generate(PROMPT, seed=0, num_images=2, latents=latents, token_merging=ratio, **kw)
    whole = ours.generate(PROMPT, seed=0, num_images=2, latents=latents, **kw)
    assert np.abs(got.arrays - want.images).max() < TOLERANCE
    assert np.abs(got.arrays - whole.arrays).max() > TOLERANCE  # the merging changed the picture: it ran


LIMITS = Limits(schedulers=("euler",), side_multiple=8, max_side=512, max_clip_skip=0, devices=1)
DEFAULTS = dict(num_inference_steps=4, guidance_scale=0.0, height=64, width=64, scheduler="euler", num_images=1)


@pytest.mark.parametrize("value", [-0.1, 0.8, "0.5", True, float("nan")])
def test_a_token_merging_ratio_out_of_range_is_refused_by_name(value):
    limits = dataclasses.replace(LIMITS, max_token_merging=0.75)
    with pytest.raises(InvalidRequest, match="token_merging must be a number from 0 .off. to 0.75"):
        limits.resolve(GenerationRequest(PROMPT, token_merging=value), DEFAULTS)
    assert limits.resolve(GenerationRequest(PROMPT, token_merging=0.75), DEFAULTS).token_merging == 0.75


def test_token_merging_is_refused_for_a_denoiser_without_unet_levels():
    with pytest.raises(InvalidRequest, match="no UNet levels to merge in"):
        LIMITS.resolve(GenerationRequest(PROMPT, token_merging=0.5), DEFAULTS)
