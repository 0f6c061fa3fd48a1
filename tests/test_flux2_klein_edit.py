"""FLUX.2 [klein] editing: reference pictures drawn from, against diffusers' `Flux2KleinPipeline(image=[...])`.

test_flux2_klein.py's tiny folder (imported, not copied; saved as a base model, drawn unguided and guided): the same prompt, initial latents and reference
pictures go through diffusers and through our engine in f32, and the pictures agree within 1/255 on 0..1. The
references are cut as the pipeline cuts them (sides floored to one token's 4 pixels, the middle kept), encoded in
the admit program and read as tokens after the latent's at times 10, 20, ...; a request giving no size takes its
first reference's (checked on the request, without drawing a third size). Their count and sizes are a static part of the plan: requests bringing the same sizes batch
together, and others run in plans of their own beside text-to-image ones.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
from PIL import Image
from test_flux2_klein import PROMPT, TOLERANCE, build_reference, latents

from engine import GenerationRequest, InvalidRequest, load_pipeline
from engine.families.flux2 import prepare_reference
from engine.request_references import reference_size


def picture(width: int, height: int, seed: int) -> Image.Image:
    """A smooth picture with structure (random noise would say little about where its middle went)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / 8.0
    channels = [np.sin(x * rng.uniform(0.5, 2) + rng.uniform(0, 6)) * np.cos(y * rng.uniform(0.5, 2)) for _ in "rgb"]
    return Image.fromarray(np.uint8(np.stack(channels, -1) * 120 + 128))


ONE = (picture(64, 64, 1),)
TWO = (picture(70, 66, 2), picture(64, 81, 3))  # cut to 68x64 and 64x80: the middle kept


@pytest.fixture(scope="module")
def klein(tmp_path_factory):
    """The reference pipeline and our engine on its base (not distilled) folder. At scale 1 neither takes the
    unconditional row (Flux2KleinPipeline's `do_classifier_free_guidance`, our plan's `guidance`), so the pictures at
    scale 1 are a distilled folder's; at 4 both add it, and this one engine proves both paths."""
    reference = build_reference(tmp_path_factory.mktemp("parts"))
    reference.register_to_config(is_distilled=False)
    folder = tmp_path_factory.mktemp("base")
    reference.save_pretrained(folder)
    engine = load_pipeline(folder, safety_checker=False, max_batch_size=2)
    yield reference, engine
    engine.close()


def diffusers_edit(reference, references, start: np.ndarray, steps: int, guidance_scale=1.0, **size) -> np.ndarray:
    with torch.no_grad():
        out = reference(
            prompt=PROMPT,
            image=list(references),
            latents=torch.from_numpy(start),
            num_inference_steps=steps,
            guidance_scale=guidance_scale,
            output_type="np",
            **size,
        )
    return out.images


def test_one_reference_matches_diffusers(klein):
    reference, engine = klein
    start = latents(32, 32, n=1, seed=4)
    want = diffusers_edit(reference, ONE, start, 2, height=32, width=32)
    args = dict(height=32, width=32, num_images=1, latents=start, num_inference_steps=2, guidance_scale=1.0)
    got = engine.generate(PROMPT, references=ONE, **args).arrays
    assert np.abs(got - want).max() < TOLERANCE
    plain = engine.generate(PROMPT, **args).arrays  # the reference changes the picture
    assert np.abs(plain - got).max() > 0.05


def test_guided_references_match_diffusers(klein):
    """The unconditional row reads the same references as the conditional one, as the pipeline's."""
    reference, engine = klein
    start = latents(32, 32, n=1, seed=6)
    want = diffusers_edit(reference, ONE, start, 2, height=32, width=32, guidance_scale=4.0)
    args = dict(height=32, width=32, latents=start, num_inference_steps=2)
    got = engine.generate(PROMPT, references=ONE, guidance_scale=4.0, **args).arrays
    assert np.abs(got - want).max() < TOLERANCE


def test_two_references_of_other_sizes_match_diffusers(klein):
    """Each cut in its middle (70x66 to 68x64, 64x81 to 64x80), read at times 10 and 20 in the request's order."""
    reference, engine = klein
    start = latents(32, 32, n=1, seed=5)
    want = diffusers_edit(reference, TWO, start, 2, height=32, width=32)
    args = dict(height=32, width=32, num_images=1, latents=start, num_inference_steps=2, guidance_scale=1.0)
    got = engine.generate(PROMPT, references=TWO, **args).arrays
    assert np.abs(got - want).max() < TOLERANCE


def test_a_request_without_a_size_takes_the_first_references(klein):
    """As the pipeline's `height = height or image_height`: the first reference's size once cut."""
    _, engine = klein
    resolved = engine.limits.resolve(GenerationRequest(PROMPT, references=list(TWO)), engine.defaults)
    assert (resolved.width, resolved.height) == (68, 64) and resolved.references == TWO
    sized = engine.limits.resolve(GenerationRequest(PROMPT, references=TWO, width=32, height=32), engine.defaults)
    assert (sized.width, sized.height) == (32, 32)  # a size given wins


def test_a_large_reference_is_shrunk_and_cut_as_the_pipeline_does(klein):
    """Above 1024x1024 pixels a reference is shrunk (Lanczos) to about that area, then cut to multiples of 16; on
    the host only, so a real model's sizes are checked here without drawing."""
    _, engine = klein
    limits = dataclasses.replace(engine.limits, side_multiple=16)  # the real model's tokens: 16 pixels
    processor = Flux2ImageProcessor(vae_scale_factor=16)
    for size in [(1500, 1000), (1030, 1030), (700, 433)]:
        pic = picture(*size, seed=size[0])
        img, (w, h) = pic, pic.size
        if w * h > 1024 * 1024:  # Flux2KleinPipeline.__call__'s own steps
            img = processor._resize_to_target_area(img, 1024 * 1024)
            w, h = img.size
        want = processor.preprocess(img, height=h // 16 * 16, width=w // 16 * 16, resize_mode="crop")
        want = want[0].permute(1, 2, 0).numpy()
        width, height = reference_size(limits, pic)
        got = prepare_reference(pic, width, height)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-6)


def test_references_batch_by_their_sizes_beside_text_to_image(klein):
    """Two requests whose references have the same sizes share a plan (the second compiles nothing); with a
    text-to-image request and a request of other reference sizes, submitted at once, each gets the picture it draws
    alone, and nothing is compiled anew."""
    _, engine = klein
    base = dict(prompt=PROMPT, num_inference_steps=2, num_images=1, guidance_scale=1.0)
    requests = [
        GenerationRequest(**base, seed=1, height=32, width=32, references=ONE),
        GenerationRequest(**base, seed=2, height=32, width=32),
        GenerationRequest(**base, seed=3, height=32, width=32, references=TWO),
        GenerationRequest(**base, seed=4, height=32, width=32, references=(picture(64, 64, 9),)),
    ]
    alone = []
    for k, request in enumerate(requests):
        before = engine.compile_count
        alone.append(engine.submit(request).result(300).arrays)
        if k == 3:  # the same reference size as the first: its plan
            assert engine.compile_count == before
    assert np.abs(alone[3] - alone[0]).max() > 0.02  # its own picture, not the first one's
    compiled = engine.compile_count
    tickets = [engine.submit(r) for r in requests]  # all at once
    for ticket, want in zip(tickets, alone, strict=True):
        assert np.abs(ticket.result(300).arrays - want).max() <= 1 / 255
    assert engine.compile_count == compiled


def test_references_are_refused_where_they_cannot_be_drawn(klein):
    _, engine = klein
    assert engine.limits.max_references == 4
    args = dict(height=32, width=32, num_inference_steps=1)
    with pytest.raises(InvalidRequest, match="5 reference pictures are too many; this model takes at most 4"):
        engine.generate(PROMPT, references=ONE * 5, **args)
    with pytest.raises(InvalidRequest, match="reference 2 must be a picture"):
        engine.generate(PROMPT, references=(ONE[0], np.zeros((64, 64, 3))), **args)
    with pytest.raises(InvalidRequest, match="reference 1 is 64x32; .* at least 64 pixels"):
        engine.generate(PROMPT, references=(picture(64, 32, 0),), **args)


def test_a_model_that_does_not_edit_refuses_references():
    sd = load_pipeline()  # the embedded tiny SD model: refused before anything is compiled
    try:
        assert sd.limits.max_references == 0
        with pytest.raises(InvalidRequest, match="this model does not take reference pictures"):
            sd.generate("a red circle", references=ONE, num_inference_steps=1)
        assert sd.compile_count == 0
    finally:
        sd.close()
