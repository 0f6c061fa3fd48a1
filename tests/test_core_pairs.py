"""Core pairs (engine/sampling/pairs.py): an engine that splits each image's work over two CPU devices draws what
diffusers draws, and what one device draws, for every kind of step the split takes.

The split runs in a fresh interpreter with 4 CPU devices (two pairs); the reference pictures are drawn
here, by diffusers from the same folder and latents.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tiny_pipeline
from multidevice import run_with_devices
from test_pipeline import SIZE, TOLERANCE, run_reference

from engine.sampling import pairs

ODD = 72  # pixels: 9 latent rows, which a pair splits unevenly

# (variant, scheduler, guidance, images, height): what each image's UNet rows become on its pair.
CASES = [
    ("sd1", "pndm", 6.0, 1, SIZE),  # a guided image: its two halves, one on each device
    ("sd1", "euler_a", 6.0, 3, SIZE),  # two images on the first pair, one on the second
    # Guidance off, one row: split by latent rows, an odd number of them (72 pixels: 9), unevenly. The same
    # programs as the odd-rows run below, which draws two images: one compile serves both.
    ("sd1", "ddim", 1.0, 1, ODD),
    ("turbo", "euler", 0.0, 2, SIZE),  # one row on each pair, split by latent rows
]
PROMPT, NEGATIVE, STEPS = "a red circle on a blue background", "blurry photo", 3

SPLIT = """
import json
import numpy as np
import jax
from PIL import Image
from engine import enable_compile_cache, load_pipeline

# The session's compile cache (JAX_SD_CACHE_DIR): plans that differ only in the scheduler, the guidance or the mode
# share their decode program, which is then loaded, not compiled again.
enable_compile_cache()
cases, folders = json.loads({cases!r}), json.loads({folders!r})
paired = {{variant: load_pipeline(folder, core_pairs=True, previews=False) for variant, folder in folders.items()}}
for variant, scheduler, guidance, images, height in cases:
    assert paired[variant].devices == ["cpu:0+1", "cpu:2+3"], paired[variant].devices
    latents = np.load(OUT / f"latents-{{images}}-{{height}}.npy")
    settings = dict(negative_prompt={negative!r}, seed=7, num_inference_steps={steps}, guidance_scale=guidance,
                    height=height, width={size}, num_images=images, scheduler=scheduler, latents=latents)
    got = paired[variant].generate({prompt!r}, **settings)
    assert set(got.devices) <= set(paired[variant].devices), got.devices
    np.save(OUT / f"{{variant}}-{{scheduler}}-{{images}}.npy", got.arrays)

# Starting from a picture, and repainting half of it: the source's VAE encode and the blend, paired.
paired = paired["sd1"]
one = load_pipeline(folders["sd1"], devices=jax.devices()[:1], core_pairs=False, previews=False)
rng = np.random.default_rng(5)
picture = Image.fromarray(rng.integers(0, 256, ({size}, {size}, 3), dtype=np.uint8))
mask = Image.fromarray(np.where(np.arange({size})[None, :] < {size} // 2, 255, 0).astype(np.uint8).repeat({size}, 0))
for name, extra in (("img2img", {{}}), ("inpaint", {{"mask_image": mask}})):
    settings = dict(seed=11, num_inference_steps=4, guidance_scale=6.0, num_images=2, image=picture, strength=0.6, **extra)
    np.save(OUT / f"{{name}}-paired.npy", paired.generate({prompt!r}, **settings).arrays)
    np.save(OUT / f"{{name}}-one.npy", one.generate({prompt!r}, **settings).arrays)

# An odd number of latent rows, split unevenly; guidance off, so the UNet is split by rows too.
odd = dict(seed=5, num_inference_steps=3, guidance_scale=1.0, num_images=2, height={odd}, width={size}, scheduler="ddim")
np.save(OUT / "odd-rows-paired.npy", paired.generate({prompt!r}, **odd).arrays)
np.save(OUT / "odd-rows-one.npy", one.generate({prompt!r}, **odd).arrays)
"""


@pytest.fixture(scope="module")
def split_run(tmp_path_factory):
    """The 4-device run's pictures (a folder of .npy), with the references' folders and pipelines."""
    out = tmp_path_factory.mktemp("pairs")
    references, folders = {}, {}
    for variant in sorted({case[0] for case in CASES}):
        folder = tmp_path_factory.mktemp(variant)
        references[variant] = tiny_pipeline.write(variant, folder)
        references[variant].saved_scheduler_config = references[variant].scheduler.config
        folders[variant] = str(folder)
    for images, height in {case[3:] for case in CASES}:
        latents = np.random.default_rng(images).standard_normal((images, 4, height // 8, SIZE // 8))
        np.save(out / f"latents-{images}-{height}.npy", latents.astype("f4"))
    code = SPLIT.format(
        cases=json.dumps(CASES),
        folders=json.dumps(folders),
        prompt=PROMPT,
        negative=NEGATIVE,
        steps=STEPS,
        size=SIZE,
        odd=ODD,
    )
    run_with_devices(4, code, out, timeout=600)
    return out, references


@pytest.mark.parametrize("variant, scheduler, guidance, images, height", CASES)
def test_paired_devices_draw_what_diffusers_draws(split_run, variant, scheduler, guidance, images, height):
    out, references = split_run
    latents = np.load(out / f"latents-{images}-{height}.npy")
    seeds = [7 + k for k in range(images)]
    want = run_reference(references[variant], scheduler, guidance, latents, seeds, STEPS, PROMPT, NEGATIVE)
    got = np.load(out / f"{variant}-{scheduler}-{images}.npy")
    assert got.shape == want.shape
    assert np.abs(got - want).max() < TOLERANCE
    assert got.std() > 0.01  # a real picture, not a constant that matches trivially


@pytest.mark.parametrize("mode", ["img2img", "inpaint"])
def test_paired_devices_start_from_a_picture_as_one_device_does(split_run, mode):
    out, _ = split_run
    paired, one = np.load(out / f"{mode}-paired.npy"), np.load(out / f"{mode}-one.npy")
    np.testing.assert_allclose(paired, one, atol=1e-4)
    assert paired.std() > 0.01


def test_pair_cores_asks_for_two_devices_only_where_it_may(monkeypatch):
    environ = {}  # this process's own environment stays as it is
    monkeypatch.setattr(pairs.os, "environ", environ)
    monkeypatch.setattr(pairs, "backends_started", lambda: False)
    monkeypatch.setattr(pairs.cpus, "cgroup_quota", lambda *paths: None)  # no quota: the affinity mask counts
    monkeypatch.setattr(pairs.cpus, "fit_threads", lambda: None)  # tests/test_cpus.py
    monkeypatch.setattr(pairs.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(pairs.onednn, "cpu_dtype", lambda: "float32")  # a host whose networks XLA runs itself
    assert pairs.pair_cores() and pairs.asked()
    assert environ == {"XLA_FLAGS": pairs.DEVICE_COUNT_FLAG + "=2", pairs.SWITCH: "1"}
    assert pairs.pair_cores()  # a child process inherits the answer

    environ.clear()
    environ[pairs.SWITCH] = "0"  # the user said no
    assert not pairs.pair_cores() and "XLA_FLAGS" not in environ

    environ.clear()
    environ["XLA_FLAGS"] = pairs.DEVICE_COUNT_FLAG + "=8"  # a device count chosen already
    assert not pairs.pair_cores() and environ == {"XLA_FLAGS": pairs.DEVICE_COUNT_FLAG + "=8"}

    environ.clear()
    environ["JAX_PLATFORMS"] = "cuda"  # an accelerator asked for
    assert not pairs.pair_cores() and "XLA_FLAGS" not in environ

    environ.clear()
    monkeypatch.setattr(pairs.os, "sched_getaffinity", lambda pid: {0})  # one core: nothing to pair
    assert not pairs.pair_cores() and not environ

    monkeypatch.setattr(pairs.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(pairs.cpus, "cgroup_quota", lambda *paths: 1.0)  # a container's quota of one CPU
    assert not pairs.pair_cores() and not environ

    monkeypatch.setattr(pairs.cpus, "cgroup_quota", lambda *paths: None)
    monkeypatch.setattr(pairs, "backends_started", lambda: True)  # too late: JAX has its devices
    assert not pairs.pair_cores() and not environ


def test_core_pairs_need_an_even_number_of_cpu_devices():
    import jax

    from engine import load_pipeline

    with pytest.raises(ValueError, match="even number of CPU devices"):
        load_pipeline(devices=jax.devices()[:1], core_pairs=True, previews=False)


def test_paired_devices_split_an_odd_number_of_latent_rows_as_one_device_draws(split_run):
    out, _ = split_run
    paired, one = np.load(out / "odd-rows-paired.npy"), np.load(out / "odd-rows-one.npy")
    assert paired.shape == (2, ODD, SIZE, 3)
    np.testing.assert_allclose(paired, one, atol=1e-4)
    assert paired.std() > 0.01
