"""FLUX.2's VAE equals diffusers' `AutoencoderKLFlux2`, and its latent space is Flux2KleinPipeline's: encoding a
reference picture as `_encode_vae_image` does (mode, patchify, batch-norm statistics) and decoding the final latents
as the end of its `__call__` does (unpack, denormalise, unpatchify, decode), f32 at a tiny config."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLFlux2 as TorchVAE
from diffusers import Flux2KleinPipeline
from flax import nnx
from reference import nchw, nhwc, randomize, rel_error, state_dict_numpy

from engine.errors import ConfigError
from engine.loading.weights import load_model
from engine.models.vae_flux2 import AutoencoderKLFlux2, Flux2VAEConfig, patchify, unpatchify

TOL = 1e-5

TINY = dict(  # two blocks (one 2x downsampling), decoder widths of its own, 4 latent channels (16 patchified)
    block_out_channels=(8, 16),
    decoder_block_out_channels=(8, 24),
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    latent_channels=4,
    norm_num_groups=4,
    layers_per_block=1,
    sample_size=32,
)


@pytest.fixture(scope="module")
def vaes():
    ref = randomize(TorchVAE(**TINY))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # statistics far from (0, 1), so that a normalisation left out or inverted shows
        ref.bn.running_mean.copy_(torch.randn(16, generator=gen))
        ref.bn.running_var.copy_(0.2 + 3 * torch.rand(16, generator=gen))
    cfg = Flux2VAEConfig.from_dict(dict(ref.config))
    return ref, load_model(lambda: AutoencoderKLFlux2(cfg, nnx.Rngs(0)), state_dict_numpy(ref))


def images(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (2, 16, 24, 3)).astype(np.float32)


def test_encode_is_the_pipelines_reference_latents(vaes):
    ref, ours = vaes
    x = images()
    pipe = types.SimpleNamespace(vae=ref, _patchify_latents=Flux2KleinPipeline._patchify_latents)
    with torch.no_grad():
        want = nhwc(Flux2KleinPipeline._encode_vae_image(pipe, nchw(x), generator=None))
    got = np.asarray(ours.encode_latents(x))
    assert got.shape == (2, 4, 6, 16)
    assert rel_error(got, want) < TOL


def test_decode_is_the_pipelines_last_steps(vaes):
    ref, ours = vaes
    grid = np.random.default_rng(2).standard_normal((2, 4, 6, 16)).astype(np.float32)
    latents = nchw(grid)
    with torch.no_grad():  # Flux2KleinPipeline.__call__ after its loop, from the packed tokens
        ids = Flux2KleinPipeline._prepare_latent_ids(latents)
        x = Flux2KleinPipeline._unpack_latents_with_ids(Flux2KleinPipeline._pack_latents(latents), ids, 4, 6)
        mean, var = ref.bn.running_mean.view(1, -1, 1, 1), ref.bn.running_var.view(1, -1, 1, 1)
        x = x * torch.sqrt(var + ref.config.batch_norm_eps) + mean
        want = nhwc(ref.decode(Flux2KleinPipeline._unpatchify_latents(x), return_dict=False)[0])
    got = np.asarray(ours.decode_latents(grid))
    assert got.shape == (2, 16, 24, 3)
    assert rel_error(got, want) < TOL


def test_the_vae_alone_matches_diffusers(vaes):
    """Encode's moments and decode, before any patchifying: the networks themselves."""
    ref, ours = vaes
    x = images(3)
    with torch.no_grad():
        posterior = ref.encode(nchw(x)).latent_dist
        z = posterior.mean
        decoded = nhwc(ref.decode(z).sample)
    mean, logvar = ours.encode(x)
    assert rel_error(mean, nhwc(posterior.mean)) < TOL
    assert rel_error(logvar, nhwc(posterior.logvar)) < TOL
    assert rel_error(ours.decode(nhwc(z)), decoded) < TOL


def test_patchify_is_the_pipelines_and_unpatchify_undoes_it():
    x = np.random.default_rng(4).standard_normal((2, 6, 10, 3)).astype(np.float32)
    want = nhwc(Flux2KleinPipeline._patchify_latents(nchw(x)))
    np.testing.assert_array_equal(np.asarray(patchify(x)), want)
    np.testing.assert_array_equal(np.asarray(unpatchify(patchify(x))), x)


def test_a_patch_other_than_2x2_is_refused():
    with pytest.raises(ConfigError, match="patch_size .* the pipeline patchifies 2x2"):
        Flux2VAEConfig.from_dict(dict(TINY, patch_size=[1, 1]))


def test_the_decoder_widths_default_to_the_encoders():
    assert Flux2VAEConfig.from_dict(dict(TINY, decoder_block_out_channels=None)).decoder_channels == (8, 16)
