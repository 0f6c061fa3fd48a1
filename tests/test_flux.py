"""FLUX.1 schnell and dev end to end: our engine on tiny diffusers folders written with `save_pretrained`.

The same prompt and initial latents through diffusers' `FluxPipeline` (which takes them packed into 2x2 patches)
and through `load_pipeline(folder).generate` (which takes them as every family does, [n, 16, h, w]), in f32:
pictures within 1/255, at two sizes (the dev schedule's shift follows the token count) and two step counts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from reference import CLIP_LAYOUTS, VAE_LAYOUT, randomize
from t5_reference import save_tiny_t5_tokenizer, tiny_t5_encoder
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5TokenizerFast

from engine import GenerationRequest, InvalidRequest, load_pipeline
from engine.errors import ConfigError
from tools.tiny_tokenizer import write_tokenizer

WORDS = ["a", "red", "circle", "on", "blue", "background", "photo", "cat"]
PROMPT = "a red circle on a blue background"
TOLERANCE = 1 / 255
LATENT_CHANNELS = 16
TRANSFORMER = dict(
    patch_size=1,
    in_channels=4 * LATENT_CHANNELS,  # 2x2 patches of the 16 latent channels
    num_layers=1,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=40,  # T5's width
    pooled_projection_dim=32,  # CLIP's width
    axes_dims_rope=(4, 4, 8),
)
# black-forest-labs/FLUX.1-dev's and -schnell's scheduler_config.json
SCHEDULERS = {
    "dev": dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15),
    "schnell": dict(shift=1.0, use_dynamic_shifting=False),
}
VAE = dict(VAE_LAYOUT, latent_channels=LATENT_CHANNELS, use_quant_conv=False, use_post_quant_conv=False)


def build_reference(kind: str, tmp_path_factory) -> FluxPipeline:
    clip_dir, t5_dir = tmp_path_factory.mktemp("clip"), tmp_path_factory.mktemp("t5")
    vocab = write_tokenizer(clip_dir, WORDS)
    clip = CLIPTextConfig(
        **CLIP_LAYOUTS["sd1"],
        **dict(vocab_size=vocab, max_position_embeddings=77, bos_token_id=vocab - 2, eos_token_id=vocab - 1),
        pad_token_id=vocab - 1,
    )
    t5 = dict(d_model=40, d_kv=8, num_heads=4, d_ff=64, num_layers=2, feed_forward_proj="gated-gelu")
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULERS[kind]),
        vae=randomize(AutoencoderKL(**VAE, scaling_factor=0.3611, shift_factor=0.1159), 4, std=0.05),
        text_encoder=randomize(CLIPTextModel(clip), 1),
        tokenizer=CLIPTokenizer.from_pretrained(str(clip_dir)),
        text_encoder_2=tiny_t5_encoder(save_tiny_t5_tokenizer(t5_dir), 5, **t5),
        tokenizer_2=T5TokenizerFast.from_pretrained(str(t5_dir)),
        transformer=randomize(FluxTransformer2DModel(**TRANSFORMER, guidance_embeds=kind == "dev"), 3, std=0.05),
    )


@pytest.fixture(scope="module", params=["dev", "schnell"])
def flux(request, tmp_path_factory):
    reference = build_reference(request.param, tmp_path_factory)
    folder = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(folder)
    engine = load_pipeline(folder, safety_checker=False)
    yield request.param, reference, engine, folder
    engine.close()


def latents(height: int, width: int, n: int = 2, seed: int = 0) -> np.ndarray:
    shape = (n, LATENT_CHANNELS, height // 2, width // 2)  # the test VAE's factor is 2
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def run_reference(reference: FluxPipeline, start: np.ndarray, height: int, width: int, **kwargs) -> np.ndarray:
    n, c, h, w = start.shape
    packed = FluxPipeline._pack_latents(torch.from_numpy(start), n, c, h, w)
    with torch.no_grad():
        return reference(prompt=PROMPT, latents=packed, height=height, width=width, output_type="np", **kwargs).images


@pytest.mark.parametrize(("height", "width"), [(32, 32), (32, 48)])
@pytest.mark.parametrize("steps", [2, 4])
def test_pictures_match_diffusers(flux, height, width, steps):
    kind, reference, ours, _ = flux
    start = latents(height, width)
    guidance = 3.5 if kind == "dev" else 0.0
    want = run_reference(reference, start, height, width, num_inference_steps=steps, guidance_scale=guidance)
    got = ours.generate(
        PROMPT, height=height, width=width, num_images=2, latents=start, num_inference_steps=steps,
        guidance_scale=guidance,
    ).arrays  # fmt: skip
    assert np.abs(got - want).max() < TOLERANCE
    assert want.std() > 0.02  # a picture, not a flat field that any mistake would still match


def test_dev_reads_the_guidance_scale(flux):
    kind, reference, ours, _ = flux
    if kind != "dev":
        pytest.skip("schnell has no guidance")
    start = latents(32, 32, n=1)
    args = dict(height=32, width=32, num_images=1, latents=start, num_inference_steps=2)
    low = ours.generate(PROMPT, guidance_scale=1.5, **args).arrays
    high = ours.generate(PROMPT, guidance_scale=6.0, **args).arrays
    assert np.abs(high - low).max() > 1e-3
    want = run_reference(reference, start, 32, 32, num_inference_steps=2, guidance_scale=6.0)
    assert np.abs(high - want).max() < TOLERANCE


def test_defaults_tell_schnell_from_dev(flux):
    kind, _, ours, _ = flux
    assert (ours.family, ours.label) == ("flux", "FLUX.1")
    steps, guidance = (28, 3.5) if kind == "dev" else (4, 0.0)
    want = {"height": 1024, "width": 1024, "num_inference_steps": steps, "guidance_scale": guidance}
    assert ours.defaults == {**want, "scheduler": "flow_euler"}


def test_what_flux_does_not_take_is_refused_by_name(flux):
    _, _, ours, _ = flux
    with pytest.raises(InvalidRequest, match="clip_skip"):
        ours.generate(PROMPT, clip_skip=1, height=32, width=32, num_inference_steps=1)
    with pytest.raises(InvalidRequest, match="multiple of 4"):  # 2 pixels per latent, 2x2 latents per token
        ours.generate(PROMPT, height=34, width=32, num_inference_steps=1)


def test_mixed_requests_share_a_batch_and_get_their_own_pictures(flux):
    """dev's guidance is each slot's embedded scale: one batch for every scale and step count, nothing compiled anew."""
    kind, _, _, folder = flux
    if kind != "dev":
        pytest.skip("dev: the per-slot guidance embedding is what a batch could get wrong")
    engine = load_pipeline(folder, safety_checker=False, max_batch_size=4)
    mixed = [
        dict(seed=1, num_inference_steps=2, guidance_scale=3.5),
        dict(seed=2, num_inference_steps=4, guidance_scale=1.5, height=32, width=48),
        dict(seed=3, num_inference_steps=3, guidance_scale=6.0, prompt="a cat photo"),
    ]
    try:
        requests = [GenerationRequest(**{"prompt": PROMPT, "height": 32, "width": 32, **r}) for r in mixed]
        alone = [engine.submit(r).result(300).arrays for r in requests]
        compiled = engine.compile_count
        tickets = [engine.submit(r) for r in requests]  # all at once
        for ticket, want in zip(tickets, alone, strict=True):
            assert np.abs(ticket.result(300).arrays - want).max() <= 1 / 255
        assert engine.compile_count == compiled
    finally:
        engine.close()


def test_t5_on_the_host_draws_the_same_and_cannot_be_left_out(flux):
    kind, _, ours, folder = flux
    if kind != "schnell":
        pytest.skip("one folder is enough")
    start = latents(32, 32, n=1)
    args = dict(height=32, width=32, num_images=1, latents=start, num_inference_steps=2)
    host = load_pipeline(folder, safety_checker=False, t5="host")
    try:
        assert "text_encoder_2" not in host.params
        assert np.abs(host.generate(PROMPT, **args).arrays - ours.generate(PROMPT, **args).arrays).max() <= 1 / 255
    finally:
        host.close()
    with pytest.raises(ConfigError, match="needs its T5"):
        load_pipeline(folder, safety_checker=False, t5="off")
