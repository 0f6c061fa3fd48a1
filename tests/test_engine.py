"""The engine's contract: no recompiles for per-request values, clear errors, devices, sources."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from multidevice import run_with_devices

from engine import InvalidRequest, SourceError, WeightsError, load_pipeline
from engine.loading.sources import DEFAULT_MODEL, select_hub_files


@pytest.fixture(scope="module")
def pipe():
    return load_pipeline()


def test_steps_guidance_seed_and_prompt_never_recompile(pipe):
    pipe.generate("a red circle", num_inference_steps=2, guidance_scale=7.5, seed=1)
    compiled = pipe.compile_count
    for steps, guidance, seed, prompt in [(3, 7.5, 2, "a blue star"), (9, 2.0, 99, ""), (1, 12.0, 2**32 - 1, "x" * 50)]:
        result = pipe.generate(prompt, num_inference_steps=steps, guidance_scale=guidance, seed=seed)
        assert not result.compiled
        assert result.timings["compile_s"] == 0.0
    assert pipe.compile_count == compiled


def test_a_new_shape_or_scheduler_compiles_once(pipe):
    before = pipe.compile_count
    first = pipe.generate("a", num_inference_steps=2, height=72, width=64, scheduler="ddim")
    again = pipe.generate("b", num_inference_steps=5, height=72, width=64, scheduler="ddim")
    assert first.compiled and not again.compiled
    assert pipe.compile_count == before + 1
    assert first.images[0].size == (64, 72)


def test_seeds_are_per_image_and_reproducible(pipe):
    three = pipe.generate("a red circle", num_inference_steps=3, seed=10, num_images=3)
    assert three.seeds == [10, 11, 12]
    alone = pipe.generate("a red circle", num_inference_steps=3, seed=12, num_images=1)
    np.testing.assert_allclose(alone.arrays[0], three.arrays[2], atol=1e-5)
    assert np.abs(three.arrays[0] - three.arrays[1]).max() > 1e-3  # different seeds, different pictures


def test_progress_reports_every_step(pipe):
    seen = []
    pipe.generate("a", num_inference_steps=4, scheduler="ddim", progress=lambda i, n: seen.append((i, n)))
    assert [i for i, _ in seen] == [1, 2, 3, 4]
    assert {n for _, n in seen} == {4}


def test_long_prompts_are_chunked_and_said_so(pipe):
    result = pipe.generate("red " * 100, num_inference_steps=1)
    assert result.warnings == ["prompt: 100 tokens, encoded in 2 chunks of 75"]
    assert pipe.generate("red " * 20, num_inference_steps=1).warnings == []


def test_prompts_longer_than_the_chunk_limit_are_refused_with_the_budget(pipe):
    limit = pipe.limits.max_chunks
    with pytest.raises(InvalidRequest, match=f"negative prompt is too long: .* at most {limit} chunks"):
        pipe.generate("red", negative_prompt="red " * (75 * limit + 1), num_inference_steps=1)
    with pytest.raises(InvalidRequest, match=f"^prompt is too long: \\d+ tokens need {limit + 1} chunks"):
        pipe.generate(" BREAK ".join(["red"] * (limit + 1)), num_inference_steps=1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_inference_steps=0), "steps must be a whole number from 1"),
        (dict(num_inference_steps=1000), "steps must be a whole number from 1"),
        (dict(num_inference_steps=2.5), "steps must be a whole number"),
        (dict(height=100), "height must be a multiple of 8"),
        (dict(width=0), "width must be a multiple of 8"),
        (dict(guidance_scale=-1.0), "guidance scale must be a number from 0"),
        (dict(guidance_scale=float("nan")), "guidance scale must be a number"),
        (dict(seed=-1), "seed must be a whole number"),
        (dict(seed="abc"), "seed must be a whole number"),
        (dict(scheduler="lms"), "unknown scheduler 'lms'"),
        (dict(num_images=0), "number of images"),
        (dict(eta=1.5), r"eta must be a number from 0 \(deterministic\) to 1"),
        (dict(eta=float("nan")), "eta must be a number"),
        (dict(eta=-0.1), "eta must be a number"),
        (dict(latents=np.zeros((1, 4, 3, 3), np.float32)), "latents must have shape"),
    ],
)
def test_bad_input_gets_a_clear_error(pipe, kwargs, message):
    with pytest.raises(InvalidRequest, match=message):
        pipe.generate("a red circle", **kwargs)


def test_the_engine_still_serves_after_bad_input(pipe):
    with pytest.raises(InvalidRequest):
        pipe.generate("a", num_inference_steps=0)
    assert len(pipe.generate("a", num_inference_steps=1).images) == 1


def test_a_folder_with_a_missing_tensor_is_refused_with_the_list(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL, folder)
    from safetensors.numpy import load_file, save_file

    path = folder / "unet" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(str(path))
    del tensors["conv_in.bias"]
    save_file(tensors, str(path))
    with pytest.raises(WeightsError, match=r"missing \(1\): unet.conv_in.bias"):
        load_pipeline(folder)


def test_a_folder_of_another_model_type_is_refused(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL, folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps(dict(index, _class_name="KandinskyV22Pipeline")))
    with pytest.raises(SourceError, match="'KandinskyV22Pipeline' is not supported"):
        load_pipeline(folder)


def test_a_folder_that_is_not_a_model_is_refused(tmp_path):
    with pytest.raises(SourceError, match="no model_index.json"):
        load_pipeline(tmp_path)


def test_a_hub_id_loads_from_the_offline_cache(tmp_path, monkeypatch):
    # The layout huggingface_hub keeps: models--owner--name/{refs/main, snapshots/<commit>/...}.
    commit = "0" * 40
    repo = tmp_path / "hub" / "models--jax-sd--tiny"
    shutil.copytree(DEFAULT_MODEL, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    pipe = load_pipeline("jax-sd/tiny")
    assert pipe.model_name == "jax-sd/tiny"
    with pytest.raises(SourceError, match="pass that folder instead"):
        load_pipeline("jax-sd/not-downloaded")


def test_only_the_needed_hub_files_are_fetched():
    files = [
        "model_index.json",
        "README.md",
        "scheduler/scheduler_config.json",
        "tokenizer/vocab.json",
        "unet/config.json",
        "unet/diffusion_pytorch_model.safetensors",
        "unet/diffusion_pytorch_model.fp16.safetensors",
        "unet/diffusion_pytorch_model.bin",
        "vae/config.json",
        "vae/diffusion_pytorch_model.safetensors",
        "text_encoder/config.json",
        "text_encoder/model.fp16.safetensors",
        "text_encoder/model.safetensors",
        "safety_checker/model.safetensors",
        "v1-5-pruned.safetensors",
    ]
    fp16 = select_hub_files(files, "fp16")
    assert "unet/diffusion_pytorch_model.fp16.safetensors" in fp16
    assert "unet/diffusion_pytorch_model.safetensors" not in fp16
    assert "vae/diffusion_pytorch_model.safetensors" in fp16  # no fp16 variant: take the plain one
    full = select_hub_files(files)
    assert "text_encoder/model.safetensors" in full and "text_encoder/model.fp16.safetensors" not in full
    for skipped in (
        "README.md",
        "unet/diffusion_pytorch_model.bin",
        "safety_checker/model.safetensors",
        "v1-5-pruned.safetensors",
    ):
        assert skipped not in fp16 and skipped not in full


# stabilityai/stable-diffusion-3.5-medium's and black-forest-labs/FLUX.1-schnell's files (abridged)
SD3_FILES = [
    *("model_index.json", "scheduler/scheduler_config.json", "transformer/config.json"),
    *("transformer/diffusion_pytorch_model.safetensors", "vae/config.json", "vae/diffusion_pytorch_model.safetensors"),
    *("text_encoder/config.json", "text_encoder/model.safetensors", "tokenizer/vocab.json"),
    *("text_encoder_2/config.json", "text_encoder_2/model.safetensors", "tokenizer_2/vocab.json"),
    *("text_encoder_3/config.json", "text_encoder_3/model-00001-of-00002.safetensors"),
    *("text_encoder_3/model-00002-of-00002.safetensors", "text_encoder_3/model.safetensors.index.json"),
    *("tokenizer_3/tokenizer.json", "tokenizer_3/spiece.model", "sd3.5_medium.safetensors"),
]
FLUX_FILES = [
    *("model_index.json", "scheduler/scheduler_config.json", "transformer/config.json"),
    *("transformer/diffusion_pytorch_model-00001-of-00003.safetensors", "vae/config.json"),
    *("vae/diffusion_pytorch_model.safetensors", "text_encoder/config.json", "text_encoder/model.safetensors"),
    *("text_encoder_2/config.json", "text_encoder_2/model-00001-of-00002.safetensors", "tokenizer_2/tokenizer.json"),
    *("tokenizer/vocab.json", "flux1-schnell.safetensors", "ae.safetensors"),
]


@pytest.mark.parametrize("files", [SD3_FILES, FLUX_FILES], ids=["sd3", "flux"])
def test_a_flow_model_fetches_its_transformer_t5_and_tokenizers_not_its_single_file(files):
    fetched = set(select_hub_files(files))
    assert fetched == {f for f in files if "/" in f or f == "model_index.json"}  # not the single-file checkpoints


@pytest.mark.parametrize("variant", [None, "fp16"])
def test_every_shard_of_the_chosen_variant_is_fetched(variant):
    # diffusers names shards of a variant "<name>.fp16-00001-of-00002.safetensors".
    shards = {
        None: [
            "unet/diffusion_pytorch_model-00001-of-00002.safetensors",
            "unet/diffusion_pytorch_model-00002-of-00002.safetensors",
        ],
        "fp16": [
            "unet/diffusion_pytorch_model.fp16-00001-of-00002.safetensors",
            "unet/diffusion_pytorch_model.fp16-00002-of-00002.safetensors",
        ],
    }
    files = ["model_index.json", "unet/config.json", *shards[None], *shards["fp16"]]
    weights = [f for f in select_hub_files(files, variant) if f.endswith(".safetensors")]
    assert weights == shards[variant]


def test_a_local_folder_reads_every_shard(tmp_path):
    from engine.loading.sources import ModelFolder

    unet = tmp_path / "unet"
    unet.mkdir()
    names = [
        "diffusion_pytorch_model.fp16-00001-of-00002.safetensors",
        "diffusion_pytorch_model.fp16-00002-of-00002.safetensors",
    ]
    for name in [*names, "diffusion_pytorch_model.safetensors.index.fp16.json"]:
        (unet / name).write_bytes(b"")
    folder = ModelFolder(tmp_path, "local", "sd", {})
    assert [f.name for f in folder.weight_files("unet", "fp16")] == names


def test_eight_devices_draw_the_same_images_as_one(pipe, tmp_path):
    one = pipe.generate("a red circle", seed=3, num_inference_steps=3, num_images=8, scheduler="euler_a")
    run_with_devices(
        8,
        """
        import numpy as np
        from engine import load_pipeline
        pipe = load_pipeline()
        assert len(pipe.devices) == 8
        steps = []  # with progress the loop runs in chunks, each fed by the one before
        result = pipe.generate("a red circle", seed=3, num_inference_steps=3, scheduler="euler_a", progress=lambda i, n: steps.append(i))
        assert steps == [1, 2, 3], steps
        np.save(OUT / "images.npy", result.arrays)
        (OUT / "devices.txt").write_text(",".join(result.devices))
        """,
        tmp_path,
    )
    eight = np.load(tmp_path / "images.npy")
    assert eight.shape == one.arrays.shape  # the default is one image per device
    np.testing.assert_allclose(eight, one.arrays, atol=1e-4)
    assert (tmp_path / "devices.txt").read_text().split(",") == [f"cpu:{i}" for i in range(8)]


def test_warmup_builds_guidance_on_and_off(tmp_path):
    # One slot: the warm-up's programs are then the one width these requests run at, both guidance plans of it
    # (with the default 8 slots it also compiles both at the width of 8, which no request here runs).
    pipe = load_pipeline(max_batch_size=1, previews=False)
    pipe.warmup(wait_for_all=True)
    assert len(pipe.compiled_plans) == 2  # guidance on and off, each compiled by the warm-up
    for guidance in (0.0, 1.0, 3.0, 7.5):
        assert not pipe.generate("a", guidance_scale=guidance, num_inference_steps=2).compiled


def test_a_restart_loads_the_programs_from_the_disk_cache(tmp_path):
    code = """
        from engine import enable_compile_cache, load_pipeline
        enable_compile_cache(OUT / "xla")
        # previews off: the preview map's fit is no program of the request's (nor waited for at exit)
        result = load_pipeline(previews=False).generate("a", num_inference_steps=2, height=72, width=72)
        print("compiled" if result.compiled else "loaded")
        """
    assert run_with_devices(1, code, tmp_path).split()[-1] == "compiled"
    assert run_with_devices(1, code, tmp_path).split()[-1] == "loaded"  # a new process, the same cache


def test_bf16_weights_draw_nearly_the_f32_picture(pipe):
    # bf16 is the accelerator default: weights and activations in bf16, scheduler maths in f32.
    half = load_pipeline(dtype="bfloat16")
    assert {leaf.dtype.name for leaf in jax.tree.leaves(half.params)} == {"bfloat16"}
    want = pipe.generate("a red circle", num_inference_steps=10, seed=1).arrays
    got = half.generate("a red circle", num_inference_steps=10, seed=1).arrays
    assert got.dtype == np.float32
    assert np.abs(got - want).mean() < 0.02 and np.abs(got - want).max() < 0.2


def test_the_tokenizer_gives_77_ids_to_every_thread():
    # transformers sets padding and truncation on its shared tokenizer per call: threads must take turns.
    import threading

    from engine.loading.tokenizer import Tokenizer

    tokenizer, shapes = Tokenizer(DEFAULT_MODEL / "tokenizer"), set()

    def user(k):
        for i in range(200):
            shapes.add(tokenizer("a red circle " * (1 + (i + k) % 30))[0].shape)

    threads = [threading.Thread(target=user, args=(k,)) for k in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert shapes == {(1, 77)}


def test_a_process_that_drops_its_engine_at_once_exits_cleanly(tmp_path):
    # The preview map is still being fitted (in JAX) when this process ends: it must wait, not crash.
    code = """
        from engine import load_pipeline
        pipe = load_pipeline()
        print("loaded")
        """
    assert run_with_devices(1, code, tmp_path).split()[-1] == "loaded"
