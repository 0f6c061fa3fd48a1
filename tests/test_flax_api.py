"""Code written for diffusers' Flax pipelines runs on our engine after one changed import line.

The text-to-image code of diffusers' JAX/Flax how-to and of the "SDXL with JAX on TPU v5e" post
(`../shared/reference/`) runs below as written, with only the import line and the model id changed (a tiny
folder written by `save_pretrained`), on 8 simulated devices: one prompt on every device, eight prompts,
negative prompts, `pmap(pipeline._generate)`. Run once more in f32 (the how-to's `dtype` line; the post's
cast), its pictures equal diffusers PyTorch's from the same folder, prompts and initial noise (the noise the
old pipeline drew from each device's key) within 1e-2 on 0..1. Unsupported parts of the old API fail with a
message that names the replacement.
"""

from __future__ import annotations

import ast
import functools
import json
import logging
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tiny_pipeline
import torch
from diffusers import (
    AutoencoderKL,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from multidevice import start_with_devices
from reference import CLIP_LAYOUTS, UNET_LAYOUTS, randomize
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from engine.compat import flax_api
from engine.compat.flax_api import (
    FlaxDPMSolverMultistepScheduler,
    FlaxEulerDiscreteScheduler,
    FlaxPNDMScheduler,
    FlaxStableDiffusionPipeline,
    FlaxStableDiffusionXLPipeline,
)
from engine.errors import ConfigError
from tools.tiny_tokenizer import write_tokenizer

TOLERANCE = 1e-2
DEVICES = 8

# diffusers' "JAX/Flax" how-to, its text-to-image code as written. Changed: the import line and the model id.
# Left out: the Colab TPU set-up. Added: the `record(...)` lines, which keep what the document prints.
HOW_TO = """
import jax

num_devices = jax.device_count()
device_type = jax.devices()[0].device_kind

print(f"Found {num_devices} JAX devices of type {device_type}.")

import jax.numpy as jnp
from jax import pmap
from flax.jax_utils import replicate
from flax.training.common_utils import shard

from engine.compat.flax_api import FlaxStableDiffusionPipeline  # changed: from diffusers import FlaxStableDiffusionPipeline

dtype = jnp.bfloat16
pipeline, params = FlaxStableDiffusionPipeline.from_pretrained(
    MODEL,  # changed: "CompVis/stable-diffusion-v1-4"
    revision="bf16",
    dtype=dtype,
)

prompt = "A cinematic film still of Morgan Freeman starring as Jimi Hendrix, portrait, 40mm lens, shallow depth of field, close up, split lighting, cinematic"
prompt = [prompt] * jax.device_count()
prompt_ids = pipeline.prepare_inputs(prompt)
record("prompt_ids", prompt_ids)  # (8, 77)

# parameters
p_params = replicate(params)

# arrays
prompt_ids = shard(prompt_ids)
record("sharded_prompt_ids", prompt_ids)  # (8, 1, 77)

def create_key(seed=0):
    return jax.random.PRNGKey(seed)

rng = create_key(0)
rng = jax.random.split(rng, jax.device_count())
record("rng", rng)

images = pipeline(prompt_ids, p_params, rng, jit=True)[0]
record("one_prompt", images)  # (8, 1, 512, 512, 3)

from diffusers.utils import make_image_grid

images = images.reshape((images.shape[0] * images.shape[1],) + images.shape[-3:])
images = pipeline.numpy_to_pil(images)
make_image_grid(images, rows=2, cols=4)
record("one_prompt_pil", images)

prompts = [
    "Labrador in the style of Hokusai",
    "Painting of a squirrel skating in New York",
    "HAL-9000 in the style of Van Gogh",
    "Times Square under water, with fish and a dolphin swimming around",
    "Ancient Roman fresco showing a man working on his laptop",
    "Close-up photograph of young black woman against urban background, high quality, bokeh",
    "Armchair in the shape of an avocado",
    "Clown astronaut in space, with Earth in the background",
]

prompt_ids = pipeline.prepare_inputs(prompts)
prompt_ids = shard(prompt_ids)

images = pipeline(prompt_ids, p_params, rng, jit=True).images
record("eight_prompts", images)
images = images.reshape((images.shape[0] * images.shape[1],) + images.shape[-3:])
images = pipeline.numpy_to_pil(images)

make_image_grid(images, 2, 4)

p_generate = pmap(pipeline._generate)

images = p_generate(prompt_ids, p_params, rng)
images = images.block_until_ready()
record("p_generate", images)  # (8, 1, 512, 512, 3)
"""

# The "SDXL with JAX on TPU v5e" post, as written. Changed: the import line and the model id.
# Added: the `record(...)` lines.
POST = """
# Show best practices for SDXL JAX
import jax
import jax.numpy as jnp
import numpy as np
from flax.jax_utils import replicate
from engine.compat.flax_api import FlaxStableDiffusionXLPipeline  # changed: from diffusers import FlaxStableDiffusionXLPipeline
import time

pipeline, params = FlaxStableDiffusionXLPipeline.from_pretrained(
    MODEL, split_head_dim=True  # changed: "stabilityai/stable-diffusion-xl-base-1.0"
)

scheduler_state = params.pop("scheduler")
params = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
params["scheduler"] = scheduler_state

default_prompt = "high-quality photo of a baby dolphin \u200b\u200bplaying in a pool and wearing a party hat"
default_neg_prompt = "illustration, low-quality"
default_seed = 33
default_guidance_scale = 5.0
default_num_steps = 25

def tokenize_prompt(prompt, neg_prompt):
    prompt_ids = pipeline.prepare_inputs(prompt)
    neg_prompt_ids = pipeline.prepare_inputs(neg_prompt)
    record("prompt_ids", prompt_ids)
    return prompt_ids, neg_prompt_ids

NUM_DEVICES = jax.device_count()

# Model parameters don't change during inference,
# so we only need to replicate them once.
p_params = replicate(params)

def replicate_all(prompt_ids, neg_prompt_ids, seed):
    p_prompt_ids = replicate(prompt_ids)
    p_neg_prompt_ids = replicate(neg_prompt_ids)
    rng = jax.random.PRNGKey(seed)
    rng = jax.random.split(rng, NUM_DEVICES)
    record("p_prompt_ids", p_prompt_ids)
    record("rng", rng)
    return p_prompt_ids, p_neg_prompt_ids, rng

def generate(
    prompt,
    negative_prompt,
    seed=default_seed,
    guidance_scale=default_guidance_scale,
    num_inference_steps=default_num_steps,
):
    prompt_ids, neg_prompt_ids = tokenize_prompt(prompt, negative_prompt)
    prompt_ids, neg_prompt_ids, rng = replicate_all(prompt_ids, neg_prompt_ids, seed)
    images = pipeline(
        prompt_ids,
        p_params,
        rng,
        num_inference_steps=num_inference_steps,
        neg_prompt_ids=neg_prompt_ids,
        guidance_scale=guidance_scale,
        jit=True,
    ).images
    record("images", images)

    # convert the images to PIL
    images = images.reshape((images.shape[0] * images.shape[1], ) + images.shape[-3:])
    return pipeline.numpy_to_pil(np.array(images))

start = time.time()
print(f"Compiling ...")
generate(default_prompt, default_neg_prompt)
print(f"Compiled in {time.time() - start}")

start = time.time()
prompt = "llama in ancient Greece, oil on canvas"
neg_prompt = "cartoon, illustration, animation"
images = generate(prompt, neg_prompt)
print(f"Inference in {time.time() - start}")
record("pil", images)
"""

# Each document once as written (bf16) and once in f32, the precision that PyTorch is compared in.
IN_F32 = {
    "how_to": ("dtype = jnp.bfloat16", "dtype = jnp.float32"),
    "post": ("astype(jnp.bfloat16)", "astype(jnp.float32)"),
}

RUNNER = """
import numpy as np

def recorder(prefix):
    def record(name, value):  # keeps the last value under each name
        if isinstance(value, list):  # PIL images
            value = np.stack([np.asarray(image) for image in value])
        np.save(OUT / f"{prefix}.{name}.npy", np.asarray(value))
    return record

for prefix, model, script in RUNS:
    exec(compile(script, prefix, "exec"), {"__name__": "__main__", "MODEL": model, "record": recorder(prefix)})
"""

WORDS = ["a", "red", "circle", "on", "blue", "background", "photo", "of", "cat", "blurry", "llama", "oil"]


def build_sd() -> StableDiffusionPipeline:
    """tiny_pipeline's SD 1.x with one layer per UNet block: the 8-device runs compile half as much."""
    base = tiny_pipeline.build("sd1")
    unet = UNet2DConditionModel(**dict(UNET_LAYOUTS["sd1"], layers_per_block=1, cross_attention_dim=32, sample_size=8))
    return StableDiffusionPipeline(**{**base.components, "unet": randomize(unet, 1)}, requires_safety_checker=False)


def build_sdxl(tokenizer_dir) -> StableDiffusionXLPipeline:
    """A tiny SDXL: two encoders of different widths, depths and activations, the second padding with "!"."""
    vocab = write_tokenizer(tokenizer_dir, WORDS)
    ids = dict(vocab_size=vocab, max_position_embeddings=77, bos_token_id=vocab - 2, eos_token_id=vocab - 1)
    first = CLIPTextConfig(**CLIP_LAYOUTS["sd1"], **ids, pad_token_id=vocab - 1)
    second = CLIPTextConfig(**CLIP_LAYOUTS["sd2"], **ids, pad_token_id=0, projection_dim=24)
    unet = dict(
        UNET_LAYOUTS["sdxl"],
        layers_per_block=1,
        sample_size=8,  # 64x64 pictures with the factor-8 VAE
        cross_attention_dim=first.hidden_size + second.hidden_size,
        projection_class_embeddings_input_dim=second.projection_dim
        + 6 * UNET_LAYOUTS["sdxl"]["addition_time_embed_dim"],
    )
    scheduler = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1)
    return StableDiffusionXLPipeline(
        vae=randomize(AutoencoderKL(**tiny_pipeline.VAE_FACTOR8, scaling_factor=0.13025), 4, std=0.05),
        text_encoder=randomize(CLIPTextModel(first), 1),
        text_encoder_2=randomize(CLIPTextModelWithProjection(second), 2),
        tokenizer=CLIPTokenizer.from_pretrained(str(tokenizer_dir)),
        tokenizer_2=CLIPTokenizer.from_pretrained(str(tokenizer_dir), pad_token="!"),
        unet=randomize(UNet2DConditionModel(**unet), 3),
        scheduler=EulerDiscreteScheduler(**scheduler, timestep_spacing="leading"),
        add_watermarker=False,
    )


ONE_PROMPT = (
    "A cinematic film still of Morgan Freeman starring as Jimi Hendrix, portrait, 40mm lens, shallow depth of field,"
    " close up, split lighting, cinematic"
)
EIGHT_PROMPTS = ast.literal_eval(HOW_TO.split("prompts = ")[1].split("]")[0] + "]")  # as the how-to lists them
LLAMA, LLAMA_NEGATIVE = "llama in ancient Greece, oil on canvas", "cartoon, illustration, animation"


@pytest.fixture(scope="session")
def folders(tmp_path_factory):
    """Tiny SD and SDXL folders, and diffusers' PyTorch pipelines read back from them."""
    sd_folder, sdxl_folder = tmp_path_factory.mktemp("sd"), tmp_path_factory.mktemp("sdxl")
    build_sd().save_pretrained(sd_folder)
    sd = StableDiffusionPipeline.from_pretrained(sd_folder, safety_checker=None, requires_safety_checker=False)
    build_sdxl(tmp_path_factory.mktemp("tokenizer")).save_pretrained(sdxl_folder)
    sdxl = StableDiffusionXLPipeline.from_pretrained(sdxl_folder, add_watermarker=False)
    return {"sd": (sd_folder, sd), "sdxl": (sdxl_folder, sdxl)}


@pytest.fixture(scope="session")
def documents(folders, tmp_path_factory):
    """The documents' code on 8 simulated devices, one process per document, run while the other tests run."""
    out = tmp_path_factory.mktemp("documents")
    waits = {}
    for name, script, family in (("how_to", HOW_TO, "sd"), ("post", POST, "sdxl")):
        old, new = IN_F32[name]
        assert script.count(old) == 1
        folder = str(folders[family][0])
        in_f32 = script.replace(old, new).split("p_generate = pmap")[0]  # the run as written covers that part
        runs = [(f"{name}_f32", folder, in_f32), (name, folder, script)]
        waits[name] = functools.cache(start_with_devices(DEVICES, f"RUNS = {runs!r}\n" + RUNNER, out, timeout=600))

    def load(name: str) -> np.ndarray:
        waits[name.split(".")[0].removesuffix("_f32")]()
        return np.load(out / f"{name}.npy")

    return load


def _loaded(folders, family: str, cls) -> SimpleNamespace:
    folder, reference = folders[family]
    pipeline, params = cls.from_pretrained(folder)
    return SimpleNamespace(folder=folder, reference=reference, pipeline=pipeline, params=params)


@pytest.fixture(scope="session")
def sd(folders, documents):  # documents: start that run first, so that it overlaps with these tests
    return _loaded(folders, "sd", FlaxStableDiffusionPipeline)


@pytest.fixture(scope="session")
def sdxl(folders, documents):
    return _loaded(folders, "sdxl", FlaxStableDiffusionXLPipeline)


def old_noise(keys: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """What the old pipeline drew on each device, `jax.random.normal(key, shape)` with JAX < 0.5's bits, stacked."""
    with jax.threefry_partitionable(False):
        return torch.from_numpy(np.concatenate([np.asarray(jax.random.normal(k, shape)) for k in keys]))


def torch_images(reference, prompts, keys, steps, **kwargs) -> np.ndarray:
    """diffusers' PyTorch pictures from the noise that the old pipeline drew from `keys`, one key per device."""
    latents = old_noise(keys, (len(prompts) // len(keys), 4, 8, 8))
    with torch.no_grad():
        return reference(prompts, latents=latents, num_inference_steps=steps, output_type="np", **kwargs).images


def test_noise_is_drawn_as_jax_0_4_drew_it():
    # jax.random.normal(PRNGKey(0), (10,)) as JAX's quickstart printed it before JAX 0.5 changed the bits.
    quickstart = [-0.3721109, 0.26423115, -0.18252768, -0.7368197, -0.44030377]
    quickstart += [-0.1521442, -0.67135346, -0.5908641, 0.73168886, 0.5673026]
    np.testing.assert_allclose(flax_api._old_normal(jax.random.PRNGKey(0), (10,)), quickstart, rtol=1e-6)


def test_scheduler_swap_and_negative_prompts_unsharded_equal_diffusers(sd):
    # The old blog's swap: the scheduler to from_pretrained, its state into params.
    scheduler, scheduler_state = FlaxDPMSolverMultistepScheduler.from_pretrained(sd.folder, subfolder="scheduler")
    pipeline, params = FlaxStableDiffusionPipeline.from_pretrained(sd.folder, scheduler=scheduler)
    params["scheduler"] = scheduler_state
    prompts, negatives, key = ["a red circle", "a blue cat"], ["blurry", "red background"], jax.random.PRNGKey(5)
    ids, neg_ids = pipeline.prepare_inputs(prompts), pipeline.prepare_inputs(negatives)
    out = pipeline(ids, params, key, num_inference_steps=3, guidance_scale=6.0, neg_prompt_ids=neg_ids)
    assert out.images.shape == (2, 64, 64, 3) and out.nsfw_content_detected == [False, False]
    torch_scheduler = DPMSolverMultistepScheduler.from_pretrained(sd.folder, subfolder="scheduler")
    reference = type(sd.reference)(**{**sd.reference.components, "scheduler": torch_scheduler})
    want = torch_images(reference, prompts, [key], 3, negative_prompt=negatives, guidance_scale=6.0)
    assert np.abs(out.images - want).max() < TOLERANCE


def test_sdxl_without_negative_prompt_guides_from_zero_embeddings(sdxl):
    prompts, key = ["a red circle", "llama oil"], jax.random.PRNGKey(9)
    ids = sdxl.pipeline.prepare_inputs(prompts)
    images = sdxl.pipeline(ids, sdxl.params, key, num_inference_steps=3, guidance_scale=5.0)[0]
    want = torch_images(sdxl.reference, prompts, [key], 3, guidance_scale=5.0)  # negative_prompt=None: zeros too
    assert images.shape == (2, 64, 64, 3)
    assert np.abs(images - want).max() < TOLERANCE


@pytest.mark.parametrize(
    ("cls", "kind"),
    [(FlaxPNDMScheduler, "pndm"), (FlaxEulerDiscreteScheduler, "euler"), (FlaxDPMSolverMultistepScheduler, "dpm++2m")],
)
def test_scheduler_stand_ins_return_scheduler_and_state(sd, cls, kind):
    scheduler, state = cls.from_pretrained(sd.folder, subfolder="scheduler")
    assert (scheduler.kind, state.kind) == (kind, kind)
    assert state == cls.from_config(json.loads(json.dumps(scheduler.config))).create_state()
    # no arrays: replicate, tree_map(astype) and pop pass the state through unchanged
    assert jax.tree_util.tree_leaves(state) == [] and jax.tree_util.tree_map(jnp.asarray, state) == state


def test_flax_revisions_load_the_safetensors_with_a_note(sd, caplog):
    with caplog.at_level(logging.WARNING, logger="jax-sd"):
        _, params = FlaxStableDiffusionPipeline.from_pretrained(
            sd.folder, revision="flax", dtype=jnp.bfloat16, from_pt=True, safety_checker=None, split_head_dim=True
        )
    assert "held Flax weights" in caplog.text and "safetensors" in caplog.text
    assert {np.dtype(a.dtype).name for a in jax.tree_util.tree_leaves(params)} == {"bfloat16"}
    assert set(params) == {"text_encoder", "unet", "vae", "scheduler"}


KEY = jax.random.PRNGKey(0)


def _call(sd, **kwargs):
    ids = sd.pipeline.prepare_inputs(["a red circle"] * 2)
    call = dict(prompt_ids=ids, params=sd.params, prng_seed=KEY, num_inference_steps=2)
    return sd.pipeline(**(call | kwargs))


FAILURES = {  # what fails, and what its message names
    "safety checker": (lambda sd, sdxl: FlaxStableDiffusionPipeline.from_pretrained("x/y", safety_checker=1), "None"),
    "component": (lambda sd, sdxl: FlaxStableDiffusionPipeline.from_pretrained("x/y", unet=1), "save_pretrained"),
    "other revision": (
        lambda sd, sdxl: FlaxStableDiffusionPipeline.from_pretrained("x/y", revision="v2"),
        "hf download",
    ),
    "unknown keyword": (lambda sd, sdxl: FlaxStableDiffusionPipeline.from_pretrained("x/y", strength=1), "strength"),
    "scheduler object": (
        lambda sd, sdxl: FlaxStableDiffusionPipeline.from_pretrained("x/y", scheduler=1),
        "subfolder=",
    ),
    "sd folder, xl class": (
        lambda sd, sdxl: FlaxStableDiffusionXLPipeline.from_pretrained(sd.folder),
        "load it with FlaxStableDiffusionPipeline",
    ),
    "jit, not sharded": (lambda sd, sdxl: _call(sd, jit=True), "flax.training.common_utils.shard"),
    "jit, not replicated": (
        lambda sd, sdxl: _call(
            sd, jit=True, prompt_ids=sd.pipeline.prepare_inputs(["a"])[None], prng_seed=np.zeros((1, 2))
        ),
        "flax.jax_utils.replicate(params)",
    ),
    "split keys without jit": (
        lambda sd, sdxl: _call(sd, prng_seed=jax.random.split(jax.random.PRNGKey(0), 2)),
        "jax.random.PRNGKey(seed)",
    ),
    "latents shape": (lambda sd, sdxl: _call(sd, latents=np.zeros((2, 4, 4, 4))), "expected (2, 4, 8, 8)"),
    "another scheduler's state": (
        lambda sd, sdxl: _call(sd, params={**sd.params, "scheduler": FlaxEulerDiscreteScheduler().create_state()}),
        "scheduler=",
    ),
    "old module": (lambda sd, sdxl: sd.pipeline.unet, "engine.models.unet.UNet2DConditionModel"),
    "dpm of order 3": (lambda sd, sdxl: FlaxDPMSolverMultistepScheduler(solver_order=3), "solver_order=2"),
    "pndm with prk steps": (lambda sd, sdxl: FlaxPNDMScheduler(skip_prk_steps=False), "skip_prk_steps=True"),
    "sdxl output_type pil": (
        lambda sd, sdxl: sdxl.pipeline(sdxl.pipeline.prepare_inputs("a"), sdxl.params, KEY, output_type="pil"),
        "pipeline.numpy_to_pil(images)",
    ),
}


@pytest.mark.parametrize("case", sorted(FAILURES))
def test_unsupported_calls_fail_naming_the_replacement(sd, sdxl, case):
    call, names = FAILURES[case]
    with pytest.raises((ValueError, TypeError, AttributeError, ConfigError), match=re.escape(names)):
        call(sd, sdxl)


@pytest.mark.parametrize(
    ("name", "replacement"),
    [("FlaxLMSDiscreteScheduler", "FlaxEulerDiscreteScheduler"), ("FlaxStableDiffusionImg2ImgPipeline", "PyTorch")],
)
def test_old_names_without_a_counterpart_fail_on_import(name, replacement):
    with pytest.raises(ImportError, match=replacement):
        exec(f"from engine.compat.flax_api import {name}")


# The documents' results come last: their process runs while the tests above do.
def test_how_to_runs_as_written(documents):
    assert documents("how_to.prompt_ids").shape == (8, 77)
    assert documents("how_to.sharded_prompt_ids").shape == (8, 1, 77)
    for name in ("one_prompt", "eight_prompts", "p_generate"):
        assert documents(f"how_to.{name}").shape == (8, 1, 64, 64, 3)  # the document's (8, 1, 512, 512, 3)
    assert documents("how_to.one_prompt_pil").shape == (8, 64, 64, 3)
    # pmap(pipeline._generate) runs the pipeline's own computation: the same pictures from the same inputs
    assert np.abs(documents("how_to.p_generate") - documents("how_to.eight_prompts")).max() < 1e-5


@pytest.mark.parametrize("name", ["one_prompt", "eight_prompts"])
def test_how_to_pictures_equal_diffusers(sd, documents, name):
    prompts = [ONE_PROMPT] * DEVICES if name == "one_prompt" else EIGHT_PROMPTS
    want = torch_images(sd.reference, prompts, documents("how_to_f32.rng"), 50)
    got = documents(f"how_to_f32.{name}").reshape(want.shape)
    assert np.abs(got - want).max() < TOLERANCE
    assert got.std(axis=0).mean() > 0.02  # eight different pictures, not one constant that would match trivially
    bf16 = documents(f"how_to.{name}").reshape(want.shape)  # as written: bf16 weights, nearly the same pictures
    assert np.abs(bf16 - got).max() < 0.1


@pytest.mark.parametrize("run", ["post_f32", "post"])
def test_sdxl_post_runs_as_written(documents, run):
    assert documents(f"{run}.prompt_ids").shape == (1, 2, 77)  # one prompt, a row per tokenizer
    assert documents(f"{run}.p_prompt_ids").shape == (8, 1, 2, 77)
    assert documents(f"{run}.images").shape == (8, 1, 64, 64, 3)
    assert documents(f"{run}.pil").shape == (8, 64, 64, 3)


def test_sdxl_post_pictures_equal_diffusers(sdxl, documents):
    args = dict(negative_prompt=[LLAMA_NEGATIVE] * DEVICES, guidance_scale=5.0)
    want = torch_images(sdxl.reference, [LLAMA] * DEVICES, documents("post_f32.rng"), 25, **args)
    got = documents("post_f32.images").reshape(want.shape)
    assert np.abs(got - want).max() < TOLERANCE
    assert np.abs(documents("post_f32.pil") / 255 - want).max() < TOLERANCE  # what the post returns: PIL images
    assert got.std(axis=0).mean() > 0.02
    assert np.abs(documents("post.images").reshape(want.shape) - got).max() < 0.1  # as written, bf16
