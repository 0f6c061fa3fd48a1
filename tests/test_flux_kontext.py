"""FLUX.1 Kontext: editing a picture from an instruction, against diffusers' `FluxKontextPipeline`.

The transformer reads the reference picture's latents as tokens after the latents' (ids with first axis 1) and
predicts the latents' velocity alone: equal to diffusers' `FluxTransformer2DModel` fed the joined tokens and ids.
A reference picture is drawn at the preferred resolution nearest its aspect, as the pipeline's `_auto_resize`, for
any size: at FLUX.1's 16 pixels per token the resolution itself, and at a VAE of another factor floored to its token's
pixels as the pipeline's `multiple_of` (its VAE's factor times 2). End to end, a tiny Kontext folder (test_flux's dev
model with one block of each kind and a VAE of factor 32, so that a reference of about a megapixel is 256 tokens, not
FLUX.1's 4096) draws the pipeline's picture from the same latents; a request needs exactly one reference picture.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, FluxKontextPipeline
from diffusers import FluxTransformer2DModel as TorchFlux
from flax import nnx
from PIL import Image
from preview_reference import assert_fitted_previews
from reference import nchw, nhwc, randomize, rel_error
from test_flux import PROMPT, TRANSFORMER, VAE_LAYOUT, build_reference
from test_transformer_flux import LAYOUTS, inputs, ours_from_torch

from engine import GenerationRequest, InvalidRequest, load_pipeline
from engine.families.flux_kontext import PREFERRED_RESOLUTIONS
from engine.request_references import nearest_resolution, reference_size

TOL = 1e-5  # tiny configs, f32
LATENT_CHANNELS = 16
FACTOR = 32  # the tiny VAE's pixels per latent: a preferred resolution is 256 reference tokens (FLUX.1's 8: 4096)
LEVELS = FACTOR.bit_length()  # each block but the last halves the sides
# No mid attention: the encoder's first block runs at the reference's full megapixel
VAE = dict(
    VAE_LAYOUT,
    block_out_channels=(8,) + (16,) * (LEVELS - 1),
    down_block_types=("DownEncoderBlock2D",) * LEVELS,
    up_block_types=("UpDecoderBlock2D",) * LEVELS,
    norm_num_groups=4,
    latent_channels=LATENT_CHANNELS,
    use_quant_conv=False,
    use_post_quant_conv=False,
    mid_block_add_attention=False,
)
BLOCKS = ("block_out_channels", "down_block_types", "up_block_types")


def kontext_prediction(ref: TorchFlux, x, references, timestep, encoder_hidden_states, pooled_projections, guidance):
    """The transformer's output as FluxKontextPipeline gets it: the latents' tokens, then the reference's, with its
    ids (1, row, col); the output cut back to the latents' tokens and unpacked to NHWC."""
    b, h, w, c = x.shape
    _, rh, rw, _ = references.shape
    packed = FluxKontextPipeline._pack_latents(nchw(x), b, c, h, w)
    image = FluxKontextPipeline._pack_latents(nchw(references), b, c, rh, rw)
    latent_ids = FluxKontextPipeline._prepare_latent_image_ids(b, h // 2, w // 2, "cpu", torch.float32)
    image_ids = FluxKontextPipeline._prepare_latent_image_ids(b, rh // 2, rw // 2, "cpu", torch.float32)
    image_ids[..., 0] = 1
    with torch.no_grad():
        out = ref(
            hidden_states=torch.cat([packed, image], dim=1),
            encoder_hidden_states=torch.from_numpy(encoder_hidden_states),
            pooled_projections=torch.from_numpy(pooled_projections),
            timestep=torch.from_numpy(timestep),
            img_ids=torch.cat([latent_ids, image_ids], dim=0),
            txt_ids=torch.zeros(encoder_hidden_states.shape[1], 3),
            guidance=torch.from_numpy(guidance),
        ).sample[:, : packed.shape[1]]
    return nhwc(FluxKontextPipeline._unpack_latents(out, h * 8, w * 8, 8))


def test_the_transformer_reads_the_reference_as_kontext_does():
    """A reference grid of another shape than the latents': its tokens change the latents' prediction exactly as
    diffusers' joined sequence does, through one block of each kind (one jitted call: eager JAX compiles every op of
    the first call apart)."""
    ref = randomize(TorchFlux(**dict(LAYOUTS["dev"], num_layers=1, num_single_layers=1)))
    ours = ours_from_torch(ref)
    values = inputs(ours.config, (6, 10), tokens=7)
    values["references"] = np.random.default_rng(5).standard_normal((2, 10, 4, 16)).astype(np.float32)
    want = kontext_prediction(ref, **values)
    graph, state = nnx.split(ours)

    @jax.jit
    def predict(state, x, references, timestep, encoder_hidden_states, pooled_projections, guidance):
        model = nnx.merge(graph, state)
        context = model.project_context(encoder_hidden_states)
        return model(x, timestep, context, pooled_projections, guidance, references=references)

    got = np.asarray(predict(state, **values))
    assert got.shape == (2, 6, 10, 16)
    assert rel_error(got, want) < TOL, np.abs(got - want).max()


@pytest.fixture(scope="module")
def kontext(tmp_path_factory):
    """The pipeline and our engine on its folder: test_flux's dev model with one block of each kind and the VAE of
    factor 32. The engine draws one picture at a time (no idle lanes to run), a preview after every step."""
    flux = build_reference("dev", tmp_path_factory)
    vae = randomize(AutoencoderKL(**VAE, scaling_factor=0.3611, shift_factor=0.1159), 4, std=0.05)
    transformer = randomize(TorchFlux(**dict(TRANSFORMER, num_single_layers=1), guidance_embeds=True), 3, std=0.05)
    reference = FluxKontextPipeline(**dict(flux.components, vae=vae, transformer=transformer))
    folder = tmp_path_factory.mktemp("kontext")
    reference.save_pretrained(folder)
    engine = load_pipeline(folder, safety_checker=False, max_batch_size=1, preview_every_s=0.0)
    yield reference, engine
    engine.close()


def picture(width: int, height: int, seed: int = 0) -> Image.Image:
    """A smooth picture with detail at every scale, so that a resize that differs shows."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    waves = [np.sin(2 * np.pi * (f * x + g * y) + p) for f, g, p in rng.uniform(0, 6, (3, 3))]
    rgb = np.stack(waves, -1) * 0.4 + 0.5 + rng.uniform(-0.1, 0.1, (height, width, 3))
    return Image.fromarray(np.clip(rgb * 255, 0, 255).astype(np.uint8))


def pipeline_reference_size(pipe: FluxKontextPipeline, image: Image.Image, embeds: dict) -> tuple[int, int]:
    """The (width, height) FluxKontextPipeline resizes `image` to, read from its own run: its image processor's
    `resize` is stopped at its first call (the prompt given as embeddings: the text encoders are not what it reads)."""
    seen = []

    class Stop(Exception):
        pass

    def resize(image, height, width, **kwargs):
        seen.append((width, height))
        raise Stop

    pipe.image_processor.resize = resize
    try:
        with pytest.raises(Stop), torch.no_grad():
            pipe(image=image, **embeds, height=64, width=64, max_area=64 * 64, num_inference_steps=1)
    finally:
        del pipe.image_processor.resize
    return seen[0]


@pytest.fixture(scope="module")
def probes(kontext):
    """The tiny folder's pipeline, the same with a VAE of FLUX.1's factor, 8 (a token is 16 pixels: only its config is
    read, since the pipeline is stopped at its resize), and the prompt's embeddings both take."""
    reference, _ = kontext
    vae = AutoencoderKL(**{**VAE, **{k: VAE[k][:4] for k in BLOCKS}})
    with torch.no_grad():
        states, pooled, _ = reference.encode_prompt(PROMPT, PROMPT)
    embeds = dict(prompt_embeds=states, pooled_prompt_embeds=pooled)
    return reference, FluxKontextPipeline(**dict(reference.components, vae=vae)), embeds


@pytest.mark.parametrize(
    "size", [(64, 64), (72, 64), (96, 80), (80, 200), (1920, 1080), (700, 64), (100, 99), (1200, 1000)]
)
def test_a_reference_is_drawn_at_the_pipelines_preferred_resolution(kontext, probes, size):
    """At FLUX.1's factor the pipeline draws a reference at a preferred resolution itself; at the tiny VAE's factor of
    32 it floors the resolution (and the picture's sides it reads the aspect from) to 64 pixels, and so does the
    engine, which reads the factor from the folder's VAE."""
    _, ours = kontext
    reference, flux1, embeds = probes
    image = Image.new("RGB", size)
    want = pipeline_reference_size(flux1, image, embeds)
    assert want in PREFERRED_RESOLUTIONS
    assert nearest_resolution(*size, PREFERRED_RESOLUTIONS, 16) == want  # 16: FLUX.1's pixels per token
    assert reference_size(dataclasses.replace(ours.limits, side_multiple=16), image) == want
    want = pipeline_reference_size(reference, image, embeds)
    assert ours.limits.side_multiple == 2 * FACTOR
    assert reference_size(ours.limits, image) == want


def draw_both(kontext, image: Image.Image, height: int, width: int, steps: int = 2) -> tuple[np.ndarray, np.ndarray]:
    reference, ours = kontext
    shape = (1, LATENT_CHANNELS, height // FACTOR, width // FACTOR)
    start = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    packed = FluxKontextPipeline._pack_latents(torch.from_numpy(start), *shape)
    with torch.no_grad():
        want = reference(
            image=image, prompt=PROMPT, latents=packed, height=height, width=width, max_area=height * width,
            num_inference_steps=steps, guidance_scale=3.5, output_type="np",
        ).images  # fmt: skip
    got = ours.generate(
        PROMPT, references=(image,), latents=start, height=height, width=width, num_inference_steps=steps,
        guidance_scale=3.5,
    ).arrays  # fmt: skip
    return got, want


def test_pictures_match_diffusers(kontext):
    """A picture at its preferred resolution, and a small one the auto-resize scales up to it (one plan: the same
    reference size), both at the smallest size this factor allows, 8 tokens a side. Their difference is what the
    reference does to the picture: the error is a small part of it."""
    drawn = [draw_both(kontext, picture(*size), 512, 512) for size in ((1024, 1024), (72, 64))]
    error = max(np.abs(got - want).max() for got, want in drawn)
    effect = np.abs(drawn[0][1] - drawn[1][1]).max()
    assert error < 1 / 255
    assert error < effect / 20, (error, effect)
    assert min(want.std() for _, want in drawn) > 0.02  # a picture, not a flat field that any mistake would match


def test_defaults_are_the_pipelines_and_the_size_is_the_resized_references(kontext):
    _, ours = kontext
    assert (ours.family, ours.label) == ("flux_kontext", "FLUX.1 Kontext")
    want = {"height": 1024, "width": 1024, "num_inference_steps": 28, "guidance_scale": 3.5, "scheduler": "flow_euler"}
    assert ours.defaults == want
    request = GenerationRequest(PROMPT, references=(Image.new("RGB", (1200, 1000)),))
    resolved = ours.limits.resolve(request, ours.defaults)
    assert (resolved.width, resolved.height) == (1088, 896)  # the preferred resolution nearest 6:5, 1104x944, floored
    given = ours.limits.resolve(dataclasses.replace(request, width=576, height=512), ours.defaults)
    assert (given.width, given.height) == (576, 512)  # a size the request gives is kept
    # the start-up compiles the default request's plan with a reference picture of the default size
    assert [plan.references for plan in ours.warmup_plans()] == [((1024, 1024),)] * 2


def test_a_request_needs_exactly_one_reference_picture(kontext):
    _, ours = kontext
    with pytest.raises(InvalidRequest, match="send the picture to edit in references"):
        ours.generate(PROMPT, height=512, width=512, num_inference_steps=1)
    two = (Image.new("RGB", (64, 64)),) * 2
    with pytest.raises(InvalidRequest, match="2 reference pictures are too many; this model takes at most 1"):
        ours.generate(PROMPT, references=two, height=512, width=512, num_inference_steps=1)
    with pytest.raises(InvalidRequest, match="reference 1 is 10x10; a reference picture needs sides of at least 64"):
        ours.generate(PROMPT, references=(Image.new("RGB", (10, 10)),), num_inference_steps=1)


def test_previews_are_the_fitted_map_of_the_steps_latents(kontext):
    """As FLUX.1's: the reference's tokens change the latents, not how a preview is drawn from them
    (tests/preview_reference.py)."""
    reference, ours = kontext
    assert_fitted_previews("kontext", reference, ours)
