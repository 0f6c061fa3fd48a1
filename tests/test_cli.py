"""`python -m engine generate` writes the images and a grid, and says what went wrong on bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from PIL import Image

from engine.compat.pnginfo import png_info

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_SD_CACHE_DIR=str(tmp_path / "xla"))
    return subprocess.run(
        [sys.executable, "-m", "engine", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_generate_writes_images_and_a_grid(tmp_path):
    out = tmp_path / "out"
    done = run_cli(
        "generate", "a red circle", "--seed", "4", "--steps", "2", "--images", "2", "--out", str(out), tmp_path=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["grid.png", "seed4.png", "seed5.png"]
    w, h = Image.open(out / "seed4.png").size
    assert Image.open(out / "grid.png").size == (2 * w, h)
    assert "seeds [4, 5]" in done.stdout and "compile" in done.stdout
    recipe = png_info(out / "seed5.png")  # each picture carries how it was made, as AUTOMATIC1111 writes it
    assert (recipe.prompt, recipe.seed, recipe.num_inference_steps, recipe.model) == (
        "a red circle",
        5,
        2,
        "embedded default",
    )
    assert (recipe.width, recipe.height) == (w, h) and recipe.scheduler == "ddim"


def test_bad_input_is_one_clear_line(tmp_path):
    done = run_cli("generate", "a red circle", "--steps", "0", "--out", str(tmp_path / "out"), tmp_path=tmp_path)
    assert done.returncode == 2
    assert "error: steps must be a whole number from 1" in done.stderr
    assert "Traceback" not in done.stderr


def test_image_to_image_and_inpainting_from_files(tmp_path):
    picture, mask = tmp_path / "picture.png", tmp_path / "mask.png"
    Image.new("RGB", (96, 64), (200, 40, 40)).save(picture)
    Image.new("L", (96, 64), 255).save(mask)
    out = tmp_path / "out"
    args = ["generate", "a red circle", "--steps", "2", "--images", "1", "--image", str(picture)]
    done = run_cli(*args, "--mask", str(mask), "--strength", "0.5", "--out", str(out), tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr
    recipe = png_info(out / "seed0.png")
    assert (recipe.width, recipe.height, recipe.strength) == (96, 64, 0.5)  # the picture's own size
    small = tmp_path / "small.png"
    Image.new("L", (32, 32), 255).save(small)
    done = run_cli(*args, "--mask", str(small), "--out", str(out), tmp_path=tmp_path)
    assert done.returncode == 2 and "error: mask_image is 32x32 but image is 96x64" in done.stderr
