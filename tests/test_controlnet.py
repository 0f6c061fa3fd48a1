"""ControlNet equals diffusers' `ControlNetModel`, and our UNet takes its residuals as diffusers' UNet does.

Tiny random models (every weight redrawn, the zero-initialised 1x1 convs too), f32, written with
`save_pretrained` and read back with `load_controlnet`: residuals and UNet outputs within 1e-4 relative error.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import ControlNetModel as TorchControlNet
from diffusers import UNet2DConditionModel as TorchUNet
from diffusers.image_processor import VaeImageProcessor
from flax import nnx
from PIL import Image
from reference import UNET_LAYOUTS, nchw, nhwc, randomize, rel_error, state_dict_numpy
from safetensors.numpy import load_file, save_file

from engine.errors import ConfigError, WeightsError
from engine.loading.controlnet import load_controlnet
from engine.loading.weights import load_model
from engine.models.config import UNetConfig
from engine.models.controlnet import ControlNetConfig
from engine.models.unet import UNet2DConditionModel
from engine.sampling.images import canny_image, control_image_array

TOL = 1e-4
# Three stride-2 steps as in every published ControlNet (16, 32, 96, 256): control images at 8x the latents.
EMBEDDING_CHANNELS = (8, 8, 16, 16)


def torch_pair(layout: str, seed: int = 0, **controlnet_kwargs) -> tuple[TorchUNet, TorchControlNet]:
    unet = randomize(TorchUNet(**UNET_LAYOUTS[layout]), seed)
    controlnet = TorchControlNet.from_unet(
        unet, conditioning_embedding_out_channels=EMBEDDING_CHANNELS, **controlnet_kwargs
    )
    return unet, randomize(controlnet, seed + 1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Per layout: diffusers' UNet and ControlNet, and ours loaded from the ControlNet's saved folder."""
    cache = {}

    def get(layout: str, **controlnet_kwargs):
        key = (layout, tuple(sorted(controlnet_kwargs.items())))
        if key not in cache:
            unet, controlnet = torch_pair(layout, **controlnet_kwargs)
            folder = tmp_path_factory.mktemp(f"controlnet-{layout}")
            controlnet.save_pretrained(folder)
            ours_unet = load_model(
                lambda: UNet2DConditionModel(UNetConfig.from_dict(dict(unet.config)), nnx.Rngs(0)),
                state_dict_numpy(unet),
            )
            cache[key] = unet, controlnet, ours_unet, load_controlnet(folder).model()
        return cache[key]

    return get


def inputs(layout: str, size: tuple[int, int], batch: int = 2, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    cross = UNET_LAYOUTS[layout]["cross_attention_dim"]
    out = dict(
        sample=rng.standard_normal((batch, *size, 4)).astype(np.float32),
        timesteps=np.array([999.0, 37.5][:batch], np.float32),
        encoder_hidden_states=rng.standard_normal((batch, 7, cross)).astype(np.float32),
        controlnet_cond=rng.uniform(0, 1, (batch, size[0] * 8, size[1] * 8, 3)).astype(np.float32),
    )
    if UNET_LAYOUTS[layout].get("addition_embed_type") == "text_time":
        out["text_embeds"] = rng.standard_normal((batch, 32)).astype(np.float32)
        out["time_ids"] = np.array([[64, 96, 0, 0, 64, 96], [32, 32, 8, 4, 64, 64]][:batch], np.float32)
    return out


def torch_inputs(x: dict) -> tuple[tuple, dict]:
    args = (nchw(x["sample"]), torch.from_numpy(x["timesteps"]), torch.from_numpy(x["encoder_hidden_states"]))
    extra = {}
    if "text_embeds" in x:
        extra["added_cond_kwargs"] = {k: torch.from_numpy(x[k]) for k in ("text_embeds", "time_ids")}
    return args, extra


def torch_residuals(controlnet, x: dict, scale: float = 1.0, guess_mode: bool = False):
    args, extra = torch_inputs(x)
    with torch.no_grad():
        down, mid = controlnet(
            *args,
            controlnet_cond=nchw(x["controlnet_cond"]),
            conditioning_scale=scale,
            guess_mode=guess_mode,
            return_dict=False,
            **extra,
        )
    return down, mid


@pytest.mark.parametrize(
    "layout, size",
    [("sd1", (8, 8)), ("sd1", (9, 14)), ("sd2", (8, 8)), ("sdxl", (8, 8))],  # (9, 14): no multiple of 2**depth
)
@pytest.mark.parametrize("text", ["hidden states", "projected"])  # projected: as the server's steps pass it
def test_residuals_match_diffusers(saved, layout, size, text):
    _, controlnet, _, ours = saved(layout)
    x = inputs(layout, size)
    want_down, want_mid = torch_residuals(controlnet, x, scale=0.7)
    if text == "projected":
        assert len(ours.cross_attentions()) == sum(name.endswith(".attn2") for name, _ in controlnet.named_modules())
        x["encoder_hidden_states"] = ours.project_context(x["encoder_hidden_states"])
    down, mid = ours(**x, conditioning_scale=0.7)
    assert len(down) == len(want_down)
    for got, want in zip(down, want_down, strict=True):
        assert got.shape == nhwc(want).shape
        assert rel_error(got, nhwc(want)) < TOL
    assert rel_error(mid, nhwc(want_mid)) < TOL


@pytest.mark.parametrize("layout", ["sd1", "sd2"])
def test_unet_with_residuals_matches_diffusers(saved, layout):
    unet, controlnet, ours_unet, _ = saved(layout)
    x = inputs(layout, (8, 8))
    down, mid = torch_residuals(controlnet, x)
    args, extra = torch_inputs(x)
    with torch.no_grad():
        want = unet(*args, down_block_additional_residuals=down, mid_block_additional_residual=mid, **extra).sample
        plain = unet(*args, **extra).sample
    got = ours_unet(
        x["sample"],
        x["timesteps"],
        x["encoder_hidden_states"],
        down_block_additional_residuals=tuple(nhwc(r) for r in down),
        mid_block_additional_residual=nhwc(mid),
    )
    assert rel_error(got, nhwc(want)) < TOL
    assert rel_error(nhwc(want), nhwc(plain)) > 1e-2  # the residuals do change the output


@pytest.mark.parametrize("guess_mode", [False, True])
def test_conditioning_scale_per_image_and_guess_mode(saved, guess_mode):
    """A scale per image (traced, so continuous batching can mix requests) equals diffusers run image by image."""
    _, controlnet, _, ours = saved("sd1")
    x = inputs("sd1", (8, 8))
    scales = [0.5, 1.5]
    down, mid = ours(**x, conditioning_scale=np.array(scales, np.float32), guess_mode=guess_mode)
    for row, scale in enumerate(scales):
        want_down, want_mid = torch_residuals(controlnet, x, scale=scale, guess_mode=guess_mode)
        for got, want in zip(down, want_down, strict=True):
            assert rel_error(got[row], nhwc(want)[row]) < TOL
        assert rel_error(mid[row], nhwc(want_mid)[row]) < TOL


@pytest.mark.parametrize("option", [{"controlnet_conditioning_channel_order": "bgr"}, {"global_pool": True}])
def test_config_options_match_diffusers(saved, option, tmp_path):
    if "global_pool" in option:  # not a from_unet argument: set in the saved config, as the "shuffle" models do
        _, plain = torch_pair("sd1")
        controlnet = TorchControlNet.from_config({**plain.config, "global_pool_conditions": True})
        controlnet.load_state_dict(plain.state_dict())
        controlnet.save_pretrained(tmp_path)
        ours = load_controlnet(tmp_path).model()
    else:
        _, controlnet, _, ours = saved("sd1", **option)
    x = inputs("sd1", (8, 8))
    want_down, want_mid = torch_residuals(controlnet, x)
    down, mid = ours(**x)
    for got, want in zip(down, want_down, strict=True):
        assert rel_error(got, nhwc(want)) < TOL
    assert rel_error(mid, nhwc(want_mid)) < TOL


def test_strict_loading_names_a_missing_tensor(tmp_path):
    _, controlnet = torch_pair("sd1")
    controlnet.save_pretrained(tmp_path)
    weights = tmp_path / "diffusion_pytorch_model.safetensors"
    tensors = load_file(str(weights))
    del tensors["controlnet_down_blocks.3.weight"]
    save_file(tensors, str(weights))
    with pytest.raises(WeightsError, match=r"missing \(1\): controlnet_down_blocks\.3\.weight"):
        load_controlnet(tmp_path)


def test_pipeline_folder_and_fp16_variant(tmp_path):
    """A pipeline folder's controlnet/ sub-folder loads, and half precision prefers the fp16 files."""
    full, half = torch_pair("sd1")[1], torch_pair("sd1", seed=5)[1].half()  # different weights, to tell them apart
    full.save_pretrained(tmp_path / "controlnet")
    half.save_pretrained(tmp_path / "controlnet", variant="fp16")
    for dtype, source in (("float32", full), ("bfloat16", half)):
        loaded = load_controlnet(tmp_path, dtype=dtype)
        kernel = loaded.params["controlnet_mid_block"]["kernel"].get_value()
        want = source.controlnet_mid_block.weight.detach().float().numpy().transpose(2, 3, 1, 0)  # OIHW -> HWIO
        assert str(kernel.dtype) == dtype
        assert np.abs(kernel.astype(np.float32) - want).max() < 1e-2


@pytest.mark.parametrize(
    "change, message",
    [
        ({"mid_block_type": "UNetMidBlock2D"}, "mid_block_type"),
        ({"controlnet_conditioning_channel_order": "rgba"}, "channel_order"),
        ({"resnet_time_scale_shift": "scale_shift"}, "resnet_time_scale_shift"),
        ({"not_a_controlnet_key": 1}, "unknown keys"),
    ],
)
def test_config_refuses_what_we_do_not_run(change, message):
    base = dict(torch_pair("sd1")[1].config)
    with pytest.raises(ConfigError, match=message):
        ControlNetConfig.from_dict({**base, **change})


def test_control_image_array_matches_diffusers_preprocessing():
    rng = np.random.default_rng(3)
    picture = Image.fromarray(rng.integers(0, 256, (50, 70, 4), dtype=np.uint8), mode="RGBA")
    processor = VaeImageProcessor(vae_scale_factor=8, do_convert_rgb=True, do_normalize=False)
    want = processor.preprocess(picture, height=64, width=96)
    got = control_image_array(picture, 64, 96)
    assert got.shape == (1, 64, 96, 3)
    assert np.abs(got - nhwc(want)).max() < 1e-6


def test_canny_image_marks_the_edges_of_a_square():
    picture = np.zeros((64, 64, 3), np.uint8)
    picture[16:48, 16:48] = (200, 40, 40)
    edges = canny_image(Image.fromarray(picture), 100, 200)
    assert edges.mode == "RGB" and edges.size == (64, 64)
    e = np.asarray(edges)
    assert set(np.unique(e)) == {0, 255}
    assert (e[..., 0] == e[..., 1]).all() and (e[..., 1] == e[..., 2]).all()
    on = e[..., 0] > 0
    assert on[15:17, 20:44].any(axis=0).all() and on[20:44, 46:49].any(axis=1).all()  # top and right sides
    assert not on[20:44, 20:44].any() and not on[:8].any()  # flat areas stay black
    assert not np.asarray(canny_image(Image.fromarray(picture), 100_000, 200_000)).any()  # thresholds matter
