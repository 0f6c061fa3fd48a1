"""Live previews and the tiny VAEs of the 2026 families: FLUX.2 [klein] with TAEF2, Z-Image and FLUX.1 Kontext with
TAEF1 (FLUX.1's latent space), against diffusers' pipelines on the tiny folders of tests/test_flux2_klein.py,
tests/test_z_image.py and tests/test_flux_kontext.py (their builders; tests/preview_reference.py runs a request
through both sides).

With a tiny VAE given (`load_pipeline(folder, vae=...)`), the pictures are diffusers' with that VAE swapped in,
within 1/255, and the previews are its full-size pictures of each step's latents. (With the model's own VAE, the
previews are the fitted latent-to-RGB map: tested in those three modules, over their engines.)

TAEF2 is taesd.py's FLUX.2 variant (madebyollin/taesd, "Add support for FLUX.2 VAE"): TAESD with a GroupNorm branch
in each block at the latents' resolution (`use_midblock_gn`), which diffusers' `AutoencoderTiny` cannot express. Its
PyTorch reference here is diffusers' `AutoencoderTiny` with that branch added to those blocks as taesd.py builds
it, and it decodes what Flux2KleinPipeline decodes when its VAE's batch norm is the identity (the way madebyollin's
wrapper plugs TAEF2 into the pipeline): the normalised latents, unpatchified to 32 channels (here 4).
"""

from __future__ import annotations

import json
import types

import jax
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, AutoencoderTiny, Flux2KleinPipeline, FluxKontextPipeline, ZImagePipeline
from diffusers import FluxTransformer2DModel as TorchFlux
from diffusers.models.unets.unet_2d_blocks import AutoencoderTinyBlock
from flax import nnx
from preview_reference import SIZES, STEPS, run_diffusers, run_ours, start
from reference import nchw, nhwc, randomize, rel_error, state_dict_numpy
from test_flux import TRANSFORMER as FLUX_TRANSFORMER
from test_flux import build_reference as build_flux
from test_flux2_klein import build_reference as build_klein
from test_flux_kontext import VAE as KONTEXT_VAE
from test_z_image import build_reference as build_zimage

from engine import load_pipeline
from engine.errors import SourceError
from engine.loading.weights import convert
from engine.models import autoencoder_tiny
from engine.models.config import AutoencoderTinyConfig
from engine.sampling.preview import DecodedPreview

TOLERANCE = 1 / 255
TAEF1_SCALING = dict(scaling_factor=0.3611, shift_factor=0.1159)  # madebyollin/taef1's config.json


# -- TAEF2 in PyTorch: diffusers' AutoencoderTiny plus taesd.py's mid-block GroupNorm branch ------------------------


def _pooled_forward(self, x: torch.Tensor) -> torch.Tensor:
    x = x + self.pool(x)  # the branch, ahead of the block's own convolutions and skip
    return self.fuse(self.conv(x) + self.skip(x))


def _stages(layers) -> list[list[AutoencoderTinyBlock]]:
    """The runs of consecutive blocks in a tiny VAE side's layers: one per resolution."""
    runs, run = [], []
    for layer in layers:
        if isinstance(layer, AutoencoderTinyBlock):
            run.append(layer)
        elif run:
            runs, run = runs + [run], []
    return runs + ([run] if run else [])


def torch_taef2(**layout) -> AutoencoderTiny:
    """TAEF2's layout at a tiny size: each block of the encoder's last stage and of the decoder's first gets
    `x + pool(x)`, pool = 1x1 conv to 4x the width (no bias), GroupNorm(4 groups), ReLU, 1x1 conv back (no bias)."""
    vae = AutoencoderTiny(**layout)
    for block in _stages(vae.encoder.layers)[-1] + _stages(vae.decoder.layers)[0]:
        width = block.conv[0].in_channels
        block.pool = torch.nn.Sequential(
            torch.nn.Conv2d(width, 4 * width, 1, bias=False),
            torch.nn.GroupNorm(4, 4 * width),
            torch.nn.ReLU(),
            torch.nn.Conv2d(4 * width, width, 1, bias=False),
        )
        block.forward = types.MethodType(_pooled_forward, block)
    return vae


def save_taef2(vae: AutoencoderTiny, folder) -> None:
    """A TAEF2 folder: diffusers' files, the config naming the branch (`use_midblock_gn`, taesd.py's name)."""
    vae.save_pretrained(folder)
    config = folder / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "use_midblock_gn": True}))


TINY = dict(  # factor 2 (two levels), as the tiny folders' KL VAEs
    encoder_block_out_channels=(8, 8),
    decoder_block_out_channels=(8, 8),
    num_encoder_blocks=(1, 2),
    num_decoder_blocks=(2, 1),
)


def test_taef2_equals_its_pytorch_layout():
    """Encoder and decoder, every tensor matched (the branch's `pool.0`, `pool.1`, `pool.3` included), at a size
    whose group statistics span the whole picture: a branch left out, misplaced or normed per pixel shows."""
    ref = randomize(torch_taef2(**TINY, latent_channels=4), 2, std=0.2)
    config = AutoencoderTinyConfig.from_dict({**dict(ref.config), "use_midblock_gn": True})
    tensors = state_dict_numpy(ref)
    assert sum(".pool." in key for key in tensors) == 4 * 4  # 2 encoder + 2 decoder blocks, 4 tensors each
    graphdef, state = convert(lambda: autoencoder_tiny.AutoencoderTiny(config, nnx.Rngs(0)), tensors, where="taef2")
    images = np.random.default_rng(0).uniform(-1, 1, (2, 24, 40, 3)).astype(np.float32)
    with torch.no_grad():
        want_latents = ref.encode(nchw(images)).latents
        want_images = ref.decode(want_latents).sample

    @jax.jit  # one program: eager JAX would compile every op apart
    def roundtrip(state, images):
        ours = nnx.merge(graphdef, state)
        latents, _ = ours.encode(images)
        return latents, ours.decode(latents)

    latents, decoded = roundtrip(state, images)
    assert rel_error(np.asarray(latents), nhwc(want_latents)) < 1e-5
    assert rel_error(np.asarray(decoded), nhwc(want_images)) < 1e-5
    plain = AutoencoderTiny(**TINY, latent_channels=4)  # the same weights without the branch draw otherwise
    plain.load_state_dict({k: v for k, v in ref.state_dict().items() if ".pool." not in k})
    with torch.no_grad():
        assert (plain.decode(want_latents).sample - want_images).abs().max() > 0.05


# -- the three families: the folder, diffusers with a tiny VAE swapped in, our engines with and without it ---------


def identity_batch_norm(vae: AutoencoderTiny, channels: int) -> AutoencoderTiny:
    """What Flux2KleinPipeline reads of its VAE beside encode/decode: a batch norm whose statistics are (0, 1) and
    eps 0, so that its (de)normalisation leaves the latents as they are (madebyollin's wrapper does the same)."""
    vae.bn = torch.nn.BatchNorm2d(channels, affine=False, eps=0.0).eval()
    vae.register_to_config(batch_norm_eps=0.0)
    return vae


def klein_parts(tmp_path_factory):
    reference = build_klein(tmp_path_factory.mktemp("klein-parts"))
    where = tmp_path_factory.mktemp("taef2")
    save_taef2(randomize(torch_taef2(**TINY, latent_channels=4), 11, std=0.2), where)
    tiny = identity_batch_norm(randomize(torch_taef2(**TINY, latent_channels=4), 11, std=0.2), 16)
    return reference, Flux2KleinPipeline(**{**reference.components, "vae": tiny}, is_distilled=True), where


def zimage_parts(tmp_path_factory):
    reference = build_zimage(tmp_path_factory)
    where = tmp_path_factory.mktemp("taef1-z")
    randomize(AutoencoderTiny(**TINY, latent_channels=16, **TAEF1_SCALING), 11).save_pretrained(where)
    return reference, ZImagePipeline(**{**reference.components, "vae": AutoencoderTiny.from_pretrained(where)}), where


def mid_grey(vae: AutoencoderTiny) -> AutoencoderTiny:
    """Six random levels of ReLU blocks drift far from 0 (all black, or all white at larger weights): the last
    conv's bias moved so that the pictures of random latents average mid-grey, with their detail left as it was."""
    with torch.no_grad():
        latents = torch.randn(1, vae.config.latent_channels, 16, 16, generator=torch.Generator().manual_seed(0))
        pictures = vae.decode(latents).sample
        vae.decoder.layers[-1].bias -= (pictures.mean(dim=(0, 2, 3)) + 1) / 2  # the decoder's [0, 1] -> [-1, 1]
    return vae


KONTEXT_LEVELS = len(KONTEXT_VAE["block_out_channels"])  # factor 32, as test_flux_kontext's folder


def kontext_parts(tmp_path_factory):
    flux = build_flux("dev", tmp_path_factory)
    vae = randomize(AutoencoderKL(**KONTEXT_VAE, **TAEF1_SCALING), 4, std=0.05)
    transformer = randomize(TorchFlux(**dict(FLUX_TRANSFORMER, num_single_layers=1), guidance_embeds=True), 3, std=0.05)
    reference = FluxKontextPipeline(**dict(flux.components, vae=vae, transformer=transformer))
    where = tmp_path_factory.mktemp("taef1-kontext")
    levels = dict(
        encoder_block_out_channels=(8,) * KONTEXT_LEVELS,
        decoder_block_out_channels=(8,) * KONTEXT_LEVELS,
        num_encoder_blocks=(1,) * KONTEXT_LEVELS,
        num_decoder_blocks=(1,) * KONTEXT_LEVELS,
    )
    tiny = randomize(AutoencoderTiny(**levels, latent_channels=16, **TAEF1_SCALING), 11, std=0.13)
    mid_grey(tiny).save_pretrained(where)
    tiny = AutoencoderTiny.from_pretrained(where)
    return reference, FluxKontextPipeline(**{**reference.components, "vae": tiny}), where


PARTS = {"klein": klein_parts, "zimage": zimage_parts, "kontext": kontext_parts}


@pytest.fixture(scope="module")
def family(request, tmp_path_factory):
    """Per family: diffusers' pipeline with a tiny VAE swapped in, and our engine given that VAE's folder (previews
    after every step)."""
    cache = {}

    def get(name: str):
        if name not in cache:
            reference, tiny, where = PARTS[name](tmp_path_factory)
            folder = tmp_path_factory.mktemp(name)
            reference.save_pretrained(folder)
            ours = load_pipeline(folder, vae=str(where), safety_checker=False, preview_every_s=0.0, max_batch_size=1)
            cache[name] = tiny, ours, folder
        return cache[name]

    yield get
    for _, engine, _ in cache.values():
        engine.close()


def tiny_decode(name: str, pipe, latents: torch.Tensor) -> np.ndarray:
    """diffusers' tiny VAE's picture of a step's latents, as its pipeline decodes the last ones."""
    vae = pipe.vae
    if name == "klein":  # the identity batch norm: only unpatchified
        latents = pipe._unpatchify_latents(latents)
    else:
        latents = latents / vae.config.scaling_factor + vae.config.shift_factor
    with torch.no_grad():
        image = vae.decode(latents).sample
    return np.round(pipe.image_processor.postprocess(image, output_type="np")[0] * 255)


@pytest.mark.parametrize("name", ["klein", "zimage", "kontext"])
def test_a_tiny_vae_draws_the_pictures_and_previews_diffusers_draws_with_it(name, family):
    """TAEF2 for Klein, TAEF1 for Z-Image and Kontext: the picture within 1/255, each preview the tiny VAE's
    full-size picture of that step's latents within a byte."""
    reference, ours, _ = family(name)
    assert ours.model.tiny_vae and isinstance(ours.preview, DecodedPreview)
    assert ours.model.vae_config.use_midblock_gn == (name == "klein")
    noise = start(name, ours)
    want, seen = run_diffusers(name, reference, noise)
    got, previews = run_ours(name, ours, noise)
    assert want.std() > 0.02  # a picture, not a flat field that any mistake would still match
    error = float(np.abs(got - want).max())
    assert error < TOLERANCE, error
    assert sorted(previews) == list(range(1, STEPS))
    for i, preview in previews.items():
        assert preview.shape == (SIZES[name], SIZES[name], 3) and preview.dtype == np.uint8  # full size
        assert np.abs(preview.astype(np.float32) - tiny_decode(name, reference, seen[i])).max() <= 1, f"step {i}"


def test_a_taef1_for_klein_is_refused_by_name(family, tmp_path):
    """A tiny VAE of FLUX.1's 16 channels does not draw Klein's latents (its VAE's 4 here, 32 at full size)."""
    *_, folder = family("klein")
    AutoencoderTiny(**TINY, latent_channels=16, **TAEF1_SCALING).save_pretrained(tmp_path)
    with pytest.raises(SourceError, match="its latent_channels is 16, the model's UNet draws 4.*FLUX.2 32"):
        load_pipeline(folder, vae=str(tmp_path), safety_checker=False)
