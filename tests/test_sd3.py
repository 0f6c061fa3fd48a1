"""Stable Diffusion 3 and 3.5 end to end: our engine on tiny diffusers folders written with `save_pretrained`.

The same prompt, negative prompt and initial latents through diffusers' `StableDiffusion3Pipeline` and through
`load_pipeline(folder).generate`, in f32: pictures within 1/255. The folders: SD3 with its T5 encoder, the same
saved without T5 (zeros stand in, as diffusers does), and SD 3.5's transformer (RMS QK-norm, dual attention in
the first block). The two CLIP encoders differ in width, depth and activation, so a swapped encoder shows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from reference import CLIP_LAYOUTS, VAE_LAYOUT, randomize
from t5_reference import save_tiny_t5_tokenizer, tiny_t5_encoder
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer, T5TokenizerFast

from engine import GenerationRequest, InvalidRequest, load_pipeline
from engine.errors import ConfigError
from engine.families.sd3 import T5_TOKENS
from tools.tiny_tokenizer import write_tokenizer

WORDS = ["a", "red", "circle", "on", "blue", "background", "photo", "blurry", "cat"]
PROMPT, NEGATIVE = "a red circle on a blue background", "blurry photo"
SIZE = 32  # pixels: 16x16 latents with the factor-2 test VAE, 8x8 tokens of 2x2 patches
TOLERANCE = 1 / 255
JOINT = 96  # joint_attention_dim: T5's width; the CLIP widths (32 + 48) are padded up to it
TRANSFORMER = dict(
    sample_size=16,
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=4,
    joint_attention_dim=JOINT,
    caption_projection_dim=32,
    pooled_projection_dim=48,  # the two CLIP projections, 24 each
    pos_embed_max_size=16,
)
LAYOUTS = {
    "sd3": TRANSFORMER,
    "sd35": dict(TRANSFORMER, qk_norm="rms_norm", dual_attention_layers=(0,)),  # SD 3.5 medium's
}
# stabilityai/stable-diffusion-3.5-medium's VAE: 16 channels, no quant convolutions, a shift and a scale
VAE = dict(VAE_LAYOUT, latent_channels=16, use_quant_conv=False, use_post_quant_conv=False)
VAE_SCALING = dict(scaling_factor=1.5305, shift_factor=0.0609)


def build_reference(layout: str, tmp_path_factory, with_t5: bool = True) -> StableDiffusion3Pipeline:
    clip_dir, t5_dir = tmp_path_factory.mktemp("clip"), tmp_path_factory.mktemp("t5")
    vocab = write_tokenizer(clip_dir, WORDS)
    ids = dict(vocab_size=vocab, max_position_embeddings=77, bos_token_id=vocab - 2, eos_token_id=vocab - 1)
    first = CLIPTextConfig(**CLIP_LAYOUTS["sd1"], **ids, pad_token_id=vocab - 1, projection_dim=24)
    second = CLIPTextConfig(**CLIP_LAYOUTS["sd2"], **ids, pad_token_id=0, projection_dim=24)
    t5_vocab = save_tiny_t5_tokenizer(t5_dir)
    t5 = dict(d_model=JOINT, d_kv=8, num_heads=4, d_ff=64, num_layers=2, feed_forward_proj="gated-gelu")
    return StableDiffusion3Pipeline(
        transformer=randomize(SD3Transformer2DModel(**LAYOUTS[layout]), 3, std=0.05),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=randomize(AutoencoderKL(**VAE, **VAE_SCALING), 4, std=0.05),
        text_encoder=randomize(CLIPTextModelWithProjection(first), 1),
        tokenizer=CLIPTokenizer.from_pretrained(str(clip_dir)),
        text_encoder_2=randomize(CLIPTextModelWithProjection(second), 2),
        tokenizer_2=CLIPTokenizer.from_pretrained(str(clip_dir), pad_token="!"),  # id 0, as SD3's second
        text_encoder_3=tiny_t5_encoder(t5_vocab, 5, **t5) if with_t5 else None,
        tokenizer_3=T5TokenizerFast.from_pretrained(str(t5_dir)) if with_t5 else None,
    )


@pytest.fixture(scope="module", params=[("sd3", True), ("sd3", False), ("sd35", True)], ids=["sd3", "no-t5", "sd35"])
def sd3(request, tmp_path_factory):
    layout, with_t5 = request.param
    reference = build_reference(layout, tmp_path_factory, with_t5)
    folder = tmp_path_factory.mktemp(layout)
    reference.save_pretrained(folder)
    engine = load_pipeline(folder, safety_checker=False)
    yield reference, engine, folder, request.param
    engine.close()


def latents(n: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 16, SIZE // 2, SIZE // 2)).astype(np.float32)


def run_reference(reference, start, **kwargs) -> np.ndarray:
    with torch.no_grad():
        return reference(
            latents=torch.from_numpy(start),
            num_images_per_prompt=len(start),
            height=SIZE,
            width=SIZE,
            output_type="np",
            **kwargs,
        ).images


def run_ours(ours, start, **kwargs) -> np.ndarray:
    return ours.generate(height=SIZE, width=SIZE, num_images=len(start), latents=start, **kwargs).arrays


CASES = {
    "guided, negative, 2 steps": dict(negative_prompt=NEGATIVE, guidance_scale=7.0, num_inference_steps=2),
    "guided, 4 steps": dict(guidance_scale=4.5, num_inference_steps=4),
    "unguided, 3 steps": dict(guidance_scale=1.0, num_inference_steps=3),
}


@pytest.mark.parametrize("case", CASES)
def test_pictures_match_diffusers(sd3, case):
    reference, ours, *_ = sd3
    start = latents()
    want = run_reference(reference, start, prompt=PROMPT, **CASES[case])
    got = run_ours(ours, start, prompt=PROMPT, scheduler="flow_euler", **CASES[case])
    assert np.abs(got - want).max() < TOLERANCE
    assert want.std() > 0.02  # a picture, not a flat field that any mistake would still match


def test_a_prompt_past_t5s_256_tokens_says_what_was_dropped(sd3):
    """T5 reads the long prompt, cut at the pipeline's 256 tokens; the request's notes say what the cut dropped.
    Without T5 (left out), nothing reads past CLIP's 77 tokens, which the pipeline cuts silently too."""
    _, ours, _, (_, with_t5) = sd3
    long = "a red circle " + "on blue " * 150  # 300 words and more: past 256 T5 tokens
    request = GenerationRequest(prompt=long, height=SIZE, width=SIZE, guidance_scale=1.0)
    notes = ours.jobs.fit(ours.limits.resolve(request, ours.defaults, 1)).notes
    if with_t5:
        assert (
            len(notes) == 1 and notes[0].startswith(f"prompt truncated to {T5_TOKENS} T5 tokens") and "blue" in notes[0]
        )
    else:
        assert notes == ()


def test_defaults_follow_the_family(sd3):
    _, ours, *_ = sd3
    assert (ours.family, ours.label) == ("sd3", "Stable Diffusion 3")
    side = 16 * 2  # the transformer's sample_size times the VAE factor, as SD3's 128 * 8 = 1024
    want = {"height": side, "width": side, "num_inference_steps": 28, "guidance_scale": 7.0, "scheduler": "flow_euler"}
    assert ours.defaults == want
    assert ours.schedulers == ("flow_euler",)


def test_what_this_family_does_not_take_is_refused_by_name(sd3):
    _, ours, *_ = sd3
    with pytest.raises(InvalidRequest, match="scheduler"):
        ours.generate(PROMPT, scheduler="euler", height=SIZE, width=SIZE, num_inference_steps=1)
    with pytest.raises(InvalidRequest, match="multiple of 4"):  # 2 pixels per latent, 2 latents per token
        ours.generate(PROMPT, height=SIZE + 2, width=SIZE, num_inference_steps=1)


def test_a_lora_or_controlnet_is_refused_at_start(sd3, tmp_path):
    folder = sd3[2]
    with pytest.raises(ConfigError, match="LoRA"):
        load_pipeline(folder, safety_checker=False, loras={"style": str(tmp_path / "style.safetensors")})
    with pytest.raises(ConfigError, match="ControlNet"):
        load_pipeline(folder, safety_checker=False, controlnet=str(tmp_path))


MIXED = [
    dict(seed=1, num_inference_steps=2, guidance_scale=7.0),
    dict(seed=2, num_inference_steps=4, guidance_scale=3.0, negative_prompt=NEGATIVE),
    dict(seed=3, num_inference_steps=3, guidance_scale=5.5, prompt="a cat photo"),
]


def test_mixed_requests_share_a_batch_and_get_their_own_pictures(sd3):
    """Steps, guidance, seed and prompt per slot: one batch, the pictures each gets alone, nothing compiled anew."""
    if sd3[3] != ("sd35", True):
        pytest.skip("one folder is enough: the batch is the family's, not the layout's")
    engine = load_pipeline(sd3[2], safety_checker=False, max_batch_size=4)
    try:
        requests = [GenerationRequest(**{"prompt": PROMPT, "height": SIZE, "width": SIZE, **r}) for r in MIXED]
        alone = [engine.submit(r).result(300).arrays for r in requests]
        compiled = engine.compile_count
        tickets = [engine.submit(r) for r in requests]  # all at once
        for ticket, want in zip(tickets, alone, strict=True):
            assert np.abs(ticket.result(300).arrays - want).max() <= 1 / 255
        assert engine.compile_count == compiled
        assert np.abs(alone[0] - alone[1]).max() > 0.05
    finally:
        engine.close()


def test_t5_on_the_host_or_left_out(sd3):
    """`t5="host"`: T5's weights leave the devices and the pictures stay; `t5="off"`: diffusers without T5."""
    reference, ours, folder, param = sd3
    if param != ("sd3", True):
        pytest.skip("a folder with T5")
    start = latents()  # two pictures, guided: the programs the pictures above compiled draw the on-device one
    args = dict(prompt=PROMPT, negative_prompt=NEGATIVE, guidance_scale=5.0, num_inference_steps=2)
    on_device = run_ours(ours, start, scheduler="flow_euler", **args)
    host = load_pipeline(folder, safety_checker=False, t5="host")
    try:
        assert "text_encoder_3" not in host.params and "text_encoder_3" in ours.params
        assert np.abs(run_ours(host, start, **args) - on_device).max() <= 1 / 255
    finally:
        host.close()
    off = load_pipeline(folder, safety_checker=False, t5="off")
    try:
        without = StableDiffusion3Pipeline(**{**reference.components, "text_encoder_3": None, "tokenizer_3": None})
        want = run_reference(without, start, **args)
        got = run_ours(off, start, **args)
        assert np.abs(got - want).max() < TOLERANCE and np.abs(got - on_device).max() > 1e-3
    finally:
        off.close()
    with pytest.raises(ConfigError, match="t5 must be one of"):
        load_pipeline(folder, safety_checker=False, t5="cpu")
