"""The embedded default model draws what it is asked, and diffusers draws the same pictures from it.

The accuracy test generates every prompt of `tools.evaluate.PROMPTS` (held-out colour-shape pairs
included) with the model's default settings and reads the picture back with the image analysis
of `tools/evaluate.py`; the same model with random weights must fail the same test.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from engine import load_pipeline
from engine.loading.sources import DEFAULT_MODEL
from tools import shapes
from tools.evaluate import analyse, consecutive_runs, engine_drawer, evaluate

COLOUR_ACCURACY = 0.9
SHAPE_ACCURACY = 0.75
SEEDS = (0, 1, 2, 3)  # four pictures per prompt: an accuracy over 96 pictures, not a lucky 24


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline()


def randomized_copy(source: Path, folder: Path, seed: int = 0) -> Path:
    """The model with every tensor redrawn from a normal of that tensor's own mean and std."""
    shutil.copytree(source, folder)
    rng = np.random.default_rng(seed)
    for path in sorted(folder.glob("*/*.safetensors")):
        tensors = {}
        for name, value in load_file(str(path)).items():
            v = value.astype(np.float32)
            tensors[name] = (rng.standard_normal(v.shape) * v.std() + v.mean()).astype(value.dtype)
        save_file(tensors, str(path))
    return folder


def describe(report) -> str:
    wrong = [f"{r['prompt']!r}: {r['got']}" for r in report.rows if not r["shape_ok"] or not r["foreground_ok"]]
    return f"{report.summary()}\nwrong: {wrong}"


@pytest.mark.parametrize("held_out", [False, True])
def test_the_analysis_reads_back_every_rendered_scene(held_out):
    rng = np.random.default_rng(0)
    for _ in range(100):
        scene = shapes.sample_scene(rng, held_out=held_out, two=False)
        got = analyse(shapes.render(scene))
        (shape,) = scene.shapes
        assert (got.foreground, got.shape, got.background) == (shape.colour, shape.kind, scene.background), scene


def test_the_held_out_pairs_never_appear_in_training_scenes():
    rng = np.random.default_rng(1)
    for _ in range(500):
        for shape in shapes.sample_scene(rng).shapes:
            assert (shape.colour, shape.kind) not in shapes.HELD_OUT


def test_consecutive_seeds_are_drawn_a_batch_at_a_time():
    assert consecutive_runs([0, 1, 2, 3], 8) == [[0, 1, 2, 3]]  # SEEDS: one request of four pictures a prompt
    assert consecutive_runs([0, 1, 2, 5, 6, 9, 8], 2) == [[0, 1], [2], [5, 6], [9], [8]]


def test_the_default_model_draws_the_colours_and_shapes_it_is_asked_for(pipe):
    report = evaluate(engine_drawer(pipe), seeds=SEEDS)
    summary = report.summary()
    assert summary["foreground"] >= COLOUR_ACCURACY, describe(report)
    assert summary["background"] >= COLOUR_ACCURACY, describe(report)
    assert summary["shape"] >= SHAPE_ACCURACY, describe(report)


def test_a_random_model_of_the_same_shape_fails(pipe, tmp_path):
    random = load_pipeline(randomized_copy(DEFAULT_MODEL, tmp_path / "random"))
    assert random.defaults == pipe.defaults
    summary = evaluate(engine_drawer(random), seeds=SEEDS).summary()
    assert summary["colour"] < COLOUR_ACCURACY / 2 and summary["shape"] < SHAPE_ACCURACY / 2, summary


def test_diffusers_draws_the_same_picture_from_the_same_latents(pipe):
    torch = pytest.importorskip("torch")
    from diffusers import StableDiffusionPipeline

    reference = StableDiffusionPipeline.from_pretrained(
        DEFAULT_MODEL, safety_checker=None, requires_safety_checker=False, torch_dtype=torch.float32
    )
    reference.set_progress_bar_config(disable=True)
    d = pipe.defaults
    assert type(reference.scheduler).__name__ == "DDIMScheduler" and d["scheduler"] == "ddim"
    # As many pictures as the accuracy test draws in one request (one per seed): the engine runs the programs that
    # test compiled, where two would compile a batch of their own; diffusers' batch of four costs little more.
    images = len(SEEDS)
    latents = np.random.default_rng(0).standard_normal((images, 4, d["height"] // 8, d["width"] // 8))
    latents = latents.astype(np.float32)
    for prompt in ("a yellow star on a purple background", "a red star on a white background"):
        ours = pipe.generate(prompt, num_images=images, latents=latents).arrays
        theirs = reference(
            prompt,
            num_images_per_prompt=images,
            height=d["height"],
            width=d["width"],
            num_inference_steps=d["num_inference_steps"],
            guidance_scale=d["guidance_scale"],
            latents=torch.from_numpy(latents),
            output_type="np",
        ).images
        assert ours.shape == theirs.shape
        assert np.abs(ours - theirs).max() < 1e-2
