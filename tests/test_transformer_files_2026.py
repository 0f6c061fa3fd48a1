"""Z-Image and FLUX.2 [klein] transformer files, and FLUX.1 Kontext [dev] files, each loaded with a tiny diffusers
folder as `config=` for the rest (the folders of tests/test_z_image.py and tests/test_flux2_klein.py).

Each tiny transformer written by diffusers is turned into its original layout by the inverse of diffusers' table,
written out below: ComfyUI's Z-Image (`z_image_turbo_bf16.safetensors`: fused `attention.qkv`, `attention.out`,
`x_embedder`, `final_layer`, and the unused `norm_final`) and BFL's FLUX.2 (`flux-2-klein-4b.safetensors`: fused
double-block q/k/v, `*.lin` modulations, `final_layer.adaLN_modulation.1` shift-then-scale). diffusers' own
`convert_*_transformer_checkpoint_to_diffusers` maps each file back to the diffusers tensors exactly, so the files
are in the original layout. Loaded through our transformer-file path, the param tree equals the folder's bit for bit
(the folder engines' pictures match diffusers' in test_z_image and test_flux2_klein); so do diffusers-layout files,
and `--quantize int8` and w8a8 quantize a file's transformer as they do the folder's. GGUFs as city96's converter
writes them (general.architecture "lumina2" for Z-Image, "flux" for FLUX.2's BFL keys): Q8_0 kernels kept as int8
with the file's values and block scales, F16 as its values. A FLUX.1-dev file with a Kontext folder as config= is a
Kontext model. Refused by name: a config of another family, a file whose widths are not the config's, a GGUF of the
wrong architecture, and (without config=) a FLUX.2 of a width no [klein] has (a file of no known layout:
tests/test_gguf_files.py, whose message lists these kinds).
"""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest
import torch
from diffusers import Flux2Transformer2DModel, FluxKontextPipeline, ZImageTransformer2DModel
from diffusers.loaders.single_file_utils import (
    convert_flux2_transformer_checkpoint_to_diffusers,
    convert_z_image_transformer_checkpoint_to_diffusers,
)
from flax import nnx
from gguf import GGMLQuantizationType as Q
from reference import randomize
from safetensors.numpy import save_file
from test_flux2_klein import TRANSFORMER as KLEIN
from test_flux2_klein import build_reference as build_klein
from test_gguf_files import q8_types, write_gguf
from test_transformer_files import assert_same_params, flat, make_flux, numpy_state, swap_halves
from test_z_image import TRANSFORMER as Z_IMAGE
from test_z_image import build_reference as build_z_image

from engine.errors import SourceError, WeightsError
from engine.families.loader import load_model_folder
from engine.families.transformer_file import KLEIN_REPOS, klein_repo
from engine.loading.quantize import Int8Kernel, computes_in_int8, is_quantized


def z_image_to_comfy(sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """diffusers' ZImageTransformer2DModel names -> ComfyUI's: the inverse of diffusers' published table, with the
    final norm ComfyUI's NextDiT holds and never applies (diffusers' converter drops it)."""
    out = {}
    for name, array in sd.items():
        if ".attention.to_k." in name or ".attention.to_v." in name:
            continue
        if ".attention.to_q." in name:
            parts = [sd[name.replace(".to_q.", f".to_{x}.")] for x in "qkv"]
            name, array = name.replace(".to_q.", ".qkv."), np.concatenate(parts)
        for ours, theirs in (
            ("all_x_embedder.2-1.", "x_embedder."),
            ("all_final_layer.2-1.", "final_layer."),
            (".attention.to_out.0.", ".attention.out."),
            (".attention.norm_q.", ".attention.q_norm."),
            (".attention.norm_k.", ".attention.k_norm."),
        ):
            name = name.replace(ours, theirs)
        out[name] = array
    assert sum(v.size for v in out.values()) == sum(v.size for v in sd.values())  # every tensor, once
    out["norm_final.weight"] = np.ones(sd["all_x_embedder.2-1.bias"].shape, np.float32)
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def klein_to_bfl(sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """diffusers' Flux2Transformer2DModel names -> BFL's FLUX.2 names: the inverse of diffusers' published table."""
    top = {
        "x_embedder": "img_in",
        "context_embedder": "txt_in",
        "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
        "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
        "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
        "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
        "single_stream_modulation.linear": "single_stream_modulation.lin",
        "proj_out": "final_layer.linear",
    }
    double = {
        "attn.to_out.0.weight": "img_attn.proj.weight",
        "attn.to_add_out.weight": "txt_attn.proj.weight",
        "ff.linear_in.weight": "img_mlp.0.weight",
        "ff.linear_out.weight": "img_mlp.2.weight",
        "ff_context.linear_in.weight": "txt_mlp.0.weight",
        "ff_context.linear_out.weight": "txt_mlp.2.weight",
        "attn.norm_q.weight": "img_attn.norm.query_norm.scale",
        "attn.norm_k.weight": "img_attn.norm.key_norm.scale",
        "attn.norm_added_q.weight": "txt_attn.norm.query_norm.scale",
        "attn.norm_added_k.weight": "txt_attn.norm.key_norm.scale",
    }
    single = {
        "attn.to_qkv_mlp_proj.weight": "linear1.weight",
        "attn.to_out.weight": "linear2.weight",
        "attn.norm_q.weight": "norm.query_norm.scale",
        "attn.norm_k.weight": "norm.key_norm.scale",
    }
    out = {f"{theirs}.weight": sd[f"{ours}.weight"] for ours, theirs in top.items()}
    out["final_layer.adaLN_modulation.1.weight"] = swap_halves(sd["norm_out.linear.weight"])
    for i in range(KLEIN["num_layers"]):
        d, b = f"transformer_blocks.{i}", f"double_blocks.{i}"
        out |= {f"{b}.{theirs}": sd[f"{d}.{ours}"] for ours, theirs in double.items()}
        out[f"{b}.img_attn.qkv.weight"] = np.concatenate([sd[f"{d}.attn.to_{x}.weight"] for x in "qkv"])
        out[f"{b}.txt_attn.qkv.weight"] = np.concatenate([sd[f"{d}.attn.add_{x}_proj.weight"] for x in "qkv"])
    for i in range(KLEIN["num_single_layers"]):
        d, b = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        out |= {f"{b}.{theirs}": sd[f"{d}.{ours}"] for ours, theirs in single.items()}
    assert sum(v.size for v in out.values()) == sum(v.size for v in sd.values())  # every tensor, once
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def assert_diffusers_converts_back(original: dict[str, np.ndarray], converter, want: dict[str, np.ndarray]) -> None:
    """diffusers' own converter maps the file's tensors to the diffusers tensors exactly: the file is in the layout
    it reads."""
    back = converter({k: torch.from_numpy(v.copy()) for k, v in original.items()})
    assert back.keys() == want.keys()
    for name, tensor in back.items():
        assert np.array_equal(tensor.numpy(), want[name]), name


# family -> (diffusers' transformer class and tiny config, our inverse table, diffusers' converter, the GGUF
# architecture city96's converter writes for the original layout)
FAMILIES = {
    "z-image": (
        ZImageTransformer2DModel,
        Z_IMAGE,
        z_image_to_comfy,
        convert_z_image_transformer_checkpoint_to_diffusers,
    ),
    "flux2": (Flux2Transformer2DModel, KLEIN, klein_to_bfl, convert_flux2_transformer_checkpoint_to_diffusers),
}
ARCHITECTURE = {"z-image": "lumina2", "flux2": "flux"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request, tmp_path_factory):
    """A family's tiny folder, its transformer in the original layout (tensors and file) and the folder's params."""
    family = request.param
    _, _, to_original, converter = FAMILIES[family]
    root = tmp_path_factory.mktemp(family)
    reference = build_z_image(tmp_path_factory) if family == "z-image" else build_klein(root / "parts")
    folder = root / "folder"
    reference.save_pretrained(folder)
    diffusers_sd = numpy_state(reference.transformer)
    original = to_original(diffusers_sd)
    assert_diffusers_converts_back(original, converter, diffusers_sd)
    file = root / f"{family}.safetensors"
    save_file(original, str(file))
    return family, folder, original, file, load_model_folder(folder, "float32")


def test_an_original_layout_file_loads_the_folders_weights_exactly(model):
    """The whole model: every weight, and what the folder says beside them (Turbo, distilled, defaults)."""
    family, folder, _, file, want = model
    from_file = load_model_folder(file, "float32", config=folder)
    assert (from_file.family, from_file.name) == (family, str(file))
    fields = ("variant", "label", "defaults", "guided", "denoiser_config", "scheduler_config")
    assert [getattr(from_file, f) for f in fields] == [getattr(want, f) for f in fields]
    assert_same_params(from_file.params, want.params)


def test_a_diffusers_layout_file_loads_the_same(model, tmp_path):
    _, folder, _, _, want = model
    file = tmp_path / "transformer.safetensors"
    shutil.copy(folder / "transformer" / "diffusion_pytorch_model.safetensors", file)
    got = load_model_folder(file, "float32", config=folder).params["transformer"]
    assert_same_params(got, want.params["transformer"])


def assert_same_quantized(got, want) -> None:
    """Same paths, leaf kinds (int8 kernels of either kind among them) and every array's bytes."""
    got, want = (dict(nnx.to_flat_state(tree)) for tree in (got, want))
    assert got.keys() == want.keys()
    for path, var in want.items():
        have, expected = got[path].get_value(), var.get_value()
        assert type(have) is type(expected), path
        for a, b in zip(jax.tree.leaves(have), jax.tree.leaves(expected), strict=True):
            a, b = np.asarray(a), np.asarray(b)
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), path


@pytest.mark.parametrize("quantize", ["int8", "w8a8"])
def test_quantize_takes_a_files_transformer_as_it_takes_the_folders(model, quantize):
    _, folder, _, file, _ = model
    got = load_model_folder(file, "float32", config=folder, quantize=quantize).params
    assert_same_quantized(got, load_model_folder(folder, "float32", quantize=quantize).params)
    assert (is_quantized if quantize == "int8" else computes_in_int8)(got["transformer"])


def test_a_q8_0_gguf_keeps_its_int8_values_and_block_scales(model, tmp_path):
    family, folder, original, _, _ = model
    file = tmp_path / f"{family}-Q8_0.gguf"
    values = write_gguf(file, original, q8_types(original), architecture=ARCHITECTURE[family])
    dequantized = tmp_path / "values.safetensors"  # the same values, unquantized: where each lands
    save_file(values, str(dequantized))
    got = load_model_folder(file, "float32", config=folder).params["transformer"]
    want = flat(load_model_folder(dequantized, "float32", config=folder).params["transformer"])
    kept = 0
    for path, var in nnx.to_flat_state(got):
        name, leaf = "/".join(map(str, path)), var.get_value()
        if isinstance(leaf, Int8Kernel):  # int8 [in, out], one scale per 32 inputs of each output
            assert leaf.scale.shape == (leaf.values.shape[0] // 32, leaf.values.shape[1])
            assert np.array_equal(np.asarray(leaf.dequantize()), want[name]), name
            kept += 1
        else:
            assert np.array_equal(np.asarray(leaf), want[name]), name
    # every linear kernel whose inputs are whole blocks of 32 (the fused q/k/v's rows cut as they are in the file)
    assert kept == sum(1 for k, v in want.items() if k.endswith("/kernel") and v.shape[0] % 32 == 0) > 5


def test_an_f16_gguf_loads_its_values(model, tmp_path):
    family, folder, original, _, _ = model
    file = tmp_path / f"{family}-F16.gguf"
    types = {name: Q.F16 if array.ndim == 2 else Q.F32 for name, array in original.items()}
    values = write_gguf(file, original, types, architecture=ARCHITECTURE[family])
    dequantized = tmp_path / "values.safetensors"
    save_file(values, str(dequantized))
    got = load_model_folder(file, "float32", config=folder).params["transformer"]
    assert_same_params(got, load_model_folder(dequantized, "float32", config=folder).params["transformer"])


def test_a_flux1_dev_file_with_a_kontext_folder_is_a_kontext_model(tmp_path_factory):
    reference, folder, _, file = make_flux(tmp_path_factory)
    kontext = folder.parent / "kontext"
    FluxKontextPipeline(**reference.components).save_pretrained(kontext)
    got = load_model_folder(file, "float32", config=kontext)
    assert (got.family, got.variant.label) == ("flux_kontext", "FLUX.1 Kontext")
    assert_same_params(got.params, load_model_folder(kontext, "float32").params)


# Refusals


def test_a_config_of_another_family_is_refused(model):
    family, _, _, file, _ = model
    label = {"z-image": "Z-Image", "flux2": r"FLUX.2 \[klein\]"}[family]
    with pytest.raises(SourceError, match=f"is a {label} transformer, but its config .* of another kind"):
        load_model_folder(file, "float32", config="engine/assets/default")


def test_a_file_whose_widths_are_not_the_configs_is_refused(model, tmp_path):
    """The same family 48 wide (3 heads of 16) against the folder's 32."""
    family, folder, _, _, _ = model
    cls, config, to_original, _ = FAMILIES[family]
    wider = {**config, "n_heads": 3, "n_kv_heads": 3, "dim": 48} if family == "z-image" else config
    wider = {**wider, "num_attention_heads": 3} if family == "flux2" else wider
    file = tmp_path / "wider.safetensors"
    save_file(to_original(numpy_state(randomize(cls(**wider), 3))), str(file))
    with pytest.raises(WeightsError, match=r"wider.safetensors: the weights do not fit .*\n.*mis-shaped"):
        load_model_folder(file, "float32", config=folder)


def test_a_gguf_of_the_wrong_architecture_is_refused(model, tmp_path):
    family, folder, original, _, _ = model
    file = tmp_path / "wrong.gguf"
    wrong = {"z-image": "flux", "flux2": "lumina2"}[family]
    write_gguf(file, original, {name: Q.F32 for name in original}, architecture=wrong)
    with pytest.raises(SourceError, match=f"wrong.gguf: a GGUF file of architecture '{wrong}' holding a"):
        load_model_folder(file, "float32", config=folder)


def test_without_config_the_repo_is_diffusers_choice_or_a_klein_of_the_files_width(model, monkeypatch):
    """Z-Image: Tongyi-MAI/Z-Image-Turbo, fetched without its transformer's weights (a stand-in Hub whose snapshot is
    the tiny folder). FLUX.2: [klein] 4B (24 heads of 128) or 9B (32 heads), as published; the tiny one's width is
    neither, and needs config=."""
    import huggingface_hub

    family, folder, _, file, want = model
    assert klein_repo({"img_in.weight": (3072, 128)}) == KLEIN_REPOS[3072] == "black-forest-labs/FLUX.2-klein-4B"
    assert klein_repo({"x_embedder.weight": (4096, 128)}) == "black-forest-labs/FLUX.2-klein-9B"
    if family == "flux2":
        with pytest.raises(SourceError, match=r"FLUX.2 \[klein\] transformer of a width .* config=DIR"):
            load_model_folder(file, "float32")
        return
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    asked = []
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo_id: files)
    monkeypatch.setattr(
        huggingface_hub, "snapshot_download", lambda repo_id, **kw: asked.append(repo_id) or str(folder)
    )
    assert_same_params(load_model_folder(file, "float32").params, want.params)
    assert asked == ["Tongyi-MAI/Z-Image-Turbo"]
