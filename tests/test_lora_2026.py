"""LoRAs for Z-Image and FLUX.2 [klein] against diffusers, in diffusers' layout and in their trainers'.

Each family's tiny folder (tests/test_z_image.py's and tests/test_flux2_klein.py's) gets one random LoRA, made with
PEFT on its transformer (`add_adapter`, every factor redrawn, lora_alpha 6 at rank 4), whose q, k and v share their
down factor, so that it can also be written with the original checkpoint's fused q/k/v. It is saved twice:
- by the pipeline's `save_lora_weights` (diffusers/PEFT: `transformer.<module>.lora_A.weight`, alpha in the header);
- in the layout its trainers publish, each module named after the original checkpoint: for Z-Image kohya's
  (`lora_unet_layers_0_attention_qkv.lora_down.weight` and `.alpha`, as musubi-tuner writes), for FLUX.2
  ai-toolkit's (`diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight`, no alpha: it is folded into B).
diffusers loads both files (`load_lora_weights`, converting the second itself) and draws at scale 0.7; our engine
serves both at once and draws with `lora_scales` of 0.7 for one and 0 for the other: pictures within 1/255, f32,
2 steps at 32x32, and the two layouts' pictures the same.
"""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import test_flux2_klein as klein_test
import test_z_image as z_image_test
import torch
from diffusers.loaders.single_file_utils import swap_scale_shift
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from safetensors.numpy import save_file

from engine import load_pipeline
from engine.loading.lora import LoRAError, LoRAFile, load_lora, lora_factors

TOLERANCE = 1 / 255
SCALE = 0.7
RANK, ALPHA = 4, 6
SIZE = dict(height=32, width=32, num_inference_steps=2)
# PEFT's target modules (full names): every kind of layer the families' LoRAs adapt, as trainers target them
TARGETS = {
    "z-image": r".*\.attention\.(to_[qkv]|to_out\.0)|.*\.feed_forward\.w[123]|(layers|noise_refiner)\.\d+\.adaLN_modulation\.0"
    r"|t_embedder\.mlp\.0|cap_embedder\.1",
    "klein": r"transformer_blocks\.\d+\.(attn\.(to_[qkv]|add_[qkv]_proj|to_out\.0|to_add_out)|ff(_context)?\.linear_\w+)"
    r"|single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out)|x_embedder|context_embedder|proj_out"
    r"|time_guidance_embed\.timestep_embedder\.linear_1|double_stream_modulation_img\.linear",
}
# q, k and v of one attention: one down factor (so a fused original layer holds the same LoRA)
QKV = re.compile(r"(?P<attention>.+\.(attention|attn))\.(to_|add_)(?P<which>[qkv])(_proj)?\.lora_A\.weight")


def z_image_original(module: str) -> str:
    """A Z-Image layer's name in Tongyi's checkpoint: q, k, v fused in `attention.qkv`, `to_out.0` is `out`."""
    return re.sub(r"attention\.to_[qkv]$", "attention.qkv", module).replace("attention.to_out.0", "attention.out")


KLEIN_ORIGINAL = {  # FLUX.2's layers in Black Forest Labs' checkpoint (our tiny model: 1 double, 2 single blocks)
    r"transformer_blocks\.(\d)\.attn\.to_[qkv]": r"double_blocks.\1.img_attn.qkv",
    r"transformer_blocks\.(\d)\.attn\.add_[qkv]_proj": r"double_blocks.\1.txt_attn.qkv",
    r"transformer_blocks\.(\d)\.attn\.to_out\.0": r"double_blocks.\1.img_attn.proj",
    r"transformer_blocks\.(\d)\.attn\.to_add_out": r"double_blocks.\1.txt_attn.proj",
    r"transformer_blocks\.(\d)\.ff\.linear_in": r"double_blocks.\1.img_mlp.0",
    r"transformer_blocks\.(\d)\.ff\.linear_out": r"double_blocks.\1.img_mlp.2",
    r"transformer_blocks\.(\d)\.ff_context\.linear_in": r"double_blocks.\1.txt_mlp.0",
    r"transformer_blocks\.(\d)\.ff_context\.linear_out": r"double_blocks.\1.txt_mlp.2",
    r"single_transformer_blocks\.(\d)\.attn\.to_qkv_mlp_proj": r"single_blocks.\1.linear1",
    r"single_transformer_blocks\.(\d)\.attn\.to_out": r"single_blocks.\1.linear2",
    r"x_embedder": "img_in",
    r"context_embedder": "txt_in",
    r"proj_out": "final_layer.linear",
    r"time_guidance_embed\.timestep_embedder\.linear_1": "time_in.in_layer",
    r"double_stream_modulation_img\.linear": "double_stream_modulation_img.lin",
}


def klein_original(module: str) -> str:
    for pattern, original in KLEIN_ORIGINAL.items():
        if re.fullmatch(pattern, module):
            return re.sub(pattern, original, module)
    raise AssertionError(module)


def random_lora(transformer: torch.nn.Module, family: str) -> tuple[dict[str, torch.Tensor], dict]:
    """A PEFT LoRA on a copy of `transformer`, every factor redrawn, q/k/v's down factors tied: (state dict, config)."""
    model = copy.deepcopy(transformer)
    model.add_adapter(LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS[family]))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    state = get_peft_model_state_dict(model)
    for key in list(state):
        if (m := QKV.fullmatch(key)) and m["which"] != "q":
            state[key] = state[key.replace(f"_{m['which']}", "_q", 1)].clone()
    return state, model.peft_config["default"].to_dict()


def trainer_layout(state: dict[str, torch.Tensor], family: str) -> dict[str, np.ndarray]:
    """The same LoRA named as its trainers publish it; a fused layer: the shared down, the ups stacked q, k, v."""
    out: dict[str, np.ndarray] = {}
    ups: dict[str, dict[str, np.ndarray]] = {}
    for key, value in state.items():
        module, part = re.fullmatch(r"(.+)\.lora_([AB])\.weight", key).groups()
        value = value.numpy()
        if family == "z-image":
            name = "lora_unet_" + z_image_original(module).replace(".", "_")
            key = f"{name}.lora_{'down' if part == 'A' else 'up'}.weight"
            out[f"{name}.alpha"] = np.array(ALPHA, np.float32)
        else:
            name = "diffusion_model." + klein_original(module)
            key = f"{name}.lora_{part}.weight"
            value = value * (ALPHA / RANK if part == "B" else 1.0)  # no alpha in the file: folded into B
        if part == "A":
            out[key] = value  # q's, k's and v's are the same
        else:
            which = re.search(r"(to_|add_)([qkv])(_proj)?$", module)
            ups.setdefault(key, {})[which[2] if which else ""] = value
    for key, parts in ups.items():
        out[key] = np.concatenate([parts[which] for which in sorted(parts, key="qkv".find)])  # q, k, v rows
    return out


def build(family: str, tmp_path_factory):
    if family == "z-image":
        reference = z_image_test.build_reference(tmp_path_factory)
    else:
        reference = klein_test.build_reference(tmp_path_factory.mktemp("parts"))
    folder = tmp_path_factory.mktemp(family)
    reference.save_pretrained(folder)
    return reference, folder


@pytest.fixture(scope="module", params=["z-image", "klein"])
def served(request, tmp_path_factory):
    """diffusers' pipeline with both LoRA files loaded, our engine serving both, the folder and the files."""
    family = request.param
    reference, folder = build(family, tmp_path_factory)
    state, config = random_lora(reference.transformer, family)
    loras = tmp_path_factory.mktemp(f"{family}-loras")
    type(reference).save_lora_weights(
        loras, transformer_lora_layers=state, transformer_lora_adapter_metadata=config, weight_name="peft.safetensors"
    )
    save_file(trainer_layout(state, family), str(loras / "trainer.safetensors"))
    files = {name: loras / f"{name}.safetensors" for name in ("peft", "trainer")}
    engine = load_pipeline(folder, safety_checker=False, max_batch_size=1, loras=files)
    for name, path in files.items():
        reference.load_lora_weights(str(path), adapter_name=name)
    yield family, reference, engine, folder, files
    engine.close()


def start_latents(family: str) -> np.ndarray:
    return z_image_test.latents(32, 32, n=1) if family == "z-image" else klein_test.latents(32, 32)


def diffusers_picture(reference, family: str, adapter: str, start: np.ndarray) -> np.ndarray:
    reference.set_adapters([adapter], [SCALE])
    if family == "z-image":
        return z_image_test.run_reference(reference, start, prompt=z_image_test.PROMPT, guidance_scale=0.0, **SIZE)
    with torch.no_grad():
        out = reference(
            prompt=klein_test.PROMPT, latents=torch.from_numpy(start), output_type="np", guidance_scale=1.0, **SIZE
        )
    return out.images


def our_picture(engine, family: str, scales: dict[str, float], start: np.ndarray) -> np.ndarray:
    prompt = z_image_test.PROMPT if family == "z-image" else klein_test.PROMPT
    guidance = 0.0 if family == "z-image" else 1.0
    out = engine.generate(prompt, num_images=1, latents=start, guidance_scale=guidance, lora_scales=scales, **SIZE)
    return out.arrays


def test_a_lora_in_either_layout_draws_diffusers_picture(served):
    """diffusers' picture with the LoRA at 0.7, from its own layout and from the trainers' (which diffusers
    converts itself), is ours within 1/255; the two layouts draw the same picture; the LoRA changes the picture."""
    family, reference, engine, _, _ = served
    start = start_latents(family)
    plain = our_picture(engine, family, {"peft": 0.0, "trainer": 0.0}, start)
    ours = {}
    for name in ("peft", "trainer"):
        want = diffusers_picture(reference, family, name, start)
        ours[name] = our_picture(engine, family, {"peft": 0.0, "trainer": 0.0, name: SCALE}, start)
        assert np.abs(ours[name] - want).max() < TOLERANCE, name
    assert np.abs(ours["peft"] - ours["trainer"]).max() < 1e-4
    assert np.abs(ours["peft"] - plain).max() > 0.05  # the LoRA is applied, and strongly enough to show


def test_fused_original_layers_split_as_diffusers_splits_them(served):
    """The trainers' fused q/k/v updates equal the split ones of diffusers' layout, and FLUX.2's final modulation
    (shift, scale in the original) lands on ours (scale, shift) with its halves swapped."""
    family, _, engine, _, files = served
    peft, trainer = (lora_factors(load_lora(files[name]), engine.params) for name in ("peft", "trainer"))
    assert set(peft) == set(trainer)
    for path, f in peft.items():
        g = trainer[path]
        np.testing.assert_allclose(f.scale * f.down @ f.up, g.scale * g.down @ g.up, rtol=1e-5, atol=1e-7)
    peft_tensors = load_lora(files["peft"]).tensors
    for prefix in (
        "diffusion_model.",
        "lora_unet_",
    ):  # diffusers' module names as ComfyUI's and kohya's files give them
        renamed = {}
        for key, value in peft_tensors.items():
            module, part = re.fullmatch(r"transformer\.(.+)\.lora_([AB])\.weight", key).groups()
            module = prefix + (module if prefix == "diffusion_model." else module.replace(".", "_"))
            renamed[f"{module}.lora_{'down' if part == 'A' else 'up'}.weight"] = value
            renamed[f"{module}.alpha"] = np.array(ALPHA, np.float32)  # the header's alpha as tensors
        spelled = lora_factors(LoRAFile(prefix, renamed), engine.params)
        assert set(spelled) == set(peft)
        for path, f in peft.items():
            g = spelled[path]
            np.testing.assert_allclose(f.scale * f.down @ f.up, g.scale * g.down @ g.up, rtol=1e-5, atol=1e-7)
    both = LoRAFile("both", {**peft_tensors, **load_lora(files["trainer"]).tensors})  # fused and split: refused
    with pytest.raises(LoRAError, match="the same layer twice"):
        lora_factors(both, engine.params)
    if family == "klein":
        rng = np.random.default_rng(3)
        down, up = rng.standard_normal((RANK, 32)), rng.standard_normal((64, RANK))  # norm_out: 32 -> 2 x 32
        lora = LoRAFile(
            "final",
            {f"diffusion_model.final_layer.adaLN_modulation.1.lora_{p}.weight": v for p, v in (("A", down), ("B", up))},
        )
        (f,) = lora_factors(lora, engine.params).values()
        want = swap_scale_shift(torch.from_numpy(up @ down), 0).numpy().T
        np.testing.assert_allclose(f.down @ f.up, want, rtol=1e-5)


def test_a_lora_that_fits_no_layer_is_refused_naming_its_key(served, tmp_path):
    """At start, with the tensor's name; a text encoder LoRA too (diffusers loads none into these pipelines)."""
    family, _, engine, folder, _ = served
    if family == "z-image":
        bad = {"transformer.layers.0.attention.to_qq.lora_A.weight": np.zeros((RANK, 32), np.float32)}
        save_file(bad, str(tmp_path / "bad.safetensors"))
        with pytest.raises(LoRAError, match=re.escape("transformer.layers.0.attention.to_qq.lora_A.weight")):
            load_pipeline(folder, safety_checker=False, loras={"bad": tmp_path / "bad.safetensors"})
    encoder = LoRAFile("encoder", {"text_encoder.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((RANK, 16))})
    with pytest.raises(LoRAError, match=r"q_proj.lora_A.weight(.|\n)*adapt its transformer alone"):
        lora_factors(encoder, engine.params)
