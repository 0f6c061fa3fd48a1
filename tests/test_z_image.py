"""Z-Image end to end: our engine on a tiny diffusers folder written with `save_pretrained`.

The same prompt and initial latents through diffusers' `ZImagePipeline` (and its Img2Img and Inpaint pipelines,
made deterministic as tests/test_serving_flow_families.py makes FLUX.1's: the VAE's mean, our noise) and through
`load_pipeline(folder).generate`, in f32: pictures within 1/255 (they differ by about 1e-6). The tiny
text encoder is a random `Qwen3Model` with a byte-level BPE tokenizer made offline (tests/qwen_reference.py); the
transformer is diffusers' own test layout but for its caption width (the encoder's) and its frame positions (the
engine pads every caption to the pipeline's 512 tokens). The scheduler is Z-Image-Turbo's (a static shift of 3).

Guidance: the pipeline's `pos + g * (pos - neg)` is the engine's scale g + 1, so diffusers' g = 4 is our 5.
"""

from __future__ import annotations

import contextlib
import json
from unittest import mock

import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    ZImageImg2ImgPipeline,
    ZImageInpaintPipeline,
    ZImagePipeline,
    ZImageTransformer2DModel,
)
from fastapi.testclient import TestClient
from preview_reference import assert_fitted_previews
from qwen_reference import QWEN3_LAYOUTS, save_tiny_qwen_tokenizer, tiny_qwen3
from reference import VAE_LAYOUT, randomize
from test_image_modes import mask, picture
from transformers import AutoTokenizer

import web
from engine import GenerationRequest, load_pipeline
from engine.errors import ConfigError
from engine.families import qwen_prompt, z_image
from engine.loading.sources import resolve
from tests._api_server import b64png, decode_png, max_pixel_difference

PROMPT, NEGATIVE = "a red circle on a blue background", "blurry photo"
TOLERANCE = 1 / 255
LATENT_CHANNELS = 16
TRANSFORMER = dict(  # diffusers' tests/pipelines/z_image/test_z_image.py, but for cap_feat_dim and axes_lens
    all_patch_size=(2,),
    all_f_patch_size=(1,),
    in_channels=LATENT_CHANNELS,
    dim=32,
    n_layers=2,
    n_refiner_layers=1,
    n_heads=2,
    n_kv_heads=2,
    norm_eps=1e-5,
    qk_norm=True,
    cap_feat_dim=QWEN3_LAYOUTS["zimage"]["hidden_size"],
    rope_theta=256.0,
    t_scale=1000.0,
    axes_dims=(8, 4, 4),
    axes_lens=(1024, 32, 32),  # frame positions past the 512 caption tokens the engine pads to
)
FLOW = dict(num_train_timesteps=1000, use_dynamic_shifting=False)
TURBO_SCHEDULER = dict(FLOW, shift=3.0)  # Tongyi-MAI/Z-Image-Turbo's scheduler_config.json
BASE_SCHEDULER = dict(FLOW, shift=6.0)  # Tongyi-MAI/Z-Image's
VAE = dict(VAE_LAYOUT, latent_channels=LATENT_CHANNELS, use_quant_conv=False, use_post_quant_conv=False)


def build_reference(tmp_path_factory, scheduler: dict = TURBO_SCHEDULER) -> ZImagePipeline:
    tokenizer = tmp_path_factory.mktemp("qwen-tokenizer")
    vocab = save_tiny_qwen_tokenizer(tokenizer)
    return ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**scheduler),
        vae=randomize(AutoencoderKL(**VAE, scaling_factor=0.3611, shift_factor=0.1159), 4, std=0.05),
        text_encoder=tiny_qwen3(vocab, 1, **QWEN3_LAYOUTS["zimage"]),
        tokenizer=AutoTokenizer.from_pretrained(str(tokenizer)),
        transformer=randomize(ZImageTransformer2DModel(**TRANSFORMER), 3, std=0.05),
    )


@pytest.fixture(scope="module")
def zimage(tmp_path_factory):
    """diffusers' pipeline, our engine on the folder it writes (two slots, a preview after every step), and the
    folder."""
    reference = build_reference(tmp_path_factory)
    folder = tmp_path_factory.mktemp("z-image")  # no "turbo" in the name: the scheduler tells
    reference.save_pretrained(folder)
    engine = load_pipeline(folder, safety_checker=False, max_batch_size=2, preview_every_s=0.0)
    yield reference, engine, folder
    engine.close()


def latents(height: int, width: int, n: int = 2, seed: int = 0) -> np.ndarray:
    shape = (n, LATENT_CHANNELS, height // 2, width // 2)  # the test VAE's factor is 2
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def run_reference(reference, start: np.ndarray, height: int, width: int, **kwargs) -> np.ndarray:
    """diffusers from our NCHW noise: as `latents` for text-to-image; for its image modes, as the noise its
    `prepare_latents` draws, with the VAE's mean for `retrieve_latents`."""
    module = type(reference).__module__
    given = lambda shape, **_: torch.from_numpy(start).reshape(shape)  # noqa: E731
    mean = lambda out, generator=None, sample_mode="sample": out.latent_dist.mode()  # noqa: E731
    with contextlib.ExitStack() as stack, torch.no_grad():
        if isinstance(reference, ZImagePipeline):
            kwargs["latents"] = torch.from_numpy(start)
        else:
            stack.enter_context(mock.patch(f"{module}.retrieve_latents", side_effect=mean))
            stack.enter_context(mock.patch(f"{module}.randn_tensor", side_effect=given))
        return reference(
            num_images_per_prompt=len(start), height=height, width=width, output_type="np", **kwargs
        ).images


@pytest.mark.parametrize(
    ("height", "width", "steps", "guidance"),
    [(32, 32, 2, 0.0), (32, 48, 3, 4.0)],  # Turbo's way (no guidance), and the base model's (a negative prompt)
)
def test_pictures_match_diffusers(zimage, height, width, steps, guidance):
    reference, ours, _ = zimage
    start = latents(height, width)
    negative = NEGATIVE if guidance else None
    args = dict(height=height, width=width, num_inference_steps=steps, negative_prompt=negative)
    want = run_reference(reference, start, prompt=PROMPT, guidance_scale=guidance, **args)
    got = ours.generate(PROMPT, num_images=2, latents=start, guidance_scale=guidance + 1, **args).arrays
    assert want.std() > 0.02  # a picture, not a flat field that any mistake would still match
    assert np.abs(got - want).max() < TOLERANCE


def test_a_prompt_past_512_tokens_is_cut_where_the_pipeline_cuts_it(zimage):
    """The chat template's text is cut at 512 tokens, its closing tags included, as the pipeline's tokenizer call
    (truncation=True) cuts it; the words past the cut change nothing."""
    reference, ours, _ = zimage
    long = PROMPT + ", " + "0123456789" * 60  # each digit a token: over 600 in 636 characters (the limit is 2000)
    start = latents(32, 32)
    args = dict(height=32, width=32, num_inference_steps=2)
    want = run_reference(reference, start, prompt=long, guidance_scale=0.0, **args)
    drawn = ours.generate(long, num_images=2, latents=start, guidance_scale=0.0, **args)
    got = drawn.arrays
    assert np.abs(got - want).max() < TOLERANCE
    assert [w for w in drawn.warnings if "truncated to 512 Qwen tokens" in w and "0123456789" in w]  # it says so
    longer = ours.generate(long + " and a green cat", num_images=2, latents=start, guidance_scale=0.0, **args)
    assert np.abs(longer.arrays - got).max() == 0


def test_a_prompt_is_padded_to_the_shortest_length_holding_it_and_a_guided_negative_prompt(zimage):
    """128 tokens for a short prompt (the text encoder and each step's caption tokens run over a quarter of the
    512), 256 or 512 for longer ones, and a negative prompt counts where guidance reads it; past 512 the prompt is
    cut (the test above), so 512 is the longest."""
    _, engine, _ = zimage

    def padded(prompt: str, **fields) -> int:
        request = GenerationRequest(prompt=prompt, height=32, width=32, **fields)
        return engine.plan(engine.limits.resolve(request, engine.defaults, 1)).text_tokens

    digits = "0123456789" * 20  # each digit a token: 200 of them
    assert padded(PROMPT) == 128
    assert padded(PROMPT + ", " + digits) == 256
    assert padded(PROMPT + ", " + digits * 3) == 512  # 600 digits: cut at 512
    assert padded(PROMPT, negative_prompt=digits, guidance_scale=4.0) == 256
    assert padded(PROMPT, negative_prompt=digits, guidance_scale=1.0) == 128  # unguided: the negative is not read


def test_the_folder_s_tokenizer_is_read_once_for_a_prompt_s_ids_and_its_fit(zimage, monkeypatch):
    """The prompt's ids (the family's extra inputs) and its padded length (`TextSide.fit_prompts`) read one
    tokenizer of the folder, so a load reads tokenizer.json once, and both see the same tokens."""
    _, _, folder = zimage
    reads = []

    class Counted(qwen_prompt.QwenTokenizer):
        def __init__(self, where):
            reads.append(where)
            super().__init__(where)

    monkeypatch.setattr(qwen_prompt, "QwenTokenizer", Counted)
    model_folder = resolve(folder)
    ids = z_image.extra_inputs(model_folder.index, 8, model_folder, None)
    fit = z_image.FAMILY.text.fit_prompts(model_folder)
    assert len(reads) == 1
    assert fit.args[0] is ids.keywords["tokenizer"]
    assert fit(PROMPT, None).length == 128


def test_mixed_requests_share_a_batch_and_get_their_own_pictures(zimage):
    """Two sizes, prompts of different lengths, step counts and guidance scales, in the two plans
    test_pictures_match_diffusers compiled: each request's picture is the one it draws alone, and nothing is compiled anew, because a caption's
    length within the 128 tokens every one of these prompts is padded to is data."""
    _, engine, _ = zimage
    wide = dict(height=32, width=48, guidance_scale=3.0)
    mixed = [
        dict(seed=1, num_inference_steps=2),
        dict(seed=1, num_inference_steps=2, prompt="a photo of a cat sitting on a red mat under the big old tree"),
        dict(seed=2, num_inference_steps=3, prompt="a bird"),
        dict(seed=3, num_inference_steps=3, prompt="a cat", **wide),
        dict(seed=4, num_inference_steps=2, **{**wide, "guidance_scale": 6.0}, negative_prompt=NEGATIVE),
    ]
    requests = [GenerationRequest(**{"prompt": PROMPT, "height": 32, "width": 32, **r}) for r in mixed]
    alone = [engine.submit(r).result(300).arrays for r in requests]
    compiled = engine.compile_count
    tickets = [engine.submit(r) for r in requests]  # all at once
    for ticket, want in zip(tickets, alone, strict=True):
        assert np.abs(ticket.result(300).arrays - want).max() <= TOLERANCE
    assert engine.compile_count == compiled
    assert np.abs(alone[0] - alone[1]).max() > 1e-2  # the same noise and steps: the prompt is read


def test_img2img_matches_diffusers(zimage):
    """`ZImageImg2ImgPipeline` at its default strength 0.6 and at 0.9: the picture's latents (shifted, scaled)
    noised to the first step's sigma, then the same steps."""
    base, ours, _ = zimage
    reference = ZImageImg2ImgPipeline(**base.components)
    args = dict(prompt=PROMPT, image=picture(32), num_inference_steps=5, height=32, width=32)
    for k, strength in enumerate((0.6, 0.9)):
        start = latents(32, 32, seed=10 + k)
        want = run_reference(reference, start, strength=strength, guidance_scale=0.0, **args)
        got = ours.generate(num_images=2, latents=start, strength=strength, guidance_scale=0.0, **args).arrays
        assert want.std() > 0.02
        assert np.abs(got - want).max() < TOLERANCE
    assert ours.generate(**{**args, "num_inference_steps": 2}).request.strength == 0.6  # the pipeline's default


def test_inpainting_matches_diffusers(zimage):
    """`ZImageInpaintPipeline` at its default strength 1 and at 0.6: the kept part blended back after each step."""
    base, ours, _ = zimage
    reference = ZImageInpaintPipeline(**base.components)
    args = dict(prompt=PROMPT, image=picture(32), mask_image=mask(32), num_inference_steps=4, height=32, width=32)
    for strength in (1.0, 0.6):
        start = latents(32, 32, seed=20)
        want = run_reference(reference, start, strength=strength, guidance_scale=0.0, **args)
        got = ours.generate(num_images=2, latents=start, strength=strength, guidance_scale=0.0, **args).arrays
        assert want.std() > 0.02
        assert np.abs(got - want).max() < TOLERANCE


def test_the_text_encoder_on_the_host_draws_the_same(zimage):
    """`t5="host"` keeps Qwen3 in host memory and runs it once per prompt there (the layers read only): the same
    pictures, no text encoder among the device's params; and it cannot be left out."""
    _, ours, folder = zimage
    start = latents(32, 32)  # two pictures, the batch the tests above draw: the engine's own runs on their programs
    args = dict(height=32, width=32, num_images=2, latents=start, num_inference_steps=2, guidance_scale=0.0)
    host = load_pipeline(folder, safety_checker=False, t5="host")
    try:
        assert "text_encoder" not in host.params
        assert np.abs(host.generate(PROMPT, **args).arrays - ours.generate(PROMPT, **args).arrays).max() <= TOLERANCE
    finally:
        host.close()
    with pytest.raises(ConfigError, match="needs its"):
        load_pipeline(folder, safety_checker=False, t5="off")


def test_defaults_tell_turbo_from_the_base_model(zimage, tmp_path_factory):
    """The folders differ only in the scheduler's shift (and neither is named Turbo here): Turbo's 3 gives 9 steps
    without guidance, the base model's 6 gives 50 steps at the pipeline's guidance 4 (our 5)."""
    _, turbo, folder = zimage
    assert (turbo.family, turbo.label) == ("z-image", "Z-Image Turbo")
    assert turbo.defaults == {
        "height": 1024, "width": 1024, "num_inference_steps": 9, "guidance_scale": 0.0, "scheduler": "flow_euler"
    }  # fmt: skip
    base = tmp_path_factory.mktemp("z-image-base")
    build_reference(tmp_path_factory, BASE_SCHEDULER).save_pretrained(base)
    engine = load_pipeline(base, safety_checker=False)
    try:
        assert (engine.defaults["num_inference_steps"], engine.defaults["guidance_scale"]) == (50, 5.0)
        assert engine.label == "Z-Image"
    finally:
        engine.close()


def test_a_text_encoder_of_another_width_is_refused(zimage, tmp_path_factory):
    _, _, folder = zimage
    config = json.loads((folder / "transformer" / "config.json").read_text())
    broken = tmp_path_factory.mktemp("z-image-broken")
    for part in folder.iterdir():
        (broken / part.name).symlink_to(part)
    (broken / "transformer").unlink()
    (broken / "transformer").mkdir()
    (broken / "transformer" / "config.json").write_text(json.dumps({**config, "cap_feat_dim": 48}))
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    (broken / "transformer" / weights.name).symlink_to(weights)
    with pytest.raises(ConfigError, match="cap_feat_dim 48"):
        load_pipeline(broken, safety_checker=False)


def test_the_doors_draw_the_engines_pictures(zimage):
    """AUTOMATIC1111's txt2img and img2img and OpenAI's generations over a Z-Image engine: each door's picture is
    the engine's own for the values it was sent (Turbo's way, CFG scale 1: no unconditional row)."""
    _, ours, _ = zimage
    fields = dict(prompt=PROMPT, width=32, height=32, scheduler="flow_euler", guidance_scale=1.0)
    drawn = lambda **values: ours.submit(GenerationRequest(**{**fields, **values})).result(300).images[0]  # noqa: E731
    body = dict(prompt=PROMPT, seed=5, steps=2, cfg_scale=1.0, width=32, height=32, sampler_name="Euler")
    with TestClient(web.build_app(ours)) as client:
        answer = client.post("/sdapi/v1/txt2img", json=body)
        assert answer.status_code == 200, answer.text
        want = drawn(seed=5, num_inference_steps=2)
        assert max_pixel_difference(decode_png(answer.json()["images"][0]), want) == 0

        start = picture(32)
        image2image = {**body, "init_images": [b64png(start)], "denoising_strength": 0.6, "steps": 5}
        answer = client.post("/sdapi/v1/img2img", json=image2image)
        assert answer.status_code == 200, answer.text
        want = drawn(seed=5, num_inference_steps=5, image=start, strength=0.6)
        assert max_pixel_difference(decode_png(answer.json()["images"][0]), want) == 0

        openai = dict(prompt=PROMPT, size="32x32", seed=7, num_inference_steps=2, guidance_scale=1.0)
        answer = client.post("/v1/images/generations", json=openai)
        assert answer.status_code == 200, answer.text
        want = drawn(seed=7, num_inference_steps=2)
        assert max_pixel_difference(decode_png(answer.json()["data"][0]["b64_json"]), want) == 0


def test_previews_are_the_fitted_map_of_the_steps_latents(zimage):
    """With FLUX.1's VAE, as FLUX.1's previews (tests/preview_reference.py)."""
    reference, ours, _ = zimage
    assert_fitted_previews("zimage", reference, ours)
