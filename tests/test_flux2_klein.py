"""FLUX.2 [klein] end to end: our engine on tiny diffusers folders written with `save_pretrained`.

One tiny `Flux2KleinPipeline` (a 28-layer Qwen3 of width 16, since layers 9, 18 and 27 are read; a FLUX.2
transformer of 1 + 2 blocks; a FLUX.2 VAE with 4 latent channels and batch-norm statistics far from (0, 1)) saved
twice: as a distilled folder (model_index.json `is_distilled`) and as a base one, whose engine runs its text encoder
on the host. The same prompt and initial
latents (the pipeline's: 2x2 patches of the VAE's latents, [n, 16, h/4, w/4]) go through diffusers and through
`load_pipeline(folder).generate`, in f32: pictures within 1/255 on 0..1.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu
from preview_reference import assert_fitted_previews
from qwen_reference import QWEN3_LAYOUTS, save_tiny_qwen_tokenizer, tiny_qwen3
from reference import randomize
from transformers import AutoTokenizer

from engine import GenerationRequest, InvalidRequest, load_pipeline, schedulers
from engine.errors import ConfigError
from engine.families.base import PromptFit
from engine.families.flux2 import empirical_mu
from engine.schedulers import SchedulerConfig

PROMPT = "a red cat on a mat"
TOLERANCE = 1 / 255
LATENT_CHANNELS = 4  # 16 in 2x2 patches; the real VAE's 32 are 128
TRANSFORMER = dict(
    patch_size=1,
    in_channels=4 * LATENT_CHANNELS,
    num_layers=1,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=3 * QWEN3_LAYOUTS["klein"]["hidden_size"],  # layers 9, 18 and 27 side by side
    timestep_guidance_channels=32,
    axes_dims_rope=(4, 4, 4, 4),
    guidance_embeds=False,
)
VAE = dict(
    block_out_channels=(8, 16),  # one 2x downsampling: 2 pixels per latent, 4 per token
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    latent_channels=LATENT_CHANNELS,
    norm_num_groups=4,
    layers_per_block=1,
    sample_size=32,
)
# black-forest-labs/FLUX.2-klein-4B's scheduler_config.json
SCHEDULER = dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, time_shift_type="exponential")


@pytest.mark.parametrize(("tokens", "steps"), [(64, 4), (4096, 4), (4096, 50), (1024, 28), (6400, 4)])
def test_the_schedule_is_the_pipelines(tokens, steps):
    """linspace(1, 1/n, n) shifted by `compute_empirical_mu`, which reads the step count as well as the token count
    (past 4300 tokens, the token count alone)."""
    assert empirical_mu(tokens, steps) == pytest.approx(compute_empirical_mu(tokens, steps), rel=1e-12)
    reference = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
    reference.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=compute_empirical_mu(tokens, steps))
    config = SchedulerConfig.from_dict(dict(reference.config))
    ours = schedulers.tables(
        config, "flow_euler", steps, 50, uniform_sigmas=True, image_tokens=tokens, mu=empirical_mu(tokens, steps)
    )
    np.testing.assert_allclose(ours.timesteps[:steps], reference.timesteps.numpy(), rtol=1e-6)
    np.testing.assert_allclose(ours.coefficients["sigmas"][: steps + 1], reference.sigmas.numpy(), rtol=1e-6)


def build_reference(folder) -> Flux2KleinPipeline:
    vocab = save_tiny_qwen_tokenizer(folder / "tokenizer")
    vae = randomize(AutoencoderKLFlux2(**VAE), 4, std=0.05)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # statistics far from (0, 1): a normalisation left out or inverted shows in the picture
        vae.bn.running_mean.copy_(0.3 * torch.randn(4 * LATENT_CHANNELS, generator=gen))
        vae.bn.running_var.copy_(0.5 + torch.rand(4 * LATENT_CHANNELS, generator=gen))
    return Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=vae,
        text_encoder=tiny_qwen3(vocab, 5, causal_lm=True, **QWEN3_LAYOUTS["klein"]),
        tokenizer=AutoTokenizer.from_pretrained(str(folder / "tokenizer")),
        # weights wide enough that the prompt, and so guidance, change the picture
        transformer=randomize(Flux2Transformer2DModel(**TRANSFORMER), 3, std=0.15),
        is_distilled=True,
    )


@pytest.fixture(scope="module")
def klein(tmp_path_factory):
    """The reference pipeline, our engine on its distilled and its base folder, and the folders."""
    reference = build_reference(tmp_path_factory.mktemp("parts"))
    folders = {}
    for kind, distilled in (("distilled", True), ("base", False)):
        reference.register_to_config(is_distilled=distilled)
        folders[kind] = tmp_path_factory.mktemp(kind)
        reference.save_pretrained(folders[kind])
    engines = {
        "distilled": load_pipeline(folders["distilled"], safety_checker=False, max_batch_size=4, preview_every_s=0.0),
        # Qwen3 on the host's CPU (its first 27 layers, from the causal LM's checkpoint), its layers sent with each
        # request: the base model's pictures prove that path too
        "base": load_pipeline(folders["base"], safety_checker=False, t5="host"),
    }
    yield reference, engines, folders
    for engine in engines.values():
        engine.close()


def latents(height: int, width: int, n: int = 1, seed: int = 0) -> np.ndarray:
    """Initial latents [n, 16, h/4, w/4]: the test VAE's factor is 2, and a token is a 2x2 patch of its latents."""
    shape = (n, 4 * LATENT_CHANNELS, height // 4, width // 4)
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def run_reference(reference, start: np.ndarray, height: int, width: int, distilled: bool, **kwargs) -> np.ndarray:
    """diffusers' picture from the same latents."""
    reference.register_to_config(is_distilled=distilled)
    with torch.no_grad():
        out = reference(
            prompt=PROMPT, latents=torch.from_numpy(start), height=height, width=width, output_type="np", **kwargs
        )
    return out.images


@pytest.mark.parametrize(("height", "width", "steps"), [(32, 32, 4), (32, 48, 2)])
def test_distilled_pictures_match_diffusers(klein, height, width, steps):
    reference, engines, _ = klein
    start = latents(height, width, n=2)
    want = run_reference(reference, start, height, width, True, num_inference_steps=steps, guidance_scale=1.0)
    got = (
        engines["distilled"]
        .generate(PROMPT, height=height, width=width, num_images=2, latents=start, num_inference_steps=steps)
        .arrays
    )
    assert np.abs(got - want).max() < TOLERANCE
    assert want.std() > 0.02  # a picture, not a flat field that any mistake would still match


def test_base_pictures_match_diffusers_with_guidance(klein):
    """The base model's unconditional row reads the empty prompt, as the pipeline's does, at the request's scale;
    its text encoder runs on the host."""
    reference, engines, _ = klein
    assert "text_encoder" not in engines["base"].params and "text_encoder" in engines["distilled"].params
    start = latents(32, 32)
    want = run_reference(reference, start, 32, 32, False, num_inference_steps=3, guidance_scale=4.0)
    args = dict(height=32, width=32, num_images=1, latents=start, num_inference_steps=3)
    got = engines["base"].generate(PROMPT, guidance_scale=4.0, **args).arrays
    assert np.abs(got - want).max() < TOLERANCE
    unguided = engines["distilled"].generate(PROMPT, **args).arrays  # the same weights, no unconditional row
    assert np.abs(unguided - got).max() > 0.05


def test_a_distilled_model_takes_no_guidance(klein):
    """As the pipeline, which ignores the scale of a step-distilled model: no unconditional row, the same picture."""
    _, engines, _ = klein
    args = dict(height=32, width=32, num_images=1, latents=latents(32, 32), num_inference_steps=2)
    plain = engines["distilled"].generate(PROMPT, guidance_scale=1.0, **args).arrays
    scaled = engines["distilled"].generate(PROMPT, guidance_scale=4.0, **args).arrays
    assert np.array_equal(plain, scaled)


def test_defaults_tell_distilled_from_base(klein):
    _, engines, _ = klein
    for kind, (steps, guidance) in {"distilled": (4, 1.0), "base": (50, 4.0)}.items():
        engine = engines[kind]
        assert engine.family == "flux2"
        assert (engine.defaults["num_inference_steps"], engine.defaults["guidance_scale"]) == (steps, guidance)


def test_a_prompt_cut_at_512_tokens_says_what_was_dropped(klein):
    """Klein reads its padding, so every prompt is padded to the pipeline's 512 tokens (no shorter length); a prompt
    past them is cut, and the request's notes say what the cut dropped, the negative prompt's only where read."""
    engine, long = klein[1]["base"], "a red circle, " + "0123456789" * 60  # each digit a token

    def fit(**fields):
        request = GenerationRequest(**{"prompt": "a red circle", "height": 32, "width": 32, **fields})
        return engine.jobs.fit(engine.limits.resolve(request, engine.defaults, 1))

    assert fit() == PromptFit(length=0, notes=())
    cut = fit(prompt=long).notes
    assert len(cut) == 1 and cut[0].startswith("prompt truncated to 512 Qwen tokens") and "0123456789" in cut[0]
    assert fit(negative_prompt=long, guidance_scale=4.0).notes[0].startswith("negative prompt truncated")
    assert fit(negative_prompt=long, guidance_scale=1.0).notes == ()  # unguided: the negative prompt is not read


def test_mixed_requests_share_a_batch_and_get_their_own_pictures(klein):
    """Sizes, prompts and step counts of one model: each picture as drawn alone, and nothing compiled anew."""
    _, engines, _ = klein
    engine = engines["distilled"]
    mixed = [
        dict(seed=1, num_inference_steps=2),
        dict(seed=2, num_inference_steps=4, height=32, width=48),
        dict(seed=3, num_inference_steps=3, prompt="a blue bird flying over the river at sunset"),
    ]
    requests = [GenerationRequest(**{"prompt": PROMPT, "height": 32, "width": 32, **r}) for r in mixed]
    alone = [engine.submit(r).result(300).arrays for r in requests]
    compiled = engine.compile_count
    tickets = [engine.submit(r) for r in requests]  # all at once
    for ticket, want in zip(tickets, alone, strict=True):
        assert np.abs(ticket.result(300).arrays - want).max() <= 1 / 255
    assert engine.compile_count == compiled


def test_a_text_encoder_of_another_width_is_refused_by_name(klein, tmp_path_factory):
    folder = tmp_path_factory.mktemp("wide")
    shutil.copytree(klein[2]["distilled"], folder, dirs_exist_ok=True)
    config = folder / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "joint_attention_dim": 40}))
    with pytest.raises(ConfigError, match=r"not a consistent FLUX.2 \[klein\] model: 3 of the text encoder's layers"):
        load_pipeline(folder, safety_checker=False)


def test_what_klein_does_not_take_is_refused_by_name(klein):
    _, engines, _ = klein
    with pytest.raises(InvalidRequest, match="clip_skip"):
        engines["distilled"].generate(PROMPT, clip_skip=1, height=32, width=32, num_inference_steps=1)
    with pytest.raises(InvalidRequest, match="multiple of 4"):  # 2 pixels per latent, 2x2 latents per token
        engines["distilled"].generate(PROMPT, height=34, width=32, num_inference_steps=1)


def test_previews_are_the_fitted_map_of_the_normalised_grid(klein):
    """The map reads the steps' own latents, the normalised grid of 2x2 patches (16 channels here, the real VAE's 128),
    fitted to pictures the VAE decodes from it (denormalised, unpatchified): each preview diffusers' step latents
    through it (tests/preview_reference.py)."""
    reference, engines, _ = klein
    reference.register_to_config(is_distilled=True)
    assert_fitted_previews("klein", reference, engines["distilled"])
