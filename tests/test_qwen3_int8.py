"""`--quantize int8` on the Qwen3 text encoder of Z-Image and FLUX.2 [klein]: its linear kernels kept as int8 with one
scale per output channel, as the denoisers' (engine/loading/quantize.py), its embedding and norms as loaded.

What is proven: which components int8 takes (the denoiser and a Qwen3 text encoder; CLIP, T5, the VAE stay); the int8
encoder's hidden states against f32 at a tiny config and at one layer of Qwen3-4B's widths, within a cosine bound
that broken quantizations (values truncated instead of rounded, 4-bit values, scales in the wrong order) do not meet;
and end to end, tiny Z-Image and Klein folders loaded with `load_pipeline(quantize="int8")`: the text encoder int8 on
the devices and on the host (`t5="host"`, which gives the devices' int8 embeddings), the pictures against the same
folders in f32 (PSNR stated); and each component's bytes computed from the configs alone (tools/model_bytes.py)
equal to what the engines hold. The real-width layer against transformers is tests/test_qwen3.py's; this one
measures int8 against our own f32. And `quantize="w8a8"` on the same folders: the transformer's blocks' attention and
feed-forward computed in int8 (`Denoiser.w8a8`), the rest float, the Qwen3 encoder as int8 weights, each kernel the
one quantizing the loaded f32 tree gives, and the pictures against f32 (PSNR stated).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import jax
import numpy as np
import pytest
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
from flax import nnx
from qwen_reference import QWEN3_4B_LAYER, QWEN3_LAYOUTS, save_tiny_qwen_tokenizer, tiny_qwen3
from reference import randomize, rel_error
from transformers import AutoTokenizer

from engine import load_pipeline
from engine.errors import ConfigError
from engine.families import FAMILIES
from engine.families.base import Models
from engine.families.qwen_prompt import FLUX2_KLEIN, Z_IMAGE
from engine.loading.quantize import (
    Int8Kernel,
    dequantize,
    int8_components,
    param_bytes,
    quantize_kernel,
    quantize_params,
    streaming,
)
from engine.models.qwen3 import Qwen3Config, Qwen3Model
from engine.nn.int8 import QuantizedKernel
from engine.nn.layers import shapes_only
from tools.model_bytes import PUBLISHED, component_bytes, write_folder

PROMPT = "a red cat on a mat under the big old tree"


def int8_kernels(tree) -> list[Int8Kernel]:
    return [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, Int8Kernel)) if isinstance(x, Int8Kernel)]


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    return float(10 * np.log10(1.0 / np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2)))


def test_int8_takes_the_denoiser_and_a_qwen3_text_encoder_only():
    """By each family's config classes: Z-Image's and Klein's Qwen3 joins the transformer; FLUX.1's and SD3's T5 and
    CLIPs, and every VAE, stay as loaded. With w8a8 the denoiser computes in int8 instead, and a Qwen3 stays int8
    weights beside it; FLUX.1 and SD3 are not offered w8a8."""
    chosen = {name: int8_components(f.denoiser.component, f.configs, "int8") for name, f in FAMILIES.items()}
    assert chosen["z-image"] == chosen["flux2"] == ("transformer", "text_encoder")
    assert chosen["flux"] == chosen["sd3"] == ("transformer",)
    assert int8_components("transformer", FAMILIES["z-image"].configs, "w8a8") == ("text_encoder",)
    assert int8_components("transformer", FAMILIES["flux"].configs, "w8a8") == ()
    offered = {name for name, f in FAMILIES.items() if f.denoiser.w8a8 is not None}
    assert {"sd", "sdxl", "z-image", "flux2"} <= offered and not {"flux", "sd3", "flux-kontext"} & offered
    with pytest.raises(
        ConfigError, match="SD 1.x/2.x/XL, Z-Image and FLUX.2 .klein. in int8; this model's transformer"
    ):
        streaming(("text_encoder",), ("transformer", FAMILIES["flux"].denoiser.w8a8))
    assert all("vae" not in c for c in chosen.values())


# -- hidden states: int8 against f32 ---------------------------------------------------------------------------------


def broken_4bit(kernel) -> Int8Kernel:
    """15 levels instead of 255: what a wrong bit width gives."""
    w = np.asarray(kernel, np.float32)
    scale = np.abs(w).max(axis=0) / 7.0
    return Int8Kernel(np.rint(w / scale).astype(np.int8), scale.astype(w.dtype))


def broken_truncated(kernel) -> Int8Kernel:
    """Values cut toward zero instead of rounded: every weight shrunk by up to a whole step."""
    w = np.asarray(kernel, np.float32)
    scale = np.abs(w).max(axis=0) / 127.0
    return Int8Kernel(np.trunc(w / scale).astype(np.int8), scale.astype(w.dtype))


def broken_order(kernel) -> Int8Kernel:
    """The right values, their output channels' scales in reverse order: an indexing slip."""
    good = quantize_kernel(kernel)
    return Int8Kernel(good.values, good.scale[::-1])


BROKEN = {"4-bit": broken_4bit, "truncated": broken_truncated, "scales reversed": broken_order}


def random_qwen3(cfg: Qwen3Config, seed: int) -> Qwen3Model:
    """A Qwen3 of random weights, drawn on the host: kernels N(0, 1/fan_in) with each output channel's spread
    varied (log-normal, as trained layers' channels differ), norms 1 + N(0, 0.1), the embedding N(0, 1)."""
    with shapes_only():
        graphdef, shapes = nnx.split(Qwen3Model(cfg, nnx.Rngs(0)))
    rng = np.random.default_rng(seed)

    def draw(path: tuple, shape: tuple) -> np.ndarray:
        w = rng.standard_normal(shape, np.float32)
        if len(shape) == 1:
            return 1 + 0.1 * w
        if path[-1] == "embedding":
            return w
        return w * (np.exp(0.5 * rng.standard_normal(shape[1])) / np.sqrt(shape[0])).astype(np.float32)

    flat = [(path, var.replace(draw(path, var.get_value().shape))) for path, var in nnx.to_flat_state(shapes)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def hidden_states(graphdef, params, ids, mask):
    """Every hidden state, run as the engine's programs run it: int8 widened inside the jitted program."""
    return jax.jit(lambda p, i, m: nnx.merge(graphdef, dequantize(p)).text_encoder(i, m))(params, ids, mask)


def int8_against_f32(model: Qwen3Model, ids, mask, broken: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    """(worst relative error, worst cosine similarity) over the hidden states after the embedding, for the int8
    encoder and for broken ones: the same kernels quantized wrongly."""
    graphdef, params = nnx.split(Models(text_encoder=model))
    want = hidden_states(graphdef, params, ids, mask)
    quantized = {"int8": quantize_params(params, "text_encoder")}
    assert len(int8_kernels(quantized["int8"])) == 7 * len(model.layers)  # q, k, v, o, gate, up, down per layer
    for name in broken:
        with mock.patch("engine.loading.quantize.quantize_kernel", BROKEN[name]):
            quantized[name] = quantize_params(params, "text_encoder")
    out = {}
    for name, tree in quantized.items():
        got = hidden_states(graphdef, tree, ids, mask)
        np.testing.assert_array_equal(got[0], want[0])  # the embedding: kept as loaded
        pairs = list(zip(got[1:], want[1:], strict=True))
        out[name] = (max(rel_error(g, w) for g, w in pairs), min(cosine(g, w) for g, w in pairs))
    return out


# Bounds on the worst hidden state: cosine similarity to f32 within 2.5e-4 of 1, the largest difference within 5% of
# the largest value. Measured int8: tiny 1 - cos 1.45e-4, relative 2.7%; Qwen3-4B's widths 1.22e-4, 1.5%. Broken:
# truncated 5.3e-4 / 4.5e-4 (relative 7.0%, 3.6%); tiny, 4-bit 0.045 and the scales reversed 0.68.
COSINE_BOUND, ERROR_BOUND = 2.5e-4, 0.05


@pytest.mark.parametrize("widths", ["tiny", "qwen3-4b"])
def test_int8_hidden_states_stay_near_f32_and_broken_quantizations_do_not(widths):
    """A 3-layer tiny encoder (Z-Image's test layout) and one layer of Qwen3-4B (2560 wide, 32 query and 8 key/value
    heads of 128, SwiGLU 9728), random weights (N(0, 1/fan_in) kernels), two prompts, the second one padded."""
    layout = QWEN3_LAYOUTS["zimage"] if widths == "tiny" else QWEN3_4B_LAYER
    model = random_qwen3(Qwen3Config(vocab_size=64, **layout), seed=3)
    ids = np.random.default_rng(4).integers(0, 64, (2, 40)).astype(np.int32)
    mask = np.ones((2, 40), bool)
    mask[1, 25:] = False
    broken = tuple(BROKEN) if widths == "tiny" else ("truncated",)  # at 100M weights, the nearest miss only
    measured = int8_against_f32(model, ids, mask, broken)
    print(f"{widths}: " + ", ".join(f"{k} rel {e:.4f} 1-cos {1 - c:.2e}" for k, (e, c) in measured.items()))
    error, cos = measured["int8"]
    assert 1e-4 < error < ERROR_BOUND and 1 - cos < COSINE_BOUND, measured["int8"]
    for name in broken:
        assert 1 - measured[name][1] > COSINE_BOUND, name


# -- end to end: tiny Z-Image and Klein folders, with and without --quantize int8 ------------------------------------

# FLUX.2 [klein]'s tiny text encoder at twice tests/test_flux2_klein.py's width: 28 layers (layers 9, 18 and 27 are
# read) whose kernels reach MIN_SIZE, so that int8 takes them
KLEIN_QWEN3 = dict(
    QWEN3_LAYOUTS["klein"], hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16,
)  # fmt: skip


def zimage_folder(folder: Path) -> None:
    from test_z_image import build_reference

    build_reference(SimpleNamespace(mktemp=lambda name: folder.parent / f"{folder.name}-{name}")).save_pretrained(
        folder
    )


def klein_folder(folder: Path) -> None:
    from test_flux2_klein import SCHEDULER, TRANSFORMER, VAE

    vocab = save_tiny_qwen_tokenizer(folder / "tokenizer")
    Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=randomize(AutoencoderKLFlux2(**VAE), 4, std=0.05),
        text_encoder=tiny_qwen3(vocab, 5, causal_lm=True, **KLEIN_QWEN3),
        tokenizer=AutoTokenizer.from_pretrained(str(folder / "tokenizer")),
        transformer=randomize(
            Flux2Transformer2DModel(**{**TRANSFORMER, "joint_attention_dim": 3 * KLEIN_QWEN3["hidden_size"]}), 3, 0.15
        ),
        is_distilled=True,
    ).save_pretrained(folder)


# family: (folder maker, latent channels, pixels per latent cell, steps, guidance)
FOLDERS = {"z-image": (zimage_folder, 16, 2, 2, 0.0), "flux2": (klein_folder, 16, 4, 2, 1.0)}


@pytest.fixture(scope="module", params=sorted(FOLDERS))
def engines(request, tmp_path_factory):
    """The family's folder in f32, with int8 (text encoder on the devices), and with int8 and the text encoder on
    the host; a function drawing the same two pictures (prompt, initial latents, steps) with any of them; the folder."""
    make, channels, cell, steps, guidance = FOLDERS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    make(folder)
    options = dict(safety_checker=False, previews=False)
    loaded = {
        "f32": load_pipeline(folder, **options),
        "int8": load_pipeline(folder, quantize="int8", **options),
        "int8, host": load_pipeline(folder, quantize="int8", t5="host", **options),
        "w8a8": load_pipeline(folder, quantize="w8a8", **options),
    }
    start = np.random.default_rng(0).standard_normal((2, channels, 32 // cell, 32 // cell)).astype(np.float32)
    args = dict(height=32, width=32, num_images=2, latents=start, num_inference_steps=steps, guidance_scale=guidance)
    yield (
        request.param,
        loaded,
        lambda engine: engine.generate(PROMPT, **args).arrays,
        folder,
    )  # the host engine draws nothing: its encoder is called alone
    for engine in loaded.values():
        engine.close()


def test_the_text_encoder_is_int8_on_the_devices_and_on_the_host(engines):
    family, loaded, _, _ = engines
    plain, int8 = loaded["f32"].params, loaded["int8"].params
    kernels = int8_kernels(int8["text_encoder"])
    # every built layer's q, k, v, o, gate, up and down: Klein's first 27 (the last it reads), Z-Image's 3 (its last,
    # read by nothing, is compiled away)
    assert len(kernels) == 7 * (27 if family == "flux2" else 3)
    assert all(isinstance(k.values, jax.Array) and k.values.dtype == np.int8 for k in kernels)
    assert not int8_kernels(int8["vae"]) and param_bytes(int8["vae"]) == param_bytes(plain["vae"])
    assert param_bytes(int8["text_encoder"]) < 0.6 * param_bytes(plain["text_encoder"])  # the embedding stays f32
    assert int8_kernels(int8["transformer"])  # as before: the denoiser too
    host = loaded["int8, host"]
    assert "text_encoder" not in host.params
    encoder = host.model.extra_inputs.keywords["host"]  # the family's prompt inputs hold the host's encoder
    assert len(int8_kernels(encoder.params)) == 7 * (27 if family == "flux2" else 2)  # the host builds those read


def test_the_host_encoder_runs_the_devices_int8_weights(engines):
    """`t5="host"` with int8: the host's encoder gives what the int8 engine's device encoder gives for the same ids
    and mask (the family's reading of its layers), and near the f32 encoder's, not equal to it."""
    family, loaded, _, _ = engines
    reading = FLUX2_KLEIN if family == "flux2" else Z_IMAGE
    ids = np.random.default_rng(5).integers(0, 300, (2, 24)).astype(np.int32)
    mask = np.ones((2, 24), bool)
    mask[1, 9:] = False
    host = loaded["int8, host"].model.extra_inputs.keywords["host"](ids, mask)

    def on_device(engine) -> np.ndarray:
        def run(params, ids, mask):
            encoder = nnx.merge(engine.model.graphdef, dequantize(params)).text_encoder
            return reading.embeds(encoder.config, encoder(ids, mask))

        return np.asarray(jax.jit(run)(engine.params, ids, mask))

    int8, f32 = on_device(loaded["int8"]), on_device(loaded["f32"])
    assert rel_error(host, int8) < 1e-5
    measured = 1 - cosine(host, f32)
    print(f"{family}: the int8 encoder's prompt embeddings, 1 - cos {measured:.2e} against f32")
    assert measured < 1e-3 and np.abs(host - f32).max() > 0  # measured 2.7e-4 through Klein's 27 layers


# PSNR (dB) of the int8 engine's pictures (text encoder and transformer in int8) against the f32 engine's, 2 steps;
# bounds about 4 dB under what was measured: Z-Image 62.4, Klein 65.8
PSNR_BOUND = {"z-image": 58.0, "flux2": 61.0}


def test_int8_pictures_stay_near_f32(engines):
    family, loaded, draw, _ = engines
    want, got = draw(loaded["f32"]), draw(loaded["int8"])
    measured = psnr(got, want)
    print(f"{family}: int8 PSNR {measured:.1f} dB against f32")  # the numbers the README quotes (pytest -s)
    assert want.std() > 0.02  # a picture, not a flat field that any mistake would still match
    assert measured > PSNR_BOUND[family] and np.abs(got - want).max() > 0


def test_w8a8_computes_the_blocks_in_int8_and_keeps_the_rest_float(engines):
    """The transformer's blocks' attention and feed-forward kernels become `QuantizedKernel`s, quantized as the loader
    read them to exactly what quantizing the loaded f32 tree gives; the embedders, modulations and output layers, and
    the VAE, stay f32; the Qwen3 encoder is int8 weights as under `quantize="int8"`."""
    family, loaded, _, _ = engines
    plain, w8a8 = dict(nnx.to_flat_state(loaded["f32"].params)), dict(nnx.to_flat_state(loaded["w8a8"].params))
    computed = {path for path, var in w8a8.items() if isinstance(var.get_value(), QuantizedKernel)}
    blocks = {"flux2": ("transformer_blocks", "single_transformer_blocks")}.get(
        family, ("noise_refiner", "context_refiner", "layers")
    )
    assert computed and all(path[0] == "transformer" and path[1] in blocks for path in computed)
    assert not any("adaLN_modulation" in path for path in computed)
    per_block = 12 if family == "flux2" else 7  # q, k, v, out and the feed-forward's (Klein's: both streams')
    assert len([p for p in computed if p[1] == blocks[0]]) == per_block * len(
        {p[2] for p in computed if p[1] == blocks[0]}
    )
    rule = FAMILIES[family].denoiser.w8a8
    want = dict(nnx.to_flat_state(quantize_params(loaded["f32"].params, "transformer", mode="w8a8", takes=rule)))
    for path in computed:
        got, expected = w8a8[path].get_value(), want[path].get_value()
        assert np.array_equal(np.asarray(got.values), np.asarray(expected.values))
        assert np.array_equal(np.asarray(got.scale), np.asarray(expected.scale))
    floats = [p for p in w8a8 if p[0] in ("transformer", "vae") and p not in computed and p[-1] == "kernel"]
    assert floats and all(np.array_equal(w8a8[p].get_value(), plain[p].get_value()) for p in floats)
    text = [int8_kernels(loaded[kind].params["text_encoder"]) for kind in ("w8a8", "int8")]
    assert text[0] and len(text[0]) == len(text[1])
    assert loaded["w8a8"].compute_path.startswith("float32, the denoiser's products in int8 (w8a8)")


# PSNR (dB) of the w8a8 engine's pictures (blocks in int8 compute, Qwen3 in int8 weights) against the f32 engine's, 2
# steps; bounds about 4 dB under what was measured: Z-Image 60.2, Klein 61.2 (int8 weights: 62.4, 65.8)
W8A8_PSNR_BOUND = {"z-image": 56.0, "flux2": 57.0}


def test_w8a8_pictures_stay_near_f32(engines):
    family, loaded, draw, _ = engines
    want, got = draw(loaded["f32"]), draw(loaded["w8a8"])
    measured = psnr(got, want)
    print(f"{family}: w8a8 PSNR {measured:.1f} dB against f32")
    assert want.std() > 0.02
    assert measured > W8A8_PSNR_BOUND[family] and np.abs(got - want).max() > 0


# -- bytes, from the configs alone -----------------------------------------------------------------------------------


def test_the_bytes_computed_from_the_configs_are_what_the_engines_hold(engines):
    """tools/model_bytes.py builds nothing but shapes, yet gives each component's bytes as the loaded engines hold
    them, f32 and int8 (text encoder and transformer quantized, the VAE as it is)."""
    _, loaded, _, folder = engines
    computed = component_bytes(folder, "float32")
    assert set(computed) == {"text_encoder", "transformer", "vae"}
    for name, (f32, int8) in computed.items():
        assert (param_bytes(loaded["f32"].params[name]), param_bytes(loaded["int8"].params[name])) == (f32, int8)
    assert computed["vae"][0] == computed["vae"][1] and computed["text_encoder"][1] < computed["text_encoder"][0]


def test_z_image_turbo_weighs_10_7_gb_with_int8(tmp_path):
    """Tongyi-MAI/Z-Image-Turbo's published configs: the 6.15B transformer 12.31 GB in bf16 and 6.16 with int8,
    Qwen3-4B (all 36 layers on the devices) 8.04 and 4.41, FLUX.1's VAE 0.17 as it is: 20.52 GB -> 10.74."""
    sizes = component_bytes(write_folder(tmp_path, PUBLISHED["Tongyi-MAI/Z-Image-Turbo"]))
    gb = {name: (round(b / 1e9, 2), round(q / 1e9, 2)) for name, (b, q) in sizes.items()}
    assert gb == {"text_encoder": (8.04, 4.41), "transformer": (12.31, 6.16), "vae": (0.17, 0.17)}
