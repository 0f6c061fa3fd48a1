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

import numpy as np
import pytest
import tiny_pipeline
import torch
from diffusers import StableDiffusionPipeline
from flax import nnx
from safetensors.torch import save_file

from engine import load_pipeline
from engine.errors import ConfigError, SourceError
from engine.families.loader import load_model_folder

SIZE, STEPS = 64, 2
PROMPT, NEGATIVE = "a red circle on a blue background", "blurry photo"
RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0", "conv2": "out_layers.3"}
RESNET |= {"time_emb_proj": "emb_layers.1", "conv_shortcut": "skip_connection"}
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


def to_original(pipe: StableDiffusionPipeline) -> dict[str, torch.Tensor]:
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
    ups = len(pipe.vae.config.up_block_types)
    for key, value in pipe.vae.state_dict().items():
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
        out[f"first_stage_model.{name}"] = value
    for key, value in pipe.text_encoder.state_dict().items():
        key = key if key.startswith("text_model.") else f"text_model.{key}"  # transformers 5 saves it without
        out[f"cond_stage_model.transformer.{key}"] = value
    # Buffers the original training code saved beside the networks.
    out["alphas_cumprod"] = torch.linspace(1, 0.01, 1000)
    out["cond_stage_model.transformer.text_model.embeddings.position_ids"] = torch.arange(77)[None]
    return {k: v.detach().contiguous() for k, v in out.items()}


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    """The tiny folder, its single file, and the pipeline diffusers read from the folder."""
    root = tmp_path_factory.mktemp("single-file")
    folder = root / "sd1"
    pipe = tiny_pipeline.write("sd1", folder)
    file = root / "tiny-sd1.safetensors"
    save_file(to_original(pipe), file)
    return folder, file


def generate(engine, latents: np.ndarray) -> np.ndarray:
    result = engine.generate(
        PROMPT,
        negative_prompt=NEGATIVE,
        seed=7,
        num_inference_steps=STEPS,
        guidance_scale=6.0,
        height=SIZE,
        width=SIZE,
        num_images=1,
        scheduler="ddim",
        latents=latents,
    )
    return result.arrays


def test_sd1_file_loads_the_folders_weights_exactly(sd1):
    """The same param tree, bit for bit, and the same configs: so the same pictures as the folder's."""
    folder, file = sd1
    from_file, from_folder = (load_model_folder(s, "float32", config=c) for s, c in ((file, folder), (folder, None)))
    flat_file, flat_folder = (dict(nnx.to_flat_state(m.params)) for m in (from_file, from_folder))
    assert flat_file.keys() == flat_folder.keys()
    for path, var in flat_folder.items():
        np.testing.assert_array_equal(flat_file[path].get_value(), var.get_value(), err_msg=str(path))
    assert from_file.graphdef == from_folder.graphdef
    assert (from_file.denoiser_config, from_file.vae_config) == (from_folder.denoiser_config, from_folder.vae_config)
    assert from_file.scheduler_config == from_folder.scheduler_config
    assert from_file.defaults == from_folder.defaults


def test_sd1_file_draws_as_diffusers_from_single_file(sd1):
    folder, file = sd1
    latents = np.random.default_rng(0).standard_normal((1, 4, SIZE // 8, SIZE // 8)).astype(np.float32)
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
    with pytest.raises(SourceError, match="a FLUX.1 transformer single file"):
        load_pipeline(flux, safety_checker=False)
