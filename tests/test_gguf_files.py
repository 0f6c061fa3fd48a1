"""GGUF transformer files, as city96's converter writes them for ComfyUI-GGUF (general.architecture, BFL's names),
written here with the `gguf` package from the tiny FLUX.1-dev of tests/test_transformer_files.py.

Q8_0 loads as int8 kernels holding the file's int8 values and block scales exactly, and draws diffusers' pictures
of Q8_0's values within 1/255 (and within a PSNR bound of the unquantized folder's: the tolerance int8 allows); a
tensor reshaped to be quantized (`comfy.gguf.orig_shape`) loads in its own shape; Q4_K (blocks made here: gguf writes
no K-quant), Q4_0, Q5_0, BF16, F16 and F32 load as exactly gguf's dequantized values. A GGUF of an architecture not
served and a truncated one are refused by name.
"""

from __future__ import annotations

import gguf
import ml_dtypes
import numpy as np
import pytest
import torch
from diffusers import FluxPipeline
from flax import nnx
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import save_file
from test_flux import PROMPT, run_reference
from test_transformer_files import GUIDANCE, SIZE, STEPS, assert_same_params, flat, make_flux

from engine import load_pipeline
from engine.errors import SourceError
from engine.families.loader import load_model_folder
from engine.loading.quantize import Int8Kernel

# PSNR (dB) of the Q8_0 file's pictures against diffusers' of the unquantized folder: measured 64.0 (max 0.76/255)
Q8_PSNR_BOUND = 60.0


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    return make_flux(tmp_path_factory)


def write_gguf(
    path, tensors: dict[str, np.ndarray], types: dict[str, Q], architecture: str = "flux", reshaped: tuple = ()
) -> dict:
    """A GGUF as city96's converter writes one: general.architecture and the BFL names, each tensor of `types`
    (raw Q4_K blocks where given as uint8); those `reshaped` stored as rows of 32 values with their shape in
    `comfy.gguf.orig_shape.NAME`, as the converter quantizes a tensor whose rows are not whole blocks. Returns each
    tensor's values as gguf dequantizes them (f32, in its own shape)."""
    writer = gguf.GGUFWriter(str(path), arch=architecture)
    values = {}
    for name, array in tensors.items():
        kind = types[name]
        if name in reshaped:
            writer.add_array(f"comfy.gguf.orig_shape.{name}", list(array.shape))
            data = gguf.quants.quantize(array.reshape(-1, 32).astype(np.float32), kind)
            writer.add_tensor(name, data, raw_dtype=kind)
            values[name] = gguf.quants.dequantize(data, kind).reshape(array.shape)
            continue
        if kind in (Q.F32, Q.F16):
            data = array.astype(np.float32 if kind == Q.F32 else np.float16)
            writer.add_tensor(name, data)
        else:
            data = array if array.dtype == np.uint8 else gguf.quants.quantize(array.astype(np.float32), kind)
            writer.add_tensor(name, data, raw_dtype=kind)
        values[name] = gguf.quants.dequantize(data, kind).astype(np.float32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values


def q8_types(bfl: dict[str, np.ndarray]) -> dict[str, Q]:
    """city96's Q8_0 file: 2-D weights whose rows are whole blocks of 32 as Q8_0, the rest (biases, norms) F32."""
    return {k: Q.Q8_0 if v.ndim == 2 and v.shape[1] % 32 == 0 else Q.F32 for k, v in bfl.items()}


def test_a_q8_0_gguf_keeps_its_int8_values_and_block_scales_exactly(flux, tmp_path):
    _, folder, bfl, _ = flux
    file = tmp_path / "flux1-dev-Q8_0.gguf"
    values = write_gguf(file, bfl, q8_types(bfl))
    dequantized = tmp_path / "q8-values.safetensors"  # the same values, unquantized: where each lands
    save_file(values, str(dequantized))
    got = load_model_folder(file, "float32", config=folder).params["transformer"]
    want = flat(load_model_folder(dequantized, "float32", config=folder).params["transformer"])
    int8 = {"/".join(map(str, p)) for p, v in nnx.to_flat_state(got) if isinstance(v.get_value(), Int8Kernel)}
    # every linear kernel but the context embedder's (40 inputs: not whole blocks of 32, so F32 in the file)
    linear = {name for name, v in want.items() if name.endswith("/kernel") and v.ndim == 2}
    assert int8 == linear - {"context_embedder/kernel"}
    for path, var in nnx.to_flat_state(got):
        name, leaf = "/".join(map(str, path)), var.get_value()
        if isinstance(leaf, Int8Kernel):  # int8 [in, out], one f32 scale per 32 inputs of each output
            assert leaf.values.dtype == np.int8 and leaf.scale.shape == (
                leaf.values.shape[0] // 32,
                leaf.values.shape[1],
            )
            assert np.array_equal(np.asarray(leaf.dequantize()), want[name]), name
        else:
            assert np.array_equal(np.asarray(leaf), want[name]), name
    bf16 = load_model_folder(file, "bfloat16", config=folder).params["transformer"]
    kernel = bf16["x_embedder"]["kernel"].get_value()  # a bf16 run: each f16 scale rounded to bf16, and the
    assert kernel.scale.dtype == ml_dtypes.bfloat16  # product too: twice bf16's unit roundoff (2^-8) at most
    np.testing.assert_allclose(np.asarray(kernel.dequantize(), np.float32), want["x_embedder/kernel"], rtol=2**-7)


def test_a_q8_0_tensor_reshaped_to_be_quantized_loads_in_its_own_shape(flux, tmp_path):
    """The context embedder's 40 inputs are not whole blocks: stored as rows of 32 with its original shape beside,
    it loads as its values (its blocks cross its rows, so no block scales per row), the others as int8."""
    _, folder, bfl, _ = flux
    types = {**q8_types(bfl), "txt_in.weight": Q.Q8_0}
    file = tmp_path / "flux1-dev-Q8_0-reshaped.gguf"
    values = write_gguf(file, bfl, types, reshaped=("txt_in.weight",))
    dequantized = tmp_path / "values.safetensors"
    save_file(values, str(dequantized))
    got = load_model_folder(file, "float32", config=folder).params["transformer"]
    want = load_model_folder(dequantized, "float32", config=folder).params["transformer"]
    assert np.array_equal(got["context_embedder"]["kernel"].get_value(), want["context_embedder"]["kernel"].get_value())
    assert isinstance(got["x_embedder"]["kernel"].get_value(), Int8Kernel)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    return float(10 * np.log10(1.0 / np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)))


def q8_0_values(transformer: torch.nn.Module) -> torch.nn.Module:
    """A copy of diffusers' transformer holding Q8_0's values: each weight whose rows are whole blocks quantized and
    dequantized by gguf row by row (rows picked from a fused q/k/v projection are quantized as in it)."""
    import copy

    out = copy.deepcopy(transformer)
    with torch.no_grad():
        for p in out.parameters():
            if p.ndim == 2 and p.shape[1] % 32 == 0:
                blocks = gguf.quants.quantize(p.numpy(), Q.Q8_0)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, Q.Q8_0)))
    return out


def test_a_q8_0_gguf_draws_as_diffusers_with_its_values(flux, tmp_path):
    """Equal within 1/255 to diffusers running Q8_0's values; against the unquantized folder, the PSNR bound."""
    reference, folder, bfl, _ = flux
    file = tmp_path / "flux1-dev-Q8_0.gguf"
    write_gguf(file, bfl, q8_types(bfl))
    start = np.random.default_rng(0).standard_normal((2, 16, SIZE // 2, SIZE // 2)).astype(np.float32)
    args = dict(num_inference_steps=STEPS, guidance_scale=GUIDANCE)
    unquantized = run_reference(reference, start, SIZE, SIZE, **args)
    q8_0 = FluxPipeline(**{**reference.components, "transformer": q8_0_values(reference.transformer)})
    want = run_reference(q8_0, start, SIZE, SIZE, **args)
    engine = load_pipeline(file, config=folder, safety_checker=False, previews=False)
    try:
        got = engine.generate(PROMPT, height=SIZE, width=SIZE, num_images=2, latents=start, **args).arrays
    finally:
        engine.close()
    assert np.abs(got - want).max() < 1 / 255
    measured = psnr(got, unquantized)
    print(f"Q8_0 GGUF: PSNR {measured:.1f} dB, max error {np.abs(got - unquantized).max() * 255:.2f}/255")
    assert measured > Q8_PSNR_BOUND
    assert np.abs(got - unquantized).max() > 0  # quantized: not the same arrays by accident


def q4_k_blocks(rows: int, columns: int, seed: int) -> np.ndarray:
    """Random Q4_K super-blocks (256 values in 144 bytes: f16 d and dmin, 12 bytes of 6-bit scales and mins, 128 of
    4-bit values) with small d and dmin, as raw bytes [rows, columns / 256 * 144]."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, columns // 256, 144), dtype=np.uint8)
    blocks[:, :, 0:2] = np.frombuffer(np.float16(2e-4).tobytes(), np.uint8)
    blocks[:, :, 2:4] = np.frombuffer(np.float16(1e-4).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def test_k_quants_and_the_other_types_load_as_ggufs_own_dequantized_values(flux, tmp_path):
    _, folder, bfl, _ = flux
    tensors, types, cycle = dict(bfl), {}, [Q.Q4_0, Q.Q5_0, Q.BF16]
    for n, (name, array) in enumerate(sorted(bfl.items())):
        if array.ndim == 2 and array.shape[1] % 256 == 0:
            tensors[name], types[name] = q4_k_blocks(array.shape[0], array.shape[1], n), Q.Q4_K
        elif array.ndim == 2 and array.shape[1] % 32 == 0:
            types[name] = cycle[n % 3]
        else:
            types[name] = Q.F16 if array.ndim == 1 else Q.F32
    assert {Q.Q4_K, Q.Q4_0, Q.Q5_0, Q.BF16, Q.F16, Q.F32} <= set(types.values())
    file = tmp_path / "flux1-dev-mixed.gguf"
    values = write_gguf(file, tensors, types)
    dequantized = tmp_path / "mixed-values.safetensors"
    save_file(values, str(dequantized))
    got = load_model_folder(file, "float32", config=folder).params["transformer"]
    assert_same_params(got, load_model_folder(dequantized, "float32", config=folder).params["transformer"])


def test_a_gguf_of_an_architecture_not_served_is_refused_by_name(flux, tmp_path):
    _, folder, bfl, _ = flux
    file = tmp_path / "sdxl.gguf"
    write_gguf(
        file, {"input_blocks.0.0.weight": np.zeros((64, 32), np.float32)}, {"input_blocks.0.0.weight": Q.F32}, "sdxl"
    )
    with pytest.raises(SourceError, match=r"sdxl.gguf: a GGUF file of architecture 'sdxl'.*FLUX.1 \(flux\)"):
        load_pipeline(file, config=folder, safety_checker=False)


def test_a_truncated_gguf_is_refused_by_name(flux, tmp_path):
    _, folder, bfl, _ = flux
    whole = tmp_path / "whole.gguf"
    write_gguf(whole, bfl, q8_types(bfl))
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    with pytest.raises(SourceError, match="cut.gguf: not a readable GGUF file"):
        load_pipeline(cut, config=folder, safety_checker=False)


def test_a_gguf_of_no_known_layout_is_refused_with_what_it_holds(flux, tmp_path):
    _, folder, _, _ = flux
    unknown = tmp_path / "unknown.gguf"
    write_gguf(unknown, {"blocks.0.w": np.zeros((4, 32), np.float32)}, {"blocks.0.w": Q.F32})
    with pytest.raises(
        SourceError, match=r"not a FLUX.1, Stable Diffusion 3, Z-Image, FLUX.2 \[klein\] transformer.*blocks.0"
    ):
        load_model_folder(unknown, "float32", config=folder)
