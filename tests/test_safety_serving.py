"""The safety checker where people meet it: the engine withholds flagged pictures, the page and the API say so.

The embedded model with a tiny random checker added to its folder (written with diffusers' `save_pretrained`);
its thresholds are set so that it flags every picture, or none.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from diffusers.pipelines.stable_diffusion import safety_checker as torch_safety
from reference import randomize
from safetensors.numpy import load_file, save_file
from transformers import CLIPConfig

from engine import load_pipeline
from engine.loading.sources import DEFAULT_MODEL
from tests._app_server import AppServer

VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, patch_size=8)


def with_checker(folder: Path, threshold: float) -> Path:
    """The embedded model plus a checker whose every threshold is `threshold` (-10: flags all, 10: none)."""
    shutil.copytree(DEFAULT_MODEL, folder)
    cfg = CLIPConfig(vision_config=dict(VISION, image_size=32), projection_dim=24)
    randomize(torch_safety.StableDiffusionSafetyChecker(cfg)).save_pretrained(folder / "safety_checker")
    weights = folder / "safety_checker" / "model.safetensors"
    tensors = load_file(weights)
    for name in ("concept_embeds_weights", "special_care_embeds_weights"):
        tensors[name] = np.full_like(tensors[name], threshold)
    save_file(tensors, weights)
    (folder / "feature_extractor").mkdir()
    (folder / "feature_extractor" / "preprocessor_config.json").write_text(json.dumps({"size": 32, "crop_size": 32}))
    index = json.loads((folder / "model_index.json").read_text())
    index["safety_checker"] = ["stable_diffusion", "StableDiffusionSafetyChecker"]
    index["feature_extractor"] = ["transformers", "CLIPImageProcessor"]
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


@pytest.fixture(scope="module")
def strict(tmp_path_factory):
    return with_checker(tmp_path_factory.mktemp("strict") / "model", threshold=-10.0)


def generate(pipe):
    return pipe.generate("a red circle on a blue background", seed=4, num_images=2, num_inference_steps=4)


def test_flagged_pictures_are_withheld_and_reported(strict):
    pipe = load_pipeline(strict, max_batch_size=2)
    assert pipe.safety_mode == "on"
    result = generate(pipe)
    assert result.nsfw_content_detected == [True, True]
    assert result.seeds == [4, 5]  # the seeds stay, so the user can try another
    assert not result.arrays.any() and all(image.getextrema() == ((0, 0),) * 3 for image in result.images)


def test_a_checker_that_flags_nothing_changes_no_picture(tmp_path):
    lenient = load_pipeline(with_checker(tmp_path / "model", threshold=10.0), max_batch_size=2)
    plain = load_pipeline(max_batch_size=2)
    assert (lenient.safety_mode, plain.safety_mode) == ("on", "none")
    got, want = generate(lenient), generate(plain)
    assert got.nsfw_content_detected == [False, False] and want.nsfw_content_detected == [False, False]
    np.testing.assert_array_equal(got.arrays, want.arrays)


def test_the_checker_can_be_turned_off_for_local_use(strict):
    pipe = load_pipeline(strict, max_batch_size=2, safety_checker=False)
    assert pipe.safety_mode == "off"
    result = generate(pipe)
    assert result.nsfw_content_detected == [False, False] and result.arrays.std() > 0.05


@pytest.mark.slow
@pytest.mark.parametrize("off", [False])  # with the flag: the engine test above; a server start costs ~40 s
def test_the_page_shows_placeholders_or_with_the_flag_the_pictures(strict, tmp_path, off):
    from gradio_client import Client

    # Two pictures by default: the start-up warm-up compiles the programs the request below runs, not narrower ones.
    flags = ["--model", str(strict), "--images-per-device", "2", *(["--no-safety-checker"] if off else [])]
    server = AppServer(tmp_path, *flags).wait_until_up()
    try:
        client = Client(server.url, verbose=False, download_files=str(tmp_path / "downloads"))
        gallery, seed, info = client.predict(
            prompt="a red circle", seed=8, random_seed=False, images_per_device=2, api_name="/generate"
        )
        status = client.config["components"]
        text = json.dumps([c["props"].get("value") for c in status if c.get("type") == "markdown"])
        captions = [item["caption"] for item in gallery]
        if off:
            assert captions == ["cpu:0 · seed 8", "cpu:0 · seed 9"] and "withheld" not in info
            assert "safety checker off" in text
        else:
            assert captions == ["filtered by the safety checker · seed 8", "filtered by the safety checker · seed 9"]
            assert "2 pictures were withheld by the safety checker" in info and seed == 8
            assert "safety checker withholds flagged pictures" in text
    finally:
        server.stop()


def test_the_flax_api_reports_flagged_pictures_as_the_old_pipeline_did(strict):
    import jax

    from engine.compat.flax_api import FlaxStableDiffusionPipeline

    pipeline, params = FlaxStableDiffusionPipeline.from_pretrained(strict)
    ids = pipeline.prepare_inputs(["a red circle"] * 2)
    out = pipeline(ids, params, jax.random.PRNGKey(0), num_inference_steps=2)
    assert out.nsfw_content_detected == [True, True] and not np.asarray(out.images).any()
    off, params = FlaxStableDiffusionPipeline.from_pretrained(strict, safety_checker=None)
    out = off(ids, params, jax.random.PRNGKey(0), num_inference_steps=2)
    assert out.nsfw_content_detected == [False, False] and np.asarray(out.images).std() > 0.01
