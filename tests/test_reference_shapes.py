"""Reference pictures on a server with fixed sizes: a bounded set of shapes, so a bounded set of plans.

The references' sizes are part of a request's static plan; where any size goes (local use) each is drawn as the
family's diffusers pipeline draws it, so every new size compiles a plan. On a server that offers fixed sizes
(`Limits.sizes`) a reference is drawn at the nearest (aspect, then area) of `reference_shapes`: the offered sizes
within the family's reference area (FLUX.2 [klein]), or the family's own list (FLUX.1 Kontext's preferred
resolutions, unchanged). Checked on the host at the real models' sizes, and end to end on test_flux2_klein.py's
tiny folder: two odd reference sizes that snap to one shape share one plan, and the picture is diffusers' own drawn
from the reference resized to that shape.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from PIL import Image, ImageOps
from test_flux2_klein import PROMPT, TOLERANCE, build_reference, latents
from test_flux2_klein_edit import diffusers_edit, picture

from engine import GenerationRequest, InvalidRequest, load_pipeline
from engine.families.flux_kontext import PREFERRED_RESOLUTIONS
from engine.request import Limits, common_sizes
from engine.request_references import (
    fit_reference,
    nearest_resolution,
    reference_shapes,
    reference_size,
    within_area,
)

# FLUX.2 [klein] 4B's limits: 16 pixels a token, 1024x1024 drawn by default, references up to a megapixel
KLEIN = Limits(
    schedulers=("flow_euler",), side_multiple=16, max_side=2048, max_clip_skip=0, devices=1, max_references=4
)
COMMON = common_sizes(1024, 16, KLEIN.min_side)  # the sizes `--sizes common` offers: 7
# The tiny engine's offered sizes (4 pixels a token): its pictures drawn 32x32, its square references 64x64
SIZES = ((32, 32), (64, 64), (96, 64), (64, 96))
A, B = picture(70, 66, 11), ImageOps.invert(picture(83, 77, 11))  # odd sizes, both nearest the square


def random_sizes(n: int, seed: int) -> list[tuple[int, int]]:
    """Picture sizes a stranger might send: sides 64..4000, aspects within 8:1 (what `check_references` lets in)."""
    rng = np.random.default_rng(seed)
    sizes = []
    while len(sizes) < n:
        w, h = (int(side) for side in rng.integers(64, 4000, 2))
        if max(w / h, h / w) <= 8:
            sizes.append((w, h))
    return sizes


def test_on_fixed_sizes_any_reference_is_drawn_at_one_of_seven_shapes():
    """`--sizes common` offers 7 sizes; the one of them over a megapixel (1280x832) is shrunk as the pipeline
    shrinks a reference (to 1264x816), so 20 random pictures land on at most those N = 7 shapes."""
    limits = dataclasses.replace(KLEIN, sizes=COMMON)
    shapes = reference_shapes(limits)
    assert len(shapes) == 7 and (1264, 816) in shapes and (1280, 832) not in shapes
    assert all(w * h <= limits.reference_pixels for w, h in shapes)
    drawn = {reference_size(limits, Image.new("RGB", size)) for size in random_sizes(20, seed=0)}
    assert drawn <= set(shapes) and len(drawn) <= 7
    # nearest in aspect first: a 3:2 picture of any area is drawn 1264x816, a wide one 1344x768
    assert reference_size(limits, Image.new("RGB", (3000, 2000))) == (1264, 816)
    assert reference_size(limits, Image.new("RGB", (300, 200))) == (1264, 816)
    assert reference_size(limits, Image.new("RGB", (1000, 300))) == (1344, 768)


def test_offered_sizes_of_one_aspect_are_told_apart_by_area():
    limits = dataclasses.replace(KLEIN, sizes=((512, 512), (1024, 1024), (768, 512)))
    assert reference_size(limits, Image.new("RGB", (600, 600))) == (512, 512)
    assert reference_size(limits, Image.new("RGB", (900, 880))) == (1024, 1024)
    assert reference_size(limits, Image.new("RGB", (3000, 3000))) == (1024, 1024)  # shrunk to a megapixel first


def test_any_size_keeps_the_pipelines_own_rule():
    """Where sizes are not fixed there is no set of shapes: each picture is drawn at diffusers' size (shrunk to a
    megapixel, floored to whole tokens) and reaches the family's `prepare` untouched."""
    assert KLEIN.sizes is None and reference_shapes(KLEIN) == ()
    for w, h in random_sizes(20, seed=1):
        pic = Image.new("RGB", (w, h))
        sw, sh = within_area(w, h, KLEIN.reference_pixels)
        assert reference_size(KLEIN, pic) == (sw // 16 * 16, sh // 16 * 16)
        assert fit_reference(KLEIN, pic, *reference_size(KLEIN, pic)) is pic


def test_kontext_stays_on_its_preferred_resolutions_on_fixed_sizes():
    """Kontext's own list bounds it already (17 shapes): fixed sizes change neither its sizes nor its pictures."""
    kontext = dataclasses.replace(KLEIN, reference_resolutions=PREFERRED_RESOLUTIONS, max_references=1)
    fixed = dataclasses.replace(kontext, sizes=COMMON)
    assert reference_shapes(fixed) == PREFERRED_RESOLUTIONS
    for w, h in random_sizes(20, seed=2):
        pic = Image.new("RGB", (w, h))
        want = nearest_resolution(w, h, PREFERRED_RESOLUTIONS, 16)
        assert reference_size(fixed, pic) == reference_size(kontext, pic) == want
        assert want in PREFERRED_RESOLUTIONS and fit_reference(fixed, pic, *want) is pic


@pytest.fixture(scope="module")
def fixed(tmp_path_factory):
    """diffusers' tiny Klein pipeline and our engine on its folder, offering three sizes."""
    reference = build_reference(tmp_path_factory.mktemp("parts"))
    folder = tmp_path_factory.mktemp("klein")
    reference.save_pretrained(folder)
    engine = load_pipeline(folder, safety_checker=False, max_batch_size=1, sizes=SIZES)
    yield reference, engine
    engine.close()


def test_references_that_snap_to_one_shape_share_one_plan(fixed):
    """70x66 and 83x77 are both drawn 64x64 (diffusers would cut them to 68x64 and 80x76: two plans); the second
    request compiles nothing, and each picture is diffusers' from its own reference resized (Lanczos) to 64x64. A
    request giving no size takes that shape, an offered size."""
    reference, engine = fixed
    assert reference_shapes(engine.limits) == SIZES
    assert reference_size(engine.limits, A) == reference_size(engine.limits, B) == (64, 64)
    resolved = engine.limits.resolve(GenerationRequest(PROMPT, references=[A]), engine.defaults)
    assert (resolved.width, resolved.height) == (64, 64)
    start = latents(32, 32, n=1, seed=7)
    args = dict(height=32, width=32, num_images=1, latents=start, num_inference_steps=2, guidance_scale=1.0)
    first = engine.generate(PROMPT, references=(A,), **args).arrays
    compiled = engine.compile_count
    second = engine.generate(PROMPT, references=(B,), **args).arrays
    assert engine.compile_count == compiled
    want = [
        diffusers_edit(reference, (p.resize((64, 64), Image.Resampling.LANCZOS),), start, 2, height=32, width=32)
        for p in (A, B)
    ]
    assert np.abs(first - want[0]).max() < TOLERANCE and np.abs(second - want[1]).max() < TOLERANCE
    # The tiny model reads a reference's content only faintly (its two pictures differ by about 4e-4, ours by 1e-6
    # from diffusers'): the second picture is its own reference's, not the first one's
    assert np.abs(second - want[1]).max() * 10 < np.abs(second - want[0]).max()


def test_refusals_are_unchanged_on_fixed_sizes(fixed):
    _, engine = fixed
    args = dict(height=64, width=64, num_inference_steps=1)
    with pytest.raises(InvalidRequest, match="5 reference pictures are too many; this model takes at most 4"):
        engine.generate(PROMPT, references=(A,) * 5, **args)
    with pytest.raises(InvalidRequest, match="reference 1 is 64x32; .* at least 64 pixels"):
        engine.generate(PROMPT, references=(picture(64, 32, 0),), **args)


def test_a_request_without_a_size_takes_the_offered_size_nearest_the_models_own(fixed):
    """The model's own 1024x1024 is not offered: a request giving no size, and the warm-up, take the offered square
    nearest it in area (64x64) instead of being refused."""
    _, engine = fixed
    assert (engine.defaults["width"], engine.defaults["height"]) == (64, 64)
    resolved = engine.limits.resolve(GenerationRequest(PROMPT), engine.defaults)
    assert (resolved.width, resolved.height) == (64, 64)
