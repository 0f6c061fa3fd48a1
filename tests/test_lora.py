"""LoRA against diffusers: our merged kernels give the outputs of diffusers' PEFT layers.

Tiny random SD 1.x and SDXL pipelines are written with `save_pretrained` and read back by our loader. Two
LoRAs per model are made with PEFT (`add_adapter`, every LoRA weight redrawn): one saved by diffusers'
`save_lora_weights` (the diffusers/PEFT layout, its PEFT configs in the header: alpha != rank, a rank and an
alpha pattern, rank-stabilised scaling in a text encoder), one renamed to the kohya layout with `.alpha`
tensors (`KOHYA` below; for SDXL with the original UNet's block names). diffusers loads both with
`load_lora_weights` and weighs them with `set_adapters`; we merge them with `apply_loras`, in one jitted
program for two sets of weights. UNet and text encoder outputs agree within 1e-4 relative error, f32.
"""

from __future__ import annotations

import copy
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_pipeline
import torch
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    EulerDiscreteScheduler,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from flax import nnx
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from reference import CLIP_LAYOUTS, UNET_LAYOUTS, VAE_LAYOUT, nchw, nhwc, randomize, rel_error
from safetensors.numpy import save_file
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from engine import schedulers
from engine.families.loader import load_model_folder
from engine.families.sd import encode as encode_sd
from engine.loading.lora import LoRAError, apply_loras, load_lora, lora_factors
from engine.sampling.pipeline import Plan, decode
from tools.tiny_tokenizer import write_tokenizer

TOL = 1e-4
PROMPT, NEGATIVE = "a red circle on a blue background", "blurry photo"
WEIGHTS = [(0.8, 0.5), (1.3, -0.6)]  # per LoRA, as set_adapters takes them
UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2"]
UNET_TARGETS += ["conv1", "conv2", "conv_shortcut", "time_emb_proj", "conv", "conv_in", "linear_1", "linear_2"]
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
PEFT_LORA = dict(  # the diffusers/PEFT layout: alpha from the header, with patterns
    unet=dict(r=4, lora_alpha=6, rank_pattern={"conv1": 2}, alpha_pattern={"to_k": 3}, target_modules=UNET_TARGETS),
    text=dict(r=2, lora_alpha=4, use_rslora=True, target_modules=TEXT_TARGETS),
)
KOHYA_LORA = dict(  # becomes the kohya layout: alpha as tensors (kohya files have no header configs)
    unet=dict(r=3, target_modules=["to_q", "to_v", "to_out.0", "proj_in", "conv2", "conv_shortcut", "conv"]),
    text=dict(r=2, target_modules=["q_proj", "out_proj", "fc2"]),
)
KOHYA_ALPHA = {"unet": 1.5, "text": 3.0}


# kohya names (sd-scripts): "lora_unet_" / "lora_te_" (SDXL: "lora_te1_", "lora_te2_") + the module path with
# underscores for dots, ".lora_down.weight" (PEFT's lora_A), ".lora_up.weight" (lora_B), ".alpha"; text encoder
# paths keep transformers' "text_model." prefix. For SDXL, kohya names UNet layers after the original (sgm) UNet:
SGM_RESNET = {"conv1": "in_layers.2", "conv2": "out_layers.3", "time_emb_proj": "emb_layers.1"}
SGM_RESNET["conv_shortcut"] = "skip_connection"


def sgm_name(name: str, layers_per_block: int, up_attention: set[int]) -> str:
    """SDXL's diffusers UNet layer name -> its name in the sgm UNet (blocks of layers_per_block resnets)."""
    top = {"conv_in": "input_blocks.0.0", "conv_out": "out.2", "time_embedding.linear_1": "time_embed.0"}
    top |= {"time_embedding.linear_2": "time_embed.2", "add_embedding.linear_1": "label_emb.0.0"}
    top |= {"add_embedding.linear_2": "label_emb.0.2"}
    if name in top:
        return top[name]
    resnet = lambda rest: ".".join([SGM_RESNET.get(rest.split(".")[0], rest.split(".")[0]), *rest.split(".")[1:]])  # noqa: E731
    per = layers_per_block + 1  # each down block: its resnets, then a downsampler; each up block one more resnet
    if m := re.match(r"down_blocks\.(\d)\.(resnets|attentions)\.(\d)\.(.*)", name):
        inner = resnet(m[4]) if m[2] == "resnets" else m[4]
        return f"input_blocks.{1 + int(m[1]) * per + int(m[3])}.{int(m[2] == 'attentions')}.{inner}"
    if m := re.match(r"down_blocks\.(\d)\.downsamplers\.0\.conv", name):
        return f"input_blocks.{1 + int(m[1]) * per + layers_per_block}.0.op"
    if m := re.match(r"mid_block\.(resnets|attentions)\.(\d)\.(.*)", name):
        inner = resnet(m[3]) if m[1] == "resnets" else m[3]
        return f"middle_block.{ {'resnets0': 0, 'attentions0': 1, 'resnets1': 2}[m[1] + m[2]] }.{inner}"
    if m := re.match(r"up_blocks\.(\d)\.(resnets|attentions)\.(\d)\.(.*)", name):
        inner = resnet(m[4]) if m[2] == "resnets" else m[4]
        return f"output_blocks.{int(m[1]) * per + int(m[3])}.{int(m[2] == 'attentions')}.{inner}"
    if m := re.match(r"up_blocks\.(\d)\.upsamplers\.0\.conv", name):
        return f"output_blocks.{int(m[1]) * per + layers_per_block}.{2 if int(m[1]) in up_attention else 1}.conv"
    raise AssertionError(name)


def kohya_key(key: str, sgm=None) -> str:
    component, rest = key.split(".", 1)
    layer, part = re.match(r"(.*)\.lora_([AB])\.weight", rest).groups()
    if component == "unet":
        prefix, layer = "lora_unet_", sgm(layer) if sgm else layer
    else:
        prefix = {"text_encoder": "lora_te1_" if sgm else "lora_te_", "text_encoder_2": "lora_te2_"}[component]
        layer = layer if layer.startswith("text_model.") else f"text_model.{layer}"
    return f"{prefix}{layer.replace('.', '_')}.lora_{'down' if part == 'A' else 'up'}.weight"


def random_lora(model: torch.nn.Module, config: dict, seed: int) -> tuple[dict, dict]:
    """A PEFT LoRA on a copy of `model`, every factor redrawn: (state dict, its LoraConfig as a dict)."""
    model = copy.deepcopy(model)
    model.add_adapter(LoraConfig(**config))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    return get_peft_model_state_dict(model), model.peft_config["default"].to_dict()


def write_loras(pipe, folder, encoders: tuple[str, ...], sgm=None) -> dict[str, str]:
    """The PEFT-layout and the kohya-layout LoRA files of `pipe`'s UNet and text encoders."""
    layers, metadata, kohya = {}, {}, {}
    for i, (name, spec) in enumerate((("peft", PEFT_LORA), ("kohya", KOHYA_LORA))):
        parts = {"unet": random_lora(pipe.unet, spec["unet"], 10 * i)}
        for j, encoder in enumerate(encoders):
            parts[encoder] = random_lora(getattr(pipe, encoder), spec["text"], 10 * i + j + 1)
        if name == "peft":
            layers = {f"{c}_lora_layers": sd for c, (sd, _) in parts.items()}
            metadata = {f"{c}_lora_adapter_metadata": md for c, (_, md) in parts.items()}
            type(pipe).save_lora_weights(folder, weight_name="peft.safetensors", **layers, **metadata)
        else:
            for component, (sd, _) in parts.items():
                for key, value in sd.items():
                    full = kohya_key(f"{component}.{key}", sgm)
                    kohya[full] = value.numpy()
                    alpha = KOHYA_ALPHA["unet" if component == "unet" else "text"]
                    kohya[full.split(".")[0] + ".alpha"] = np.array(alpha, np.float32)
            save_file(kohya, str(folder / "kohya.safetensors"))
    return {"peft": str(folder / "peft.safetensors"), "kohya": str(folder / "kohya.safetensors")}


def build_sdxl(folder) -> StableDiffusionXLPipeline:
    vocab = write_tokenizer(folder / "tokenizer-src", tiny_pipeline.WORDS)
    ids = dict(vocab_size=vocab, max_position_embeddings=77, bos_token_id=vocab - 2, eos_token_id=vocab - 1)
    first = CLIPTextConfig(**CLIP_LAYOUTS["sd1"], **ids, pad_token_id=vocab - 1)
    second = CLIPTextConfig(**CLIP_LAYOUTS["sd2"], **ids, pad_token_id=0, projection_dim=24)
    unet = dict(
        UNET_LAYOUTS["sdxl"],  # transformer depth (1, 2), no attention in the first block, as SDXL
        layers_per_block=1,  # keeps compiling quick; the sgm numbering still counts resnets and samplers
        cross_attention_dim=first.hidden_size + second.hidden_size,
        projection_class_embeddings_input_dim=24 + 6 * UNET_LAYOUTS["sdxl"]["addition_time_embed_dim"],
    )
    tokenizer = CLIPTokenizer.from_pretrained(str(folder / "tokenizer-src"))
    return StableDiffusionXLPipeline(
        vae=randomize(AutoencoderKL(**VAE_LAYOUT), 4, std=0.05),
        text_encoder=randomize(CLIPTextModel(first), 1),
        text_encoder_2=randomize(CLIPTextModelWithProjection(second), 2),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer,
        unet=randomize(UNet2DConditionModel(**unet), 3),
        scheduler=EulerDiscreteScheduler(),
        add_watermarker=False,
    )


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """Per family: diffusers' pipeline (from disk), our LoadedModel of the same folder, and its two LoRA files."""
    cache = {}

    def get(name: str):
        if name not in cache:
            root = tmp_path_factory.mktemp(name)
            if name == "sd1":
                pipe, encoders, sgm = tiny_pipeline.write("sd1", root / "model"), ("text_encoder",), None
            else:
                build_sdxl(root).save_pretrained(root / "model")
                pipe = StableDiffusionXLPipeline.from_pretrained(root / "model")
                encoders = ("text_encoder", "text_encoder_2")
                up_attention = {i for i, t in enumerate(pipe.unet.config.up_block_types) if "CrossAttn" in t}
                sgm = lambda layer: sgm_name(layer, pipe.unet.config.layers_per_block, up_attention)  # noqa: E731
            cache[name] = pipe, load_model_folder(root / "model", "float32"), write_loras(pipe, root, encoders, sgm)
        return cache[name]

    return get


def inputs(pipe, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    cfg = pipe.unet.config
    out = dict(
        ids=rng.integers(0, pipe.tokenizer.vocab_size - 1, (2, 77)),
        sample=rng.standard_normal((2, 8, 8, 4)).astype(np.float32),
        t=np.array([999.0, 37.5], np.float32),
        context=rng.standard_normal((2, 7, cfg.cross_attention_dim)).astype(np.float32),
    )
    if cfg.addition_embed_type == "text_time":
        out["extra"] = dict(
            text_embeds=rng.standard_normal((2, 24)).astype(np.float32),
            time_ids=np.array([[64, 96, 0, 0, 64, 96], [32, 32, 8, 4, 64, 64]], np.float32),
        )
    return out


def diffusers_outputs(pipe, x: dict, encoders) -> dict:
    extra = {"added_cond_kwargs": {k: torch.from_numpy(v) for k, v in x["extra"].items()}} if "extra" in x else {}
    with torch.no_grad():
        out = {
            "unet": nhwc(
                pipe.unet(nchw(x["sample"]), torch.from_numpy(x["t"]), torch.from_numpy(x["context"]), **extra).sample
            )
        }
        for encoder in encoders:
            out[encoder] = getattr(pipe, encoder)(torch.from_numpy(x["ids"])).last_hidden_state.numpy()
    return out


@pytest.mark.filterwarnings("ignore:Already found a `peft_config`")  # PEFT's note on a second adapter
@pytest.mark.parametrize("name", ["sd1", "sdxl"])
def test_two_loras_in_both_layouts_match_diffusers(family, name):
    pipe, loaded, files = family(name)
    encoders = ("text_encoder",) if name == "sd1" else ("text_encoder", "text_encoder_2")
    x = inputs(pipe)
    factors = [lora_factors(load_lora(files[k]), loaded.params) for k in ("peft", "kohya")]

    @jax.jit
    def ours(params, factors, scales):
        models = nnx.merge(loaded.graphdef, apply_loras(params, factors, scales))
        out = {"unet": models.unet(x["sample"], x["t"], x["context"], **x.get("extra", {}))}
        for encoder in encoders:
            out[encoder] = getattr(models, encoder)(x["ids"]).last_hidden_state
        return out

    params = jax.tree.map(jnp.asarray, loaded.params)
    base = diffusers_outputs(pipe, x, encoders)
    for k in ("peft", "kohya"):
        pipe.load_lora_weights(files[k], adapter_name=k)
    try:
        for weights in WEIGHTS:
            pipe.set_adapters(["peft", "kohya"], list(weights))
            want = diffusers_outputs(pipe, x, encoders)
            got = ours(params, factors, jnp.asarray(weights, jnp.float32))
            for part in want:
                assert rel_error(want[part], base[part]) > 1e-2, part  # each LoRA does change each part
                assert rel_error(got[part], want[part]) < TOL, (part, weights)
        assert ours._cache_size() == 1  # new weights, no new program
    finally:
        pipe.unload_lora_weights()


def products(factors) -> dict:
    """Each layer's update as one array (factor layouts may differ where products do not)."""
    return {path: np.float32(f.scale) * (f.down @ f.up) for path, f in factors.items()}


def assert_same_updates(a, b):
    a, b = products(a), products(b)
    assert a.keys() == b.keys()
    for path in a:
        assert np.abs(a[path] - b[path]).max() < 1e-6, path


OLD_DIFFUSERS_NAMES = [  # PEFT's name -> the name diffusers' attention processors and LoRA layers wrote before PEFT
    (r"^unet\.(.*\.attn\d)\.to_(q|k|v)\.lora_[AB]\.weight$", "unet.{0}.processor.to_{1}_lora.{part}.weight"),
    (r"^unet\.(.*\.attn\d)\.to_out\.0\.lora_[AB]\.weight$", "unet.{0}.to_out_lora.{part}.weight"),
    (r"^unet\.(.*)\.lora_[AB]\.weight$", "unet.{0}.lora.{part}.weight"),
    (r"^text_encoder\.(.*\.self_attn)\.(q|k|v)_proj\.lora_[AB]\.weight$", "text_encoder.{0}.to_{1}_lora.{part}.weight"),
    (r"^text_encoder\.(.*\.self_attn)\.out_proj\.lora_[AB]\.weight$", "text_encoder.{0}.to_out_lora.{part}.weight"),
    (
        r"^text_encoder\.(.*\.mlp\.fc\d)\.lora_[AB]\.weight$",
        "text_encoder.text_model.{0}.lora_linear_layer.{part}.weight",
    ),
]


def old_diffusers_name(key: str) -> str:
    for pattern, template in OLD_DIFFUSERS_NAMES:
        if match := re.match(pattern, key):
            return template.format(*match.groups(), part="down" if ".lora_A." in key else "up")
    raise AssertionError(key)


def test_older_diffusers_names_give_the_same_updates(family):
    """Attention processor names (`to_q_lora.down`), `lora_linear_layer`, and UNet-only files without `unet.`."""
    _, loaded, files = family("sd1")
    plain = dataclasses.replace(load_lora(files["peft"]), metadata={})  # no header: alpha = rank, as then
    old = {old_diffusers_name(key): value for key, value in plain.tensors.items()}
    want = lora_factors(plain, loaded.params)
    assert_same_updates(lora_factors(dataclasses.replace(plain, tensors=old), loaded.params), want)
    unet_only = {k.removeprefix("unet."): v for k, v in plain.tensors.items() if k.startswith("unet.")}
    got = lora_factors(dataclasses.replace(plain, tensors=unet_only), loaded.params)
    assert_same_updates(got, {p: f for p, f in want.items() if p[0] == "unet"})


def test_kohya_sdxl_names_in_either_unet_spelling(family):
    """kohya SDXL files name UNet layers after the sgm UNet, or (some trainers) after diffusers'."""
    pipe, loaded, files = family("sdxl")
    sgm = load_lora(files["kohya"])
    up_attention = {i for i, t in enumerate(pipe.unet.config.up_block_types) if "CrossAttn" in t}
    to_sgm = {
        "lora_unet_" + sgm_name(name, pipe.unet.config.layers_per_block, up_attention).replace(".", "_"): name
        for name, module in pipe.unet.named_modules()
        if isinstance(module, torch.nn.Conv2d | torch.nn.Linear)
    }
    renamed = {}
    for key, value in sgm.tensors.items():
        layer, _, part = key.partition(".")
        if layer in to_sgm:
            layer = "lora_unet_" + to_sgm[layer].replace(".", "_")
        renamed[f"{layer}.{part}"] = value
    assert renamed.keys() != sgm.tensors.keys()
    assert_same_updates(
        lora_factors(dataclasses.replace(sgm, tensors=renamed), loaded.params), lora_factors(sgm, loaded.params)
    )


def edited(lora, drop=(), **add):
    tensors = {k: v for k, v in lora.tensors.items() if k not in drop}
    return dataclasses.replace(lora, tensors={**tensors, **{k.replace("__", "."): v for k, v in add.items()}})


TO_K = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_k"


@pytest.mark.parametrize(
    "case, expected",
    [
        (
            "unknown layer",
            [r"for no layer of this model \(2\)", r"unet\.down_blocks\.7\.resnets\.0\.conv1\.lora_A\.weight"],
        ),
        ("mis-shaped", [r"mis-shaped \(1\)", rf"{TO_K}\.lora_A\.weight \(4, 48\).*do not fit {TO_K} \(32, 32\)"]),
        ("no pair", [r"without their pair \(1\)", rf"{TO_K}\.lora_A\.weight"]),
        ("same layer twice", [r"the same layer twice \(1\)", r"attn1_to_k\.lora_down\.weight"]),
        ("loha and dora", [r"a LoRA variant we do not run .* \(2\)", r"hada_w1_a", r"dora_scale"]),
        ("dora header", [r"a LoRA variant we do not run", r"unet adapters with use_dora"]),
        ("several at once", [r"for no layer of this model \(2\)", r"mis-shaped \(1\)"]),
        ("sdxl lora", [r"text_encoder_2\.", r"made for Stable Diffusion XL"]),
    ],
)
def test_tensors_that_do_not_fit_are_refused_by_name(family, case, expected):
    _, loaded, files = family("sd1")
    lora = load_lora(files["peft"])
    a, b = lora.tensors[f"{TO_K}.lora_A.weight"], lora.tensors[f"{TO_K}.lora_B.weight"]
    stray = {
        "unet__down_blocks__7__resnets__0__conv1__lora_A__weight": a,
        "unet__down_blocks__7__resnets__0__conv1__lora_B__weight": b,
    }
    wrong = np.zeros((4, 48), np.float32)
    lora = {
        "unknown layer": lambda: edited(lora, **stray),
        "mis-shaped": lambda: edited(lora, **{f"{TO_K}.lora_A.weight".replace(".", "__"): wrong}),
        "no pair": lambda: edited(lora, drop=[f"{TO_K}.lora_B.weight"]),
        "same layer twice": lambda: edited(
            lora, lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_k__lora_down__weight=a
        ),
        "loha and dora": lambda: edited(
            lora,
            lora_unet_down_blocks_0_resnets_0_conv1__hada_w1_a=a,
            lora_unet_down_blocks_0_resnets_0_conv1__dora_scale=a,
        ),
        "dora header": lambda: dataclasses.replace(lora, metadata={**lora.metadata, "unet.use_dora": True}),
        "several at once": lambda: edited(lora, **stray, **{f"{TO_K}.lora_A.weight".replace(".", "__"): wrong}),
        "sdxl lora": lambda: load_lora(family("sdxl")[2]["peft"]),
    }[case]()
    with pytest.raises(LoRAError) as err:
        lora_factors(lora, loaded.params)
    for pattern in expected:
        assert re.search(pattern, str(err.value)), (pattern, str(err.value))


def test_an_sd1_lora_on_sdxl_is_refused(family):
    _, sdxl, _ = family("sdxl")
    with pytest.raises(LoRAError, match="another model family"):
        lora_factors(load_lora(family("sd1")[2]["kohya"]), sdxl.params)


def test_apply_loras_touches_only_the_adapted_kernels(family):
    _, loaded, files = family("sd1")
    factors = lora_factors(load_lora(files["kohya"]), loaded.params)
    params = jax.tree.map(jnp.asarray, loaded.params)
    apply = jax.jit(apply_loras)
    unchanged, merged = apply(params, [factors], jnp.zeros(1)), apply(params, [factors], jnp.ones(1))
    for (path, before), (_, zero), (_, after) in zip(
        nnx.to_flat_state(params), nnx.to_flat_state(unchanged), nnx.to_flat_state(merged), strict=True
    ):
        assert np.array_equal(zero.get_value(), before.get_value()), path  # weight 0: exactly the model
        assert (path in factors) == (not np.array_equal(after.get_value(), before.get_value())), path
    assert any(p[0] == "text_encoder" for p in factors) and any(len(f.down.shape) == 4 for f in factors.values())


def test_load_lora_from_a_folder_or_the_hub(family, tmp_path, monkeypatch):
    import huggingface_hub

    _, _, files = family("sd1")
    single = tmp_path / "single"
    single.mkdir()
    (single / "pytorch_lora_weights.safetensors").write_bytes(open(files["kohya"], "rb").read())
    assert load_lora(single).tensors.keys() == load_lora(files["kohya"]).tensors.keys()
    with pytest.raises(LoRAError, match="holds 2 .safetensors files"):
        load_lora(files["kohya"].rsplit("/", 1)[0])
    with pytest.raises(LoRAError, match="neither a .safetensors file nor a Hub id"):
        load_lora(str(tmp_path / "missing.safetensors"))
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(LoRAError, match="not a readable .safetensors file"):
        load_lora(tmp_path / "bad.safetensors")

    asked = []
    hub = {"pytorch_lora_weights.safetensors": files["peft"], "other.safetensors": files["kohya"]}
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo_id: ["README.md", *hub])
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo_id, f: asked.append((repo_id, f)) or hub[f])
    assert load_lora("someone/style").metadata  # diffusers' own file name first: the PEFT file, with its header
    assert load_lora("someone/style/other.safetensors").tensors.keys() == load_lora(files["kohya"]).tensors.keys()
    assert asked == [("someone/style", "pytorch_lora_weights.safetensors"), ("someone/style", "other.safetensors")]


@pytest.mark.filterwarnings("ignore:Already found a `peft_config`")
def test_a_picture_with_two_loras_matches_diffusers(family):
    """The whole tiny SD pipeline (DDIM, 3 steps, guidance 7.5) drawn by our public pieces with merged kernels."""
    pipe, loaded, files = family("sd1")
    steps, guidance, weights = 3, 7.5, (0.7, 1.2)
    latents = np.random.default_rng(5).standard_normal((1, 4, 8, 8)).astype(np.float32)  # diffusers' NCHW
    for k in ("peft", "kohya"):
        pipe.load_lora_weights(files[k], adapter_name=k)
    try:
        pipe.set_adapters(["peft", "kohya"], list(weights))
        pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
        with torch.no_grad():
            want = pipe(
                PROMPT,
                negative_prompt=NEGATIVE,
                num_inference_steps=steps,
                guidance_scale=guidance,
                latents=torch.from_numpy(latents),
                height=64,
                width=64,
                output_type="np",
            ).images
    finally:
        pipe.unload_lora_weights()

    plan = Plan(batch=1, latent_height=8, latent_width=8, scheduler="ddim", max_steps=steps, guidance=True)
    table = schedulers.tables(loaded.scheduler_config, "ddim", steps, steps)

    @jax.jit
    def draw(params, factors, scales, x, ids):
        params = apply_loras(params, factors, scales)
        models = nnx.merge(loaded.graphdef, params)
        negative, positive = ids
        uncond = encode_sd(models, negative, {}, plan, negative=True).context
        context = jnp.concatenate([uncond, encode_sd(models, positive, {}, plan, negative=False).context])

        def body(i, carry):
            x, state = carry
            model_in = schedulers.scale_model_input("ddim", table, i, x)
            out = models.unet(jnp.concatenate([model_in, model_in]), schedulers.timestep(table, i), context)
            eps = out[:1] + guidance * (out[1:] - out[:1])
            return schedulers.step("ddim", table, state, i, eps, x, jnp.zeros_like(x))  # eta 0: no noise

        x = x * table.init_noise_sigma
        x, _ = jax.lax.fori_loop(0, table.num_loop_steps, body, (x, schedulers.init_state("ddim", x)))
        return decode(plan, loaded.graphdef, params, x)

    factors = [lora_factors(load_lora(files[k]), loaded.params) for k in ("peft", "kohya")]
    ids = [loaded.tokenize(text)[0] for text in (NEGATIVE, PROMPT)]
    params = jax.tree.map(jnp.asarray, loaded.params)
    got = draw(params, factors, jnp.asarray(weights), latents.transpose(0, 2, 3, 1), ids)
    assert np.abs(np.asarray(got) - want).max() < 1e-2
