"""Single-file checkpoints in the original (LDM / A1111) layout.

A tiny SD 1.x pipeline written by diffusers is converted to the original layout by the converter below (the
inverse of diffusers' conversion, from the key tables of diffusers' scripts/convert_diffusers_to_original_stable_
diffusion.py) and saved as one .safetensors, with the buffers real files carry. Loaded from that file with the
folder as `config=`, our param tree equals the folder's bit for bit, and our pictures equal diffusers' `from_single_file` of
the same file within 1/255. Broken and unknown files are refused by name.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import tiny_pipeline
import torch
from diffusers import (
    AutoencoderKL,
    EulerDiscreteScheduler,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from diffusers.loaders.single_file_utils import DIFFUSERS_DEFAULT_PIPELINE_PATHS
from flax import nnx
from reference import CLIP_LAYOUTS, UNET_LAYOUTS, VAE_LAYOUT, randomize
from safetensors.torch import save_file
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from engine import load_pipeline
from engine.errors import ConfigError, SourceError
from engine.families.loader import load_model_folder
from engine.families.single_file import detect
from engine.loading.weights import map_safetensors
from tools.tiny_tokenizer import write_tokenizer

SIZE, STEPS = 64, 4  # test_pipeline.py's sd1/ddim case: its compiled programs serve this one in a full run
PROMPT, NEGATIVE = "a red circle on a blue background", "blurry photo"
RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0", "conv2": "out_layers.3"}
RESNET |= {"time_emb_proj": "emb_layers.1", "conv_shortcut": "skip_connection"}
OPENCLIP_LAYER = {
    "layer_norm1": "ln_1",
    "layer_norm2": "ln_2",
    "mlp.fc1": "mlp.c_fc",
    "mlp.fc2": "mlp.c_proj",
    "self_attn.out_proj": "attn.out_proj",
}
VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}


def unet_table(config: dict) -> dict[str, str]:
    """diffusers' UNet module prefixes -> the original's, for a UNet of `layers_per_block` resnets per block."""
    per, blocks = config["layers_per_block"], len(config["block_out_channels"])
    table = {
        "time_embedding.linear_1.": "time_embed.0.",
        "time_embedding.linear_2.": "time_embed.2.",
        "conv_in.": "input_blocks.0.0.",
        "conv_norm_out.": "out.0.",
        "conv_out.": "out.2.",
        "mid_block.attentions.0.": "middle_block.1.",
        "add_embedding.linear_1.": "label_emb.0.0.",  # SDXL's text_time embedding
        "add_embedding.linear_2.": "label_emb.0.2.",
    }
    for j in range(2):
        table[f"mid_block.resnets.{j}."] = f"middle_block.{2 * j}."
    for i in range(blocks):
        for j in range(per):
            table[f"down_blocks.{i}.resnets.{j}."] = f"input_blocks.{(per + 1) * i + j + 1}.0."
            table[f"down_blocks.{i}.attentions.{j}."] = f"input_blocks.{(per + 1) * i + j + 1}.1."
        for j in range(per + 1):
            table[f"up_blocks.{i}.resnets.{j}."] = f"output_blocks.{(per + 1) * i + j}.0."
            table[f"up_blocks.{i}.attentions.{j}."] = f"output_blocks.{(per + 1) * i + j}.1."
        if i < blocks - 1:
            table[f"down_blocks.{i}.downsamplers.0.conv."] = f"input_blocks.{(per + 1) * (i + 1)}.0.op."
            after_attention = config["up_block_types"][i].startswith("CrossAttn")
            table[f"up_blocks.{i}.upsamplers.0."] = (
                f"output_blocks.{(per + 1) * i + per}.{2 if after_attention else 1}."
            )
    return table


def clip_original(encoder) -> dict[str, torch.Tensor]:
    """transformers' CLIP as the original files hold it: its own names, under `text_model.`."""
    return {k if k.startswith("text_model.") else f"text_model.{k}": v for k, v in encoder.state_dict().items()}


def openclip_original(encoder, extra_layer: bool = False) -> dict[str, torch.Tensor]:
    """transformers' CLIP as an OpenCLIP text tower: q, k and v stacked, `text_projection` applied as x @ P."""
    sd = {k.removeprefix("text_model."): v for k, v in encoder.state_dict().items()}
    out = {
        "token_embedding.weight": sd["embeddings.token_embedding.weight"],
        "positional_embedding": sd["embeddings.position_embedding.weight"],
        "ln_final.weight": sd["final_layer_norm.weight"],
        "ln_final.bias": sd["final_layer_norm.bias"],
        "logit_scale": torch.tensor(4.6),
    }
    layers = encoder.config.num_hidden_layers
    for i in range(layers + extra_layer):
        src, dst = f"encoder.layers.{i % layers}.", f"transformer.resblocks.{i}."
        for leaf in ("weight", "bias"):
            stacked = [sd[f"{src}self_attn.{p}_proj.{leaf}"] for p in "qkv"]
            out[f"{dst}attn.in_proj_{leaf}"] = torch.cat(stacked) * (1.5 if i >= layers else 1)
            for ours, theirs in OPENCLIP_LAYER.items():
                out[f"{dst}{theirs}.{leaf}"] = sd[f"{src}{ours}.{leaf}"]
    width = encoder.config.hidden_size
    out["text_projection"] = sd["text_projection.weight"].T if "text_projection.weight" in sd else torch.eye(width)
    return out


def vae_original(vae) -> dict[str, torch.Tensor]:
    """diffusers' AutoencoderKL under the original (LDM) names, without the `first_stage_model.` prefix."""
    out, ups = {}, len(vae.config.up_block_types)
    for key, value in vae.state_dict().items():
        name = key.replace("conv_norm_out", "norm_out").replace("conv_shortcut", "nin_shortcut")
        name = re.sub(r"down_blocks\.(\d+)\.resnets\.", r"down.\1.block.", name)
        name = re.sub(r"down_blocks\.(\d+)\.downsamplers\.0\.", r"down.\1.downsample.", name)
        name = re.sub(r"up_blocks\.(\d+)\.resnets\.", lambda m: f"up.{ups - 1 - int(m[1])}.block.", name)
        name = re.sub(r"up_blocks\.(\d+)\.upsamplers\.0\.", lambda m: f"up.{ups - 1 - int(m[1])}.upsample.", name)
        name = re.sub(r"mid_block\.resnets\.(\d)\.", lambda m: f"mid.block_{int(m[1]) + 1}.", name)
        if m := re.fullmatch(r"(.+)\.mid_block\.attentions\.0\.(.+)\.(weight|bias)", name):
            name = f"{m[1]}.mid.attn_1.{VAE_ATTENTION[m[2]]}.{m[3]}"
            if m[2] != "group_norm" and m[3] == "weight":
                value = value[:, :, None, None]  # the original's 1x1 convs
        out[name] = value
    return out


def to_original(pipe, kind: str = "sd1") -> dict[str, torch.Tensor]:
    """The pipeline's networks as one state dict in the original layout."""
    out = {}
    table = unet_table(pipe.unet.config)
    for key, value in pipe.unet.state_dict().items():
        head = max((h for h in table if key.startswith(h)), key=len)
        rest = key[len(head) :]
        if ".resnets." in head:
            part, _, leaf = rest.partition(".")
            rest = f"{RESNET[part]}.{leaf}"
        out[f"model.diffusion_model.{table[head]}{rest}"] = value
    out |= {f"first_stage_model.{k}": v for k, v in vae_original(pipe.vae).items()}
    if kind == "sd1":
        out |= {f"cond_stage_model.transformer.{k}": v for k, v in clip_original(pipe.text_encoder).items()}
    elif kind == "sd2":  # the OpenCLIP tower has one layer more, which SD 2.x never reads
        tower = openclip_original(pipe.text_encoder, extra_layer=True)
        out |= {f"cond_stage_model.model.{k}": v for k, v in tower.items()}
    else:
        out |= {f"conditioner.embedders.0.transformer.{k}": v for k, v in clip_original(pipe.text_encoder).items()}
        tower = openclip_original(pipe.text_encoder_2)
        out |= {f"conditioner.embedders.1.model.{k}": v for k, v in tower.items()}
    # Buffers the original training code saved beside the networks.
    out["alphas_cumprod"] = torch.linspace(1, 0.01, 1000)
    out["cond_stage_model.transformer.text_model.embeddings.position_ids"] = torch.arange(77)[None]
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    """The tiny folder, its single file, and the pipeline diffusers read from the folder."""
    root = tmp_path_factory.mktemp("single-file")
    folder = root / "sd1"
    pipe = tiny_pipeline.write("sd1", folder)
    file = root / "tiny-sd1.safetensors"
    save_file(to_original(pipe), file)
    return folder, file


def build_sdxl(tokenizer_dir: Path) -> StableDiffusionXLPipeline:
    """A tiny SDXL: a CLIP (width 32) and an OpenCLIP with projection (width 48), a text_time UNet."""
    vocab = write_tokenizer(tokenizer_dir, tiny_pipeline.WORDS)
    ids = dict(vocab_size=vocab, max_position_embeddings=77, bos_token_id=vocab - 2, eos_token_id=vocab - 1)
    first = CLIPTextConfig(**CLIP_LAYOUTS["sd1"], **ids, pad_token_id=vocab - 1)
    second = CLIPTextConfig(**CLIP_LAYOUTS["sd2"], **ids, pad_token_id=0, projection_dim=24)
    time_dim = UNET_LAYOUTS["sdxl"]["addition_time_embed_dim"]
    unet = dict(
        UNET_LAYOUTS["sdxl"],
        cross_attention_dim=first.hidden_size + second.hidden_size,
        projection_class_embeddings_input_dim=second.projection_dim + 6 * time_dim,
    )
    return StableDiffusionXLPipeline(
        vae=randomize(AutoencoderKL(**VAE_LAYOUT, scaling_factor=0.13025, force_upcast=True), 4, std=0.05),
        text_encoder=randomize(CLIPTextModel(first), 1),
        text_encoder_2=randomize(CLIPTextModelWithProjection(second), 2),
        tokenizer=CLIPTokenizer.from_pretrained(str(tokenizer_dir)),
        tokenizer_2=CLIPTokenizer.from_pretrained(str(tokenizer_dir), pad_token="!"),
        unet=randomize(UNet2DConditionModel(**unet), 3),
        scheduler=EulerDiscreteScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012),
        add_watermarker=False,
    )


@pytest.fixture(scope="module", params=["sd2", "sdxl"])
def openclip_kind(request, tmp_path_factory):
    """A tiny SD 2.x-v (OpenCLIP) or SDXL folder, its single file, and the kind."""
    root = tmp_path_factory.mktemp(request.param)
    folder = root / "folder"
    if request.param == "sd2":
        pipe = tiny_pipeline.write("sd2v", folder)
    else:
        build_sdxl(root / "tokenizer").save_pretrained(folder)
        pipe = StableDiffusionXLPipeline.from_pretrained(folder)
    file = root / f"tiny-{request.param}.safetensors"
    save_file(to_original(pipe, request.param), file)
    return folder, file, pipe, request.param


def test_openclip_files_load_the_folders_weights_exactly(openclip_kind):
    """SD 2.x and SDXL: the OpenCLIP tower split and renamed (SD 2.x's unread last layer and projection left
    out), the same param tree as the folder's; and diffusers' from_single_file reads the file as the same networks,
    so the converter above writes what diffusers reads."""
    folder, file, pipe, kind = openclip_kind
    assert_same_model(load_model_folder(file, "float32", config=folder), load_model_folder(folder, "float32"))
    cls = StableDiffusionPipeline if kind == "sd2" else StableDiffusionXLPipeline
    extra = dict(safety_checker=None, requires_safety_checker=False) if kind == "sd2" else {}
    reference = cls.from_single_file(str(file), config=str(folder), **extra)
    encoders = ["text_encoder"] + (["text_encoder_2"] if kind == "sdxl" else [])
    for name in ["unet", "vae", *encoders]:
        want, got = getattr(pipe, name).state_dict(), getattr(reference, name).state_dict()
        assert want.keys() == got.keys(), name
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=f"{name}.{key}")


def generate(engine, latents: np.ndarray) -> np.ndarray:
    result = engine.generate(
        PROMPT,
        negative_prompt=NEGATIVE,
        seed=7,
        num_inference_steps=STEPS,
        guidance_scale=6.0,
        height=SIZE,
        width=SIZE,
        num_images=len(latents),
        scheduler="ddim",
        latents=latents,
    )
    return result.arrays


def assert_same_model(from_file, from_folder) -> None:
    """The same param tree, bit for bit, and the same configs: so the same pictures."""
    flat_file, flat_folder = (dict(nnx.to_flat_state(m.params)) for m in (from_file, from_folder))
    assert flat_file.keys() == flat_folder.keys()
    for path, var in flat_folder.items():
        np.testing.assert_array_equal(flat_file[path].get_value(), var.get_value(), err_msg=str(path))
    assert from_file.graphdef == from_folder.graphdef
    assert (from_file.denoiser_config, from_file.vae_config) == (from_folder.denoiser_config, from_folder.vae_config)
    assert from_file.scheduler_config == from_folder.scheduler_config
    assert from_file.defaults == from_folder.defaults


def test_sd1_file_loads_the_folders_weights_exactly(sd1):
    folder, file = sd1
    assert_same_model(load_model_folder(file, "float32", config=folder), load_model_folder(folder, "float32"))


def test_sd1_file_draws_as_diffusers_from_single_file(sd1):
    folder, file = sd1
    latents = np.random.default_rng(0).standard_normal((2, 4, SIZE // 8, SIZE // 8)).astype(np.float32)
    got = generate(load_pipeline(file, config=folder, safety_checker=False), latents)
    assert got.std() > 0.01  # a real picture, not a constant that matches trivially

    from diffusers import DDIMScheduler

    reference = StableDiffusionPipeline.from_single_file(
        str(file), config=str(folder), safety_checker=None, requires_safety_checker=False
    )
    reference.scheduler = DDIMScheduler.from_config(reference.scheduler.config)
    with torch.no_grad():
        want = reference(
            PROMPT,
            negative_prompt=NEGATIVE,
            num_inference_steps=STEPS,
            guidance_scale=6.0,
            latents=torch.from_numpy(latents),
            height=SIZE,
            width=SIZE,
            num_images_per_prompt=len(latents),
            output_type="np",
        ).images
    assert np.abs(got - want).max() < 1 / 255


def test_a_yaml_beside_the_file_and_the_option_set_the_prediction_type(sd1, tmp_path):
    folder, file = sd1
    assert load_model_folder(file, "float32", config=folder).scheduler_config.prediction_type == "epsilon"
    copy = tmp_path / "v-model.safetensors"
    copy.write_bytes(file.read_bytes())
    copy.with_suffix(".yaml").write_text('model:\n  params:\n    parameterization: "v"\n')
    assert load_model_folder(copy, "float32", config=folder).scheduler_config.prediction_type == "v_prediction"
    chosen = load_model_folder(copy, "float32", config=folder, prediction_type="epsilon")
    assert chosen.scheduler_config.prediction_type == "epsilon"
    assert chosen.name == str(copy)


def test_config_options_are_for_single_files_only(sd1):
    folder, _ = sd1
    with pytest.raises(ConfigError, match="single-file checkpoint"):
        load_model_folder(folder, "float32", config=folder)


def test_a_config_of_another_kind_is_refused(sd1, tmp_path):
    folder, file = sd1
    other = tmp_path / "xl"
    other.mkdir()
    index = json.loads((folder / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps(dict(index, _class_name="StableDiffusionXLPipeline")))
    with pytest.raises(SourceError, match="Stable Diffusion 1.x checkpoint.*StableDiffusionXLPipeline"):
        load_model_folder(file, "float32", config=other)


def test_without_config_offline_the_message_names_config(sd1, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    def offline(*args, **kwargs):
        raise OfflineModeIsEnabled("offline")

    def not_cached(*args, **kwargs):
        raise LocalEntryNotFoundError("not cached")

    monkeypatch.setattr(huggingface_hub, "list_repo_files", offline)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", not_cached)
    _, file = sd1
    with pytest.raises(SourceError, match=r"stable-diffusion-v1-5/stable-diffusion-v1-5.*config=DIR \(--config DIR\)"):
        load_model_folder(file, "float32")


def test_a_truncated_file_is_refused(sd1, tmp_path):
    _, file = sd1
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(SourceError, match="cut.safetensors is not a safetensors file"):
        load_pipeline(cut, safety_checker=False)


def test_a_file_of_unknown_layout_is_refused_with_what_it_holds(tmp_path):
    file = tmp_path / "lora.safetensors"
    save_file({"lora_unet_down_blocks_0.lora_down.weight": torch.zeros(4, 8)}, file)
    with pytest.raises(SourceError, match="not a Stable Diffusion checkpoint.*found lora_unet_down_blocks_0.lora_down"):
        load_pipeline(file, safety_checker=False)
    flux = tmp_path / "flux.safetensors"
    save_file({"double_blocks.0.img_attn.norm.key_norm.scale": torch.zeros(4)}, flux)
    with pytest.raises(SourceError, match="not a whole FLUX.1 transformer"):  # tests/test_transformer_files.py
        load_pipeline(flux, safety_checker=False)


def test_a_ckpt_is_read_through_the_safe_reader(sd1, tmp_path):
    """The same networks as a Lightning .ckpt (`state_dict` beside the training state): the same param tree."""
    folder, file = sd1
    ckpt = tmp_path / "tiny-sd1.ckpt"
    tensors = {k: torch.from_numpy(np.array(v)) for k, v in map_safetensors(file).items()}
    torch.save({"state_dict": tensors, "global_step": 470000, "epoch": 3}, ckpt)
    assert_same_model(
        load_model_folder(ckpt, "float32", config=folder), load_model_folder(file, "float32", config=folder)
    )


@pytest.mark.parametrize(
    "keys, kind, inpainting",
    [
        ({"cond_stage_model.transformer.text_model.final_layer_norm.weight": (8,)}, "v1", False),
        ({"cond_stage_model.model.token_embedding.weight": (10, 8)}, "v2", False),
        ({"conditioner.embedders.1.model.positional_embedding": (77, 8)}, "xl_base", False),
        ({"cond_stage_model.transformer.text_model.final_layer_norm.weight": (8,)}, "v1", True),
    ],
)
def test_the_kind_comes_from_the_keys(keys, kind, inpainting):
    channels = 9 if inpainting else 4
    tensors = {k: np.zeros(shape, np.float16) for k, shape in keys.items()}
    tensors["model.diffusion_model.input_blocks.0.0.weight"] = np.zeros((32, channels, 3, 3), np.float16)
    found, found_inpainting = detect(tensors, "file")
    assert (found.name, found_inpainting) == (kind, inpainting)
    repo = found.inpainting_repo if inpainting else found.repo  # diffusers' choice for the kind without config=
    assert (
        repo == DIFFUSERS_DEFAULT_PIPELINE_PATHS["inpainting" if inpainting else kind]["pretrained_model_name_or_path"]
    )
