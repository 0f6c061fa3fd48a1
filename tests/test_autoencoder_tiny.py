"""The tiny autoencoder (TAESD) equals diffusers' `AutoencoderTiny` on tiny random configs: f32, rel. error < 1e-5."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import AutoencoderTiny as TorchTiny
from flax import nnx
from reference import nchw, nhwc, randomize, rel_error, state_dict_numpy

from engine.errors import ConfigError, WeightsError
from engine.loading.weights import convert, export
from engine.models.autoencoder_tiny import AutoencoderTiny
from engine.models.config import AutoencoderTinyConfig

TOL = 1e-5

TINY_LAYOUTS = {
    "taesd": dict(  # SD 1.x/2.x/XL: 4 latent channels, ReLU
        encoder_block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        num_encoder_blocks=(1, 2, 1, 1),
        num_decoder_blocks=(1, 1, 2, 1),
    ),
    "taesd3": dict(  # SD3/FLUX: 16 latent channels and a shift; SiLU for another activation
        encoder_block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        num_encoder_blocks=(1, 1, 1, 2),
        num_decoder_blocks=(2, 1, 1, 1),
        latent_channels=16,
        act_fn="silu",
        scaling_factor=1.5305,
        shift_factor=0.0609,
    ),
}

# madebyollin/taesd's config.json as published (taesdxl's is the same).
TAESD_CONFIG = {
    "_class_name": "AutoencoderTiny",
    "act_fn": "relu",
    "decoder_block_out_channels": [64, 64, 64, 64],
    "encoder_block_out_channels": [64, 64, 64, 64],
    "force_upcast": False,
    "in_channels": 3,
    "latent_channels": 4,
    "latent_magnitude": 3,
    "latent_shift": 0.5,
    "num_decoder_blocks": [3, 3, 3, 1],
    "num_encoder_blocks": [1, 3, 3, 3],
    "out_channels": 3,
    "scaling_factor": 1.0,
    "upsampling_scaling_factor": 2,
}


def reference_and_ours(layout: str):
    torch.manual_seed(0)
    ref = randomize(TorchTiny(**TINY_LAYOUTS[layout]))
    cfg = AutoencoderTinyConfig.from_dict(dict(ref.config))
    tensors = state_dict_numpy(ref)
    graphdef, state = convert(lambda: AutoencoderTiny(cfg, nnx.Rngs(0)), tensors, where="vae")  # strict
    return ref, nnx.merge(graphdef, state), tensors


@pytest.mark.parametrize("layout", sorted(TINY_LAYOUTS))
@pytest.mark.parametrize("size", [(32, 32), (24, 40)])  # pixels; latents 4x4 and 3x5
def test_tiny_autoencoder_matches_diffusers(layout, size):
    ref, ours, tensors = reference_and_ours(layout)
    assert export(ours).keys() == tensors.keys()
    rng = np.random.default_rng(1)
    image = rng.uniform(-1, 1, (2, *size, 3)).astype(np.float32)
    latents = 2 * rng.standard_normal((2, size[0] // 8, size[1] // 8, ref.config.latent_channels)).astype(np.float32)
    with torch.no_grad():
        want_latents = ref.encode(nchw(image)).latents
        want_image = ref.decode(nchw(latents)).sample
    got_latents, logvar = ours.encode(image)
    got_image = ours.decode(latents)
    assert got_latents.dtype == got_image.dtype == np.float32
    assert got_latents.shape == (2, size[0] // 8, size[1] // 8, ref.config.latent_channels)
    assert got_image.shape == (2, *size, 3)
    assert rel_error(got_latents, nhwc(want_latents)) < TOL
    assert rel_error(got_image, nhwc(want_image)) < TOL
    assert logvar.shape == got_latents.shape and float(logvar.max()) == -30.0


def test_a_checkpoint_missing_a_key_is_refused_by_name():
    ref, _, tensors = reference_and_ours("taesd")
    cfg = AutoencoderTinyConfig.from_dict(dict(ref.config))
    del tensors["decoder.layers.4.weight"]  # the first upsampling's conv (bias-free)
    with pytest.raises(WeightsError, match=r"missing \(1\): decoder\.layers\.4\.weight"):
        convert(lambda: AutoencoderTiny(cfg, nnx.Rngs(0)), tensors, where="vae")


def test_the_published_taesd_config_loads_its_full_size_weights():
    cfg = AutoencoderTinyConfig.from_dict(TAESD_CONFIG)
    assert cfg.vae_scale_factor == 8 and cfg.block_out_channels == (64, 64, 64, 64)
    assert (cfg.scaling_factor, cfg.shift_factor, cfg.latents_mean, cfg.latents_std) == (1.0, 0.0, None, None)
    ref = TorchTiny(**{k: v for k, v in TAESD_CONFIG.items() if not k.startswith("_")})
    convert(lambda: AutoencoderTiny(cfg, nnx.Rngs(0)), state_dict_numpy(ref), where="vae")  # every key, every shape


@pytest.mark.parametrize(
    "change, message",
    [
        ({"upsample_fn": "bilinear"}, "upsample_fn 'bilinear' is not supported"),
        ({"act_fn": "tanh"}, "act_fn 'tanh' is not supported"),
        ({"num_decoder_blocks": [3, 3, 1]}, "decoder_block_out_channels and num_decoder_blocks differ in length"),
        ({"encoder_block_out_channels": [32, 64, 64, 64]}, "encoder_block_out_channels .* must all be equal"),
        ({"upsampling_scaling_factor": 4}, "the encoder shrinks sides 8x but the decoder grows them 64x"),
        ({"new_switch": True}, "unknown keys for AutoencoderTinyConfig: new_switch"),
    ],
)
def test_an_unsupported_tiny_config_is_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        AutoencoderTinyConfig.from_dict({**TAESD_CONFIG, **change})
