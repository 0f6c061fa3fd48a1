"""`--quantize int8` quantizes each kernel as the loader reads it (engine/loading/weights.py `convert(quantized=)`,
engine/loading/quantize.py `streaming`), so a load never holds the float model beside its int8 copy.

What is proven: the tree loaded that way is bit for bit the one quantizing the loaded float tree gives
(`quantize_params` on the devices' components, `quantize_module` on a host encoder's), for the tiny Z-Image and FLUX.2
[klein] folders, in f32 and bf16; and `load_pipeline(quantize="int8")`'s numpy allocations (tracemalloc) on a Z-Image
folder whose transformer weighs 77 MB in f32 peak at its int8 bytes plus a few kernels in flight, far below the float
transformer that quantizing after the load held first.
"""

from __future__ import annotations

import shutil
import tracemalloc

import jax
import numpy as np
import pytest
from diffusers import ZImageTransformer2DModel
from flax import nnx
from test_qwen3_int8 import FOLDERS
from test_z_image import TRANSFORMER

from engine import load_pipeline
from engine.families import FAMILIES
from engine.families.loader import load_model_folder
from engine.families.qwen_prompt import FLUX2_KLEIN, Z_IMAGE
from engine.loading import weights
from engine.loading.host_encoder import host_qwen3
from engine.loading.quantize import Int8Kernel, int8_components, param_bytes, quantize_module, quantize_params
from engine.loading.weights import read_safetensors
from engine.models.qwen3 import Qwen3Config


def flat(tree) -> dict[tuple, object]:
    return {path: var.get_value() for path, var in nnx.to_flat_state(tree)}


def assert_same_tree(got, expected) -> None:
    """Same paths, leaf kinds, dtypes and bytes: int8 values and scales alike."""
    got, expected = flat(got), flat(expected)
    assert got.keys() == expected.keys()
    for path, want in expected.items():
        have = got[path]
        assert type(have) is type(want), path
        pairs = (
            [(have.values, want.values), (have.scale, want.scale)] if isinstance(want, Int8Kernel) else [(have, want)]
        )
        for a, b in pairs:
            a, b = np.asarray(a), np.asarray(b)
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), path


@pytest.fixture(scope="module", params=sorted(FOLDERS))
def folder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    FOLDERS[request.param][0](path)
    return request.param, path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernels_quantized_as_read_equal_the_loaded_tree_quantized(folder, dtype):
    """bf16 (the accelerators' dtype) stores the scales in bf16, rounded up where rounding made them smaller."""
    family, path = folder
    record = FAMILIES[family]
    chosen = int8_components(record.denoiser.component, record.configs, "int8")
    after = quantize_params(load_model_folder(path, dtype).params, chosen)
    streamed = load_model_folder(path, dtype, quantize="int8").params
    assert sum(isinstance(x, Int8Kernel) for x in flat(streamed).values()) > 10
    assert_same_tree(streamed, after)


def test_a_host_encoder_quantized_as_read_equals_its_loaded_tree_quantized(folder):
    family, path = folder
    prompt = Z_IMAGE if family == "z-image" else FLUX2_KLEIN
    cfg = Qwen3Config.from_json(path / "text_encoder" / "config.json")
    tensors = read_safetensors(sorted((path / "text_encoder").glob("*.safetensors")))
    plain = host_qwen3("text_encoder", cfg, tensors, "float32", "tiny", prompt.hidden_layers)
    streamed = host_qwen3("text_encoder", cfg, tensors, "float32", "tiny", prompt.hidden_layers, int8=True)
    assert any(isinstance(x, Int8Kernel) for x in flat(streamed.params).values())
    assert_same_tree(jax.device_get(streamed.params), jax.device_get(quantize_module(plain.params)))


def test_loading_int8_holds_the_int8_model_and_a_few_kernels_not_the_float_one(tmp_path, monkeypatch):
    """16 transformer layers of width 256 (head width 16, as the tiny one's): 19M weights, 77 MB in f32, 20 MB with
    int8. Quantizing after the load peaked at 116 MB here (the f32 tree, then its int8 copy beside it)."""
    folder = tmp_path / "model"
    FOLDERS["z-image"][0](folder)
    shutil.rmtree(folder / "transformer")
    larger = {**TRANSFORMER, "dim": 256, "n_heads": 16, "n_kv_heads": 16, "n_layers": 16}
    ZImageTransformer2DModel(**larger).save_pretrained(folder / "transformer")
    monkeypatch.setattr(weights, "LOAD_THREADS", 2)  # a free Space's, and the same on any machine
    tracemalloc.start()  # numpy reports its arrays' memory to it; the mapped files are not allocations
    try:
        engine = load_pipeline(folder, dtype="float32", quantize="int8", safety_checker=False, previews=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    engine.close()
    tensors = read_safetensors(sorted((folder / "transformer").glob("*.safetensors")))
    float_transformer = sum(a.nbytes for a in tensors.values())
    chosen = int8_components("transformer", FAMILIES["z-image"].configs, "int8")
    held = param_bytes(quantize_params(load_model_folder(folder, "float32").params, chosen))  # the int8 model
    # Each loading thread holds one kernel's f32 copy, the copy quantize_kernel works in, and its int8 values.
    in_flight = 2 * 3 * max(a.size * 4 for a in tensors.values())
    print(f"peak {peak / 1e6:.1f} MB; int8 model {held / 1e6:.1f} MB; f32 transformer {float_transformer / 1e6:.1f} MB")
    assert float_transformer > 70e6 and held + in_flight < float_transformer / 2
    assert peak < held + in_flight + 4e6
