"""Any VAE in place of the model's own (`load_pipeline(folder, vae=...)`) draws what diffusers draws after
`pipe.vae = AutoencoderTiny.from_pretrained(...)` (or another `AutoencoderKL`), from the same latents.

A tiny random SD 1.x folder (tests/tiny_pipeline.py) and tiny random VAEs written with `save_pretrained`: a
TAESD (`AutoencoderTiny`) and a KL VAE of other widths and another `scaling_factor`, saved as a pipeline
folder's `vae/`. Text to image and image to image within 1/255 of diffusers in f32; with the tiny VAE, the
live previews are its decoded pictures of each step's latents, as diffusers' decode of the latents its
step callback sees. A VAE whose latents are not the UNet's is refused at load, by name.
"""

from __future__ import annotations

import contextlib
import json
from unittest import mock

import numpy as np
import pytest
import tiny_pipeline
import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderTiny,
    DDIMScheduler,
    EulerDiscreteScheduler,
    StableDiffusionImg2ImgPipeline,
    StableDiffusionPipeline,
)
from reference import randomize
from test_autoencoder_tiny import TINY_LAYOUTS
from test_image_modes import picture

from engine import GenerationRequest, Preview, Progress, SourceError, load_pipeline
from engine.loading.vae import load_vae
from engine.sampling.preview import DecodedPreview

SIZE = 64  # factor-8 VAEs: 8x8 latents
TOLERANCE = 1 / 255
PROMPT, NEGATIVE = "a red circle on a blue background", "blurry photo"
TORCH_SCHEDULERS = {"ddim": DDIMScheduler, "euler": EulerDiscreteScheduler}
IMG2IMG_MODULE = "diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img"
# Another factor-8 KL VAE: other widths than the folder's own, and SDXL's scaling factor, which the swap must read.
OTHER_KL = dict(tiny_pipeline.VAE_FACTOR8, block_out_channels=(8, 8, 16, 16), scaling_factor=0.13025)


def save_tiny(folder, **changes):
    vae = randomize(AutoencoderTiny(**{**TINY_LAYOUTS["taesd"], **changes}), 11)
    vae.save_pretrained(folder)
    return folder


def save_kl(folder, **changes):
    """A KL VAE in a pipeline folder's `vae/`, as a pipeline's `save_pretrained` leaves it."""
    vae = randomize(AutoencoderKL(**{**OTHER_KL, **changes}), 12, std=0.05)
    vae.save_pretrained(folder / "vae")
    return folder


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny SD 1.x folder and diffusers' pipeline read back from it."""
    folder = tmp_path_factory.mktemp("sd1")
    return folder, tiny_pipeline.write("sd1", folder)


@pytest.fixture(scope="module")
def swapped(model, tmp_path_factory):
    """Per VAE kind: diffusers' pipeline with that VAE (read back from its folder) and our engine given the folder."""
    folder, base = model
    cache = {}

    def get(kind: str):
        if kind not in cache:
            if kind == "tiny":
                where = save_tiny(tmp_path_factory.mktemp("taesd"))
                vae = AutoencoderTiny.from_pretrained(where)
            else:
                where = save_kl(tmp_path_factory.mktemp("other-kl"))
                vae = AutoencoderKL.from_pretrained(where, subfolder="vae")
            reference = StableDiffusionPipeline(**base.components)
            reference.vae = vae  # as the issue does: the pipeline's own VAE replaced
            ours = load_pipeline(folder, vae=str(where), previews=kind == "tiny", preview_every_s=0.0)
            cache[kind] = reference, ours, str(where)
        return cache[kind]

    yield get
    for _, ours, _ in cache.values():
        ours.close()


def start(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 4, SIZE // 8, SIZE // 8)).astype(np.float32)


def reference_images(reference, scheduler: str, **kwargs) -> np.ndarray:
    reference.scheduler = TORCH_SCHEDULERS[scheduler].from_config(reference.scheduler.config)
    with torch.no_grad():
        return reference(output_type="np", **kwargs).images


# Each VAE once, with a scheduler of its own: the scheduler steps the latents before any VAE sees them and the decode
# is the same program whichever stepped them (TAESD with Euler proved nothing TAESD with DDIM and the KL with Euler
# do not, and compiled a plan of its own).
@pytest.mark.parametrize("kind, scheduler", [("tiny", "ddim"), ("kl", "euler")])
def test_text_to_image_with_another_vae_matches_diffusers(kind, scheduler, swapped):
    reference, ours, where = swapped(kind)
    latents = start(2)
    args = dict(prompt=PROMPT, negative_prompt=NEGATIVE, num_inference_steps=4, guidance_scale=6.0)
    want = reference_images(
        reference,
        scheduler,
        latents=torch.from_numpy(latents),
        num_images_per_prompt=2,
        height=SIZE,
        width=SIZE,
        **args,
    )
    got = ours.generate(num_images=2, scheduler=scheduler, latents=latents, height=SIZE, width=SIZE, **args).arrays
    assert got.shape == want.shape
    assert got.std() > 0.01  # a picture, not a constant that would match trivially
    assert np.abs(got - want).max() < TOLERANCE
    assert ours.vae_name == ours.model.vae == where


@pytest.mark.parametrize("kind", ["tiny", "kl"])
def test_image_to_image_with_another_vae_matches_diffusers(kind, swapped):
    """diffusers' img2img with the swapped VAE, its encoding made deterministic as ours: the KL posterior's mean
    (TAESD's encoder is deterministic already), and its noise the `latents=` we pass."""
    txt2img, ours, _ = swapped(kind)
    reference = StableDiffusionImg2ImgPipeline(**txt2img.components)  # the swapped VAE among them
    noise = start(2, seed=1)
    args = dict(prompt=PROMPT, negative_prompt=NEGATIVE, num_inference_steps=4, guidance_scale=6.0, strength=0.6)
    args.update(image=picture(SIZE))

    def latents_of(out, generator=None, sample_mode="sample"):
        return out.latents if hasattr(out, "latents") else out.latent_dist.mode()

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch(f"{IMG2IMG_MODULE}.retrieve_latents", side_effect=latents_of))
        given = lambda shape, **_: torch.from_numpy(noise).reshape(shape)  # noqa: E731
        stack.enter_context(mock.patch(f"{IMG2IMG_MODULE}.randn_tensor", side_effect=given))
        want = reference_images(reference, "euler", num_images_per_prompt=2, **args)
    got = ours.generate(num_images=2, scheduler="euler", latents=noise, **args).arrays
    assert got.shape == want.shape and got.std() > 0.01
    assert np.abs(got - want).max() < TOLERANCE


def test_previews_with_a_tiny_vae_are_its_decoded_pictures(swapped):
    """Each step's preview is the tiny VAE's full-size picture of that step's latents: diffusers' decode of the
    latents its step callback sees, to the rounding of a byte."""
    reference, ours, _ = swapped("tiny")
    assert isinstance(ours.preview, DecodedPreview)
    steps, latents = 4, start(1, seed=2)
    args = dict(negative_prompt=NEGATIVE, num_inference_steps=steps, guidance_scale=6.0)
    decoded = {}

    def callback(pipe, i, t, kwargs):
        with torch.no_grad():
            image = pipe.vae.decode(kwargs["latents"] / pipe.vae.config.scaling_factor).sample
        decoded[i + 1] = pipe.image_processor.postprocess(image, output_type="np")[0]
        return {}

    reference_images(
        reference,
        "ddim",
        prompt=PROMPT,
        latents=torch.from_numpy(latents),
        height=SIZE,
        width=SIZE,
        callback_on_step_end=callback,
        **args,
    )
    request = GenerationRequest(
        PROMPT, scheduler="ddim", latents=latents, height=SIZE, width=SIZE, num_images=1, **args
    )
    previews, step = {}, 0
    for event in ours.submit(request).events(timeout=300):
        if isinstance(event, Progress):
            step = event.step
        elif isinstance(event, Preview):
            previews[step] = event.images[0]
    assert sorted(previews) == list(range(1, steps))  # after every step but the last, which is the picture
    for i, got in previews.items():
        want = np.round(decoded[i] * 255)
        assert got.shape == (SIZE, SIZE, 3) and got.dtype == np.uint8  # full size, not latent size
        assert np.abs(got.astype(np.float32) - want).max() <= 1, f"step {i}"
    assert np.abs(previews[1].astype(np.float32) - previews[steps - 1]).max() > 8  # the picture changes


def wrong_channels(folder):
    return save_tiny(folder, latent_channels=16)  # a TAESD for SD3/FLUX.1


def wrong_factor(folder):
    kl = dict(block_out_channels=(8, 16, 16), down_block_types=("DownEncoderBlock2D",) * 3)
    return save_kl(folder, **kl, up_block_types=("UpDecoderBlock2D",) * 3)  # 4 pixels per latent


def wrong_class(folder):
    save_tiny(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "_class_name": "VQModel"}))
    return folder


def no_config(folder):
    (folder / "weights").mkdir()
    return folder / "weights"


@pytest.mark.parametrize(
    "make, message",
    [
        (wrong_channels, r"does not fit the model .*: its latent_channels is 16, the model's UNet draws 4"),
        (wrong_factor, r"its vae_scale_factor is 4 \(pixels per latent along a side\), the model's own VAE's is 8"),
        (wrong_class, r"a VAE of class 'VQModel' is not supported \(supported: AutoencoderKL, AutoencoderTiny\)"),
        (no_config, r"no config.json, so this is not a diffusers-format VAE folder"),
    ],
)
def test_a_vae_that_does_not_fit_is_refused_by_name(make, message, model, tmp_path):
    folder, _ = model
    with pytest.raises(SourceError, match=message):
        load_pipeline(folder, vae=str(make(tmp_path)), previews=False)


@pytest.mark.parametrize("layout", ["vae repo", "pipeline repo", "offline"])
def test_a_hub_vae_fetches_only_its_config_and_weights(layout, monkeypatch, tmp_path):
    """A Hub id: madebyollin/taesd's layout (the VAE at the top, beside files we never read), or a pipeline
    repository's `vae/`; offline, whatever the local cache holds."""
    import huggingface_hub

    inner = "vae/" if layout == "pipeline repo" else ""
    save_kl(tmp_path) if inner else save_tiny(tmp_path)  # what the download leaves in the cache
    names = ["config.json", "diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.fp16.safetensors"]
    files = [f"{inner}{name}" for name in names] + ["README.md", "taesd_decoder.pth", "unet/config.json"]
    asked = []

    def list_repo_files(repo_id):
        if layout == "offline":
            raise OSError("no network")
        return files

    def snapshot_download(repo_id, allow_patterns=None, local_files_only=False):
        asked.append((repo_id, allow_patterns, local_files_only))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "list_repo_files", list_repo_files)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    loaded = load_vae("someone/a-vae")
    assert loaded.class_name == ("AutoencoderKL" if inner else "AutoencoderTiny") and loaded.name == "someone/a-vae"
    if layout == "offline":
        assert asked == [("someone/a-vae", None, True)]
    else:
        assert asked == [
            ("someone/a-vae", [f"{inner}config.json", f"{inner}diffusion_pytorch_model.safetensors"], False)
        ]
