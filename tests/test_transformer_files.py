"""FLUX.1 and SD 3.5 transformer files: Black Forest Labs' and Stability's original layouts, diffusers' layout, fp8
(plain and ComfyUI's scaled) and all-in-one files, each loaded with a diffusers folder of the same model as `config=`
for the rest (GGUF: tests/test_gguf_files.py, on the same tiny model).

A tiny FLUX.1-dev written by diffusers has its transformer converted to BFL's layout by the inverse of the published
table (diffusers' `convert_flux_transformer_checkpoint_to_diffusers`, written out below) and saved as one
.safetensors: our param tree equals the folder's bit for bit and our pictures equal diffusers' FluxPipeline's within
1/255. The same tensors in fp8 load as their fp8 values widened, scaled fp8 as their products; an all-in-one file
brings every weight itself. A tiny SD 3.5 (QK-norm, dual attention) in Stability's MMDiT layout loads the folder's
params exactly. Truncated files and files of unknown or partial layout are refused by name, and so is a config of
another family; offline without a config, the message names the Hub repo and config=.
"""

from __future__ import annotations

import shutil

import ml_dtypes
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from flax import nnx
from reference import CLIP_LAYOUTS, randomize
from safetensors.numpy import save_file
from t5_reference import save_tiny_t5_tokenizer, tiny_t5_encoder
from test_flux import PROMPT, SCHEDULERS, VAE, WORDS, run_reference
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5TokenizerFast

from engine import load_pipeline
from engine.errors import ConfigError, SourceError
from engine.families.loader import load_model_folder
from engine.loading.quantize import Int8Kernel
from tools.tiny_tokenizer import write_tokenizer

SIZE, STEPS, GUIDANCE = 32, 2, 3.5
# 4 heads of 16: an inner width of 64 and an MLP of 256, so the MLP's output projections (and the timestep
# embedder's input, 256 sinusoids) read 256 inputs: one K-quant super-block per row
TRANSFORMER = dict(
    patch_size=1,
    in_channels=64,
    num_layers=1,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=40,
    pooled_projection_dim=32,
    axes_dims_rope=(4, 4, 8),
    guidance_embeds=True,
)


def build_flux() -> FluxPipeline:
    import tempfile

    clip_dir, t5_dir = tempfile.mkdtemp(), tempfile.mkdtemp()
    vocab = write_tokenizer(clip_dir, WORDS)
    clip = CLIPTextConfig(
        **CLIP_LAYOUTS["sd1"],
        **dict(vocab_size=vocab, max_position_embeddings=77, bos_token_id=vocab - 2, eos_token_id=vocab - 1),
        pad_token_id=vocab - 1,
    )
    t5 = dict(d_model=40, d_kv=8, num_heads=4, d_ff=64, num_layers=2, feed_forward_proj="gated-gelu")
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULERS["dev"]),
        vae=randomize(AutoencoderKL(**VAE, scaling_factor=0.3611, shift_factor=0.1159), 4, std=0.05),
        text_encoder=randomize(CLIPTextModel(clip), 1),
        tokenizer=CLIPTokenizer.from_pretrained(clip_dir),
        text_encoder_2=tiny_t5_encoder(save_tiny_t5_tokenizer(t5_dir), 5, **t5),
        tokenizer_2=T5TokenizerFast.from_pretrained(t5_dir),
        transformer=randomize(FluxTransformer2DModel(**TRANSFORMER), 3, std=0.05),
    )


def swap_halves(w: np.ndarray) -> np.ndarray:
    first, second = np.split(w, 2, axis=0)
    return np.concatenate([second, first], axis=0)


def flux_to_bfl(sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """diffusers' FluxTransformer2DModel names -> BFL's: the inverse of diffusers' published table."""
    out = {}
    top = {
        "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
        "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
        "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
        "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
        "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
        "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
        "context_embedder": "txt_in",
        "x_embedder": "img_in",
        "proj_out": "final_layer.linear",
    }
    double = {
        "norm1.linear": "img_mod.lin",
        "norm1_context.linear": "txt_mod.lin",
        "ff.net.0.proj": "img_mlp.0",
        "ff.net.2": "img_mlp.2",
        "ff_context.net.0.proj": "txt_mlp.0",
        "ff_context.net.2": "txt_mlp.2",
        "attn.to_out.0": "img_attn.proj",
        "attn.to_add_out": "txt_attn.proj",
    }
    norms = {
        "norm_q": "img_attn.norm.query_norm",
        "norm_k": "img_attn.norm.key_norm",
        "norm_added_q": "txt_attn.norm.query_norm",
        "norm_added_k": "txt_attn.norm.key_norm",
    }
    for end in ("weight", "bias"):
        for ours, theirs in top.items():
            out[f"{theirs}.{end}"] = sd[f"{ours}.{end}"]
        out[f"final_layer.adaLN_modulation.1.{end}"] = swap_halves(sd[f"norm_out.linear.{end}"])
        for i in range(TRANSFORMER["num_layers"]):
            d, b = f"transformer_blocks.{i}", f"double_blocks.{i}"
            for ours, theirs in double.items():
                out[f"{b}.{theirs}.{end}"] = sd[f"{d}.{ours}.{end}"]
            out[f"{b}.img_attn.qkv.{end}"] = np.concatenate([sd[f"{d}.attn.to_{x}.{end}"] for x in "qkv"])
            out[f"{b}.txt_attn.qkv.{end}"] = np.concatenate([sd[f"{d}.attn.add_{x}_proj.{end}"] for x in "qkv"])
        for i in range(TRANSFORMER["num_single_layers"]):
            d, b = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
            out[f"{b}.modulation.lin.{end}"] = sd[f"{d}.norm.linear.{end}"]
            out[f"{b}.linear2.{end}"] = sd[f"{d}.proj_out.{end}"]
            parts = [sd[f"{d}.attn.to_{x}.{end}"] for x in "qkv"] + [sd[f"{d}.proj_mlp.{end}"]]
            out[f"{b}.linear1.{end}"] = np.concatenate(parts)
    for i in range(TRANSFORMER["num_layers"]):
        for ours, theirs in norms.items():
            out[f"double_blocks.{i}.{theirs}.scale"] = sd[f"transformer_blocks.{i}.attn.{ours}.weight"]
    for i in range(TRANSFORMER["num_single_layers"]):
        for x in "qk":
            name = "query_norm" if x == "q" else "key_norm"
            out[f"single_blocks.{i}.norm.{name}.scale"] = sd[f"single_transformer_blocks.{i}.attn.norm_{x}.weight"]
    assert sum(v.size for v in out.values()) == sum(v.size for v in sd.values())  # every tensor, once
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def numpy_state(module: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in module.state_dict().items()}


def make_flux(tmp_path_factory) -> tuple:
    """The diffusers pipeline, its folder, and its transformer as BFL's tensors and single file."""
    reference = build_flux()
    root = tmp_path_factory.mktemp("flux")
    folder = root / "folder"
    reference.save_pretrained(folder)
    bfl = flux_to_bfl(numpy_state(reference.transformer))
    file = root / "flux1-dev.safetensors"
    save_file(bfl, str(file))
    return reference, folder, bfl, file


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    return make_flux(tmp_path_factory)


def flat(params) -> dict[str, np.ndarray]:
    return {"/".join(map(str, path)): np.asarray(v.get_value()) for path, v in nnx.to_flat_state(params)}


def assert_same_params(got, want) -> None:
    got, want = flat(got), flat(want)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), name


def test_a_bfl_file_loads_the_folders_weights_exactly(flux):
    _, folder, _, file = flux
    from_file = load_model_folder(file, "float32", config=folder)
    assert (from_file.family, from_file.name, from_file.label) == ("flux", str(file), "FLUX.1")
    assert_same_params(from_file.params, load_model_folder(folder, "float32").params)


def test_a_bfl_file_draws_as_diffusers_folder(flux):
    reference, folder, _, file = flux
    start = np.random.default_rng(0).standard_normal((2, 16, SIZE // 2, SIZE // 2)).astype(np.float32)
    args = dict(num_inference_steps=STEPS, guidance_scale=GUIDANCE)
    want = run_reference(reference, start, SIZE, SIZE, **args)
    engine = load_pipeline(file, config=folder, safety_checker=False, previews=False)
    try:
        got = engine.generate(PROMPT, height=SIZE, width=SIZE, num_images=2, latents=start, **args).arrays
    finally:
        engine.close()
    assert want.std() > 0.02  # a picture, not a flat field
    assert np.abs(got - want).max() < 1 / 255


def test_a_diffusers_layout_transformer_file_loads_the_same(flux, tmp_path):
    _, folder, _, _ = flux
    file = tmp_path / "transformer.safetensors"
    file.write_bytes((folder / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes())
    got = load_model_folder(file, "float32", config=folder).params["transformer"]
    assert_same_params(got, load_model_folder(folder, "float32").params["transformer"])


def test_an_fp8_file_is_widened_at_load(flux, tmp_path):
    """Every tensor stored as float8_e4m3fn: the transformer holds exactly those values in the run dtype."""
    _, folder, bfl, _ = flux
    fp8 = {k: v.astype(ml_dtypes.float8_e4m3fn) for k, v in bfl.items()}
    file = tmp_path / "flux1-dev-fp8.safetensors"
    torch_file = {k: torch.from_numpy(v.view(np.uint8)).view(torch.float8_e4m3fn) for k, v in fp8.items()}
    from safetensors.torch import save_file as save_torch

    save_torch(torch_file, str(file))
    widened = tmp_path / "widened.safetensors"
    save_file({k: v.astype(np.float32) for k, v in fp8.items()}, str(widened))
    got = load_model_folder(file, "float32", config=folder).params["transformer"]
    assert_same_params(got, load_model_folder(widened, "float32", config=folder).params["transformer"])
    original = flat(load_model_folder(folder, "float32").params["transformer"])
    assert any(not np.array_equal(flat(got)[k], original[k]) for k in original)  # fp8 rounded them


# Refusals


def test_truncated_files_are_refused_by_name(flux, tmp_path):
    _, folder, bfl, file = flux
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(SourceError, match="cut.safetensors is not a safetensors file"):
        load_pipeline(cut, config=folder, safety_checker=False)


def test_files_of_unknown_or_partial_layout_are_refused_with_what_they_hold(flux, tmp_path):
    _, folder, bfl, _ = flux
    extra = tmp_path / "extra.safetensors"
    save_file({**bfl, "double_blocks.0.img_attn.lora_down.weight": np.zeros((4, 64), np.float32)}, str(extra))
    with pytest.raises(SourceError, match=r"not a whole FLUX.1 transformer.*unknown double_blocks.0.img_attn.lora"):
        load_model_folder(extra, "float32", config=folder)
    partial = tmp_path / "partial.safetensors"
    save_file({"double_blocks.0.img_attn.norm.key_norm.scale": np.zeros(4, np.float32)}, str(partial))
    with pytest.raises(SourceError, match="not a whole FLUX.1 transformer: it lacks img_in.weight"):
        load_model_folder(partial, "float32", config=folder)
    with pytest.raises(ConfigError, match="prediction_type= is for SD 2.x"):
        load_model_folder(partial, "float32", config=folder, prediction_type="epsilon")


def test_a_config_of_another_family_is_refused(flux, tmp_path):
    _, folder, _, file = flux
    with pytest.raises(SourceError, match="FLUX.1 transformer, but its config .* of another kind"):
        load_model_folder(file, "float32", config="engine/assets/default")


def test_without_config_offline_the_message_names_the_repo_and_config(flux, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    def offline(*args, **kwargs):
        raise OfflineModeIsEnabled("offline")

    def not_cached(*args, **kwargs):
        raise LocalEntryNotFoundError("not cached")

    monkeypatch.setattr(huggingface_hub, "list_repo_files", offline)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", not_cached)
    _, _, _, file = flux
    with pytest.raises(SourceError, match=r"black-forest-labs/FLUX.1-dev.*config=DIR \(--config DIR\)"):
        load_model_folder(file, "float32")


def test_an_all_in_one_file_brings_its_own_vae_and_text_encoders(flux, tmp_path):
    """ComfyUI's all-in-one layout: the transformer under model.diffusion_model., the VAE in the original (LDM)
    layout under first_stage_model., CLIP-L and T5 under text_encoders.*.transformer.; the config folder holds
    configs and tokenizers only, so every weight comes from the file."""
    from test_single_file import vae_original

    reference, folder, bfl, _ = flux
    networks = {f"model.diffusion_model.{k}": v for k, v in bfl.items()}
    networks |= {f"first_stage_model.{k}": v.float().numpy() for k, v in vae_original(reference.vae).items()}
    for prefix, encoder in (("clip_l", reference.text_encoder), ("t5xxl", reference.text_encoder_2)):
        networks |= {f"text_encoders.{prefix}.transformer.{k}": v for k, v in numpy_state(encoder).items()}
    file = tmp_path / "flux1-dev-all-in-one.safetensors"
    save_file({k: np.ascontiguousarray(v) for k, v in networks.items()}, str(file))
    configs = tmp_path / "configs"
    shutil.copytree(folder, configs, ignore=shutil.ignore_patterns("*.safetensors"))
    assert_same_params(
        load_model_folder(file, "float32", config=configs).params, load_model_folder(folder, "float32").params
    )


SD3_LAYERS = 2


def sd3_to_mmdit(sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """diffusers' SD3Transformer2DModel names -> Stability's MMDiT names: the inverse of diffusers' published table
    (`convert_sd3_transformer_checkpoint_to_diffusers`), with SD 3.5's QK-norm and dual attention."""
    top = {
        "pos_embed.proj": "x_embedder.proj",
        "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
        "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
        "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
        "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2",
        "context_embedder": "context_embedder",
        "proj_out": "final_layer.linear",
    }
    block = {
        "attn.to_out.0": "x_block.attn.proj",
        "attn2.to_out.0": "x_block.attn2.proj",
        "norm1.linear": "x_block.adaLN_modulation.1",
        "ff.net.0.proj": "x_block.mlp.fc1",
        "ff.net.2": "x_block.mlp.fc2",
        "attn.to_add_out": "context_block.attn.proj",
        "ff_context.net.0.proj": "context_block.mlp.fc1",
        "ff_context.net.2": "context_block.mlp.fc2",
        "attn.norm_q": "x_block.attn.ln_q",
        "attn.norm_k": "x_block.attn.ln_k",
        "attn.norm_added_q": "context_block.attn.ln_q",
        "attn.norm_added_k": "context_block.attn.ln_k",
        "attn2.norm_q": "x_block.attn2.ln_q",
        "attn2.norm_k": "x_block.attn2.ln_k",
    }
    out = {"pos_embed": sd["pos_embed.pos_embed"]}
    for end in ("weight", "bias"):
        out |= {f"{theirs}.{end}": sd[f"{ours}.{end}"] for ours, theirs in top.items()}
        out[f"final_layer.adaLN_modulation.1.{end}"] = swap_halves(sd[f"norm_out.linear.{end}"])
        for i in range(SD3_LAYERS):
            d, b = f"transformer_blocks.{i}", f"joint_blocks.{i}"
            out |= {
                f"{b}.{theirs}.{end}": sd[f"{d}.{ours}.{end}"]
                for ours, theirs in block.items()
                if f"{d}.{ours}.{end}" in sd
            }
            context = sd[f"{d}.norm1_context.linear.{end}"]  # the last block's is AdaLayerNormContinuous: swapped
            out[f"{b}.context_block.adaLN_modulation.1.{end}"] = (
                swap_halves(context) if i == SD3_LAYERS - 1 else context
            )
            for fused, parts in (
                ("x_block.attn", [f"attn.to_{x}" for x in "qkv"]),
                ("context_block.attn", [f"attn.add_{x}_proj" for x in "qkv"]),
                ("x_block.attn2", [f"attn2.to_{x}" for x in "qkv"]),
            ):
                if f"{d}.{parts[0]}.{end}" in sd:
                    out[f"{b}.{fused}.qkv.{end}"] = np.concatenate([sd[f"{d}.{p}.{end}"] for p in parts])
    assert sum(v.size for v in out.values()) == sum(v.size for v in sd.values())  # every tensor, once
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def test_an_sd35_mmdit_file_loads_the_folders_weights_exactly(tmp_path_factory):
    from test_sd3 import build_reference

    reference = build_reference("sd35", tmp_path_factory)
    root = tmp_path_factory.mktemp("sd35")
    reference.save_pretrained(root / "folder")
    mmdit = sd3_to_mmdit(numpy_state(reference.transformer))
    assert "joint_blocks.0.x_block.attn2.qkv.weight" in mmdit and "joint_blocks.1.x_block.attn.ln_q.weight" in mmdit
    file = root / "sd3.5_medium.safetensors"
    save_file(mmdit, str(file))
    from_file = load_model_folder(file, "float32", config=root / "folder")
    assert (from_file.family, from_file.label) == ("sd3", "Stable Diffusion 3")
    assert_same_params(from_file.params, load_model_folder(root / "folder", "float32").params)
    from test_gguf_files import q8_types, write_gguf

    gguf_file = root / "sd3.5_medium-Q8_0.gguf"
    write_gguf(gguf_file, mmdit, q8_types(mmdit), architecture="sd3")
    quantized = load_model_folder(gguf_file, "float32", config=root / "folder").params["transformer"]
    assert any(isinstance(v.get_value(), Int8Kernel) for _, v in nnx.to_flat_state(quantized))


def test_a_scaled_fp8_file_loads_each_weight_times_its_scale(flux, tmp_path):
    """ComfyUI's "scaled" fp8: each 2-D weight divided by one number (its largest value over fp8's 448) before the
    cast, that number saved beside it as `scale_weight` and a `scaled_fp8` marker: the weights load as the products."""
    from safetensors.torch import save_file as save_torch

    _, folder, bfl, _ = flux
    stored, products = {}, {}
    for name, w in bfl.items():
        if w.ndim == 2:
            scale = np.float32(np.abs(w).max() / 448)
            fp8 = (w / scale).astype(ml_dtypes.float8_e4m3fn)
            stored[name] = torch.from_numpy(fp8.view(np.uint8)).view(torch.float8_e4m3fn)
            stored[name.removesuffix(".weight") + ".scale_weight"] = torch.tensor([scale])
            stored[name.removesuffix(".weight") + ".scale_input"] = torch.tensor([1.0])
            products[name] = fp8.astype(np.float32) * scale
        else:
            stored[name], products[name] = torch.from_numpy(w), w
    stored["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    file, widened = tmp_path / "flux1-dev-fp8-scaled.safetensors", tmp_path / "products.safetensors"
    save_torch(stored, str(file))
    save_file(products, str(widened))
    got = load_model_folder(file, "float32", config=folder).params["transformer"]
    assert_same_params(got, load_model_folder(widened, "float32", config=folder).params["transformer"])


@pytest.mark.parametrize("layout", ["bfl", "diffusers"])
def test_without_config_the_family_repo_brings_all_but_the_transformers_weights(flux, monkeypatch, layout):
    """No config=: diffusers' repo for the kind (FLUX.1-dev: the file has a guidance embedder, in either layout) is
    fetched without its transformer's weights (here a stand-in Hub whose snapshot is the tiny folder)."""
    import huggingface_hub

    _, folder, _, file = flux
    if layout == "diffusers":
        file = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    asked = {}

    def snapshot_download(repo_id, allow_patterns=None, **kwargs):
        asked[repo_id] = allow_patterns
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo_id: files)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    model = load_model_folder(file, "float32")
    (patterns,) = asked.values()
    assert list(asked) == ["black-forest-labs/FLUX.1-dev"]
    assert "transformer/config.json" in patterns and "vae/diffusion_pytorch_model.safetensors" in patterns
    assert not any(p.startswith("transformer/") and p.endswith(".safetensors") for p in patterns)
    assert_same_params(model.params, load_model_folder(folder, "float32").params)
