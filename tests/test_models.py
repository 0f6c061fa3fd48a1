"""Each model equals its PyTorch twin on tiny random configs: same state dict, f32, rel. error < 1e-4."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL as TorchVAE
from diffusers import UNet2DConditionModel as TorchUNet
from flax import nnx
from reference import (
    CLIP_COMMON,
    CLIP_LAYOUTS,
    DISTILLED_UNET_LAYOUTS,
    UNET_LAYOUTS,
    VAE_LAYOUT,
    nchw,
    nhwc,
    randomize,
    rel_error,
    state_dict_numpy,
)
from transformers import CLIPTextConfig as TorchCLIPConfig
from transformers import CLIPTextModel as TorchCLIP
from transformers import CLIPTextModelWithProjection as TorchCLIPProj

from engine.errors import ConfigError, WeightsError
from engine.loading.weights import checkpoint_name, convert, export, load_model, read_safetensors, to_our_layout
from engine.models.clip import CLIPTextModel
from engine.models.config import CLIPTextConfig, UNetConfig, VAEConfig
from engine.models.unet import UNet2DConditionModel
from engine.models.vae import AutoencoderKL
from engine.nn.layers import shapes_only

TOL = 1e-4


def ours_from_torch(make, torch_model):
    return load_model(make, state_dict_numpy(torch_model))


ALL_UNET_LAYOUTS = {**UNET_LAYOUTS, **DISTILLED_UNET_LAYOUTS}


@pytest.mark.parametrize("layout", sorted(ALL_UNET_LAYOUTS))
@pytest.mark.parametrize("size", [(16, 24), (9, 14)])  # the second is no multiple of 2**depth
@pytest.mark.parametrize("text", ["hidden states", "projected"])  # projected: as the server's steps pass it
def test_unet_matches_diffusers(layout, size, text):
    ref = randomize(TorchUNet(**ALL_UNET_LAYOUTS[layout]))
    cfg = UNetConfig.from_dict(dict(ref.config))
    ours = ours_from_torch(lambda: UNet2DConditionModel(cfg, nnx.Rngs(0)), ref)
    rng = np.random.default_rng(0)
    sample = rng.standard_normal((2, *size, 4)).astype(np.float32)
    t = np.array([999.0, 37.5], np.float32)
    context = rng.standard_normal((2, 7, cfg.per_block("cross_attention_dim")[0])).astype(np.float32)
    extra, torch_extra = {}, {}
    if cfg.addition_embed_type == "text_time":
        text_embeds = rng.standard_normal((2, 32)).astype(np.float32)
        time_ids = np.array([[64, 96, 0, 0, 64, 96], [32, 32, 8, 4, 64, 64]], np.float32)
        extra = dict(text_embeds=text_embeds, time_ids=time_ids)
        torch_extra = dict(added_cond_kwargs={k: torch.from_numpy(v) for k, v in extra.items()})
    with torch.no_grad():
        want = ref(nchw(sample), torch.from_numpy(t), torch.from_numpy(context), **torch_extra).sample
    if text == "projected":  # every cross-attention numbered, each reading its own keys and values
        assert len(ours.cross_attentions()) == sum(name.endswith(".attn2") for name, _ in ref.named_modules())
        context = ours.project_context(context)
    got = ours(sample, t, context, **extra)
    assert rel_error(got, nhwc(want)) < TOL


SD15_UNET = dict(  # stable-diffusion-v1-5's unet/config.json, the keys the distillations keep or change
    act_fn="silu",
    attention_head_dim=8,
    block_out_channels=[320, 640, 1280, 1280],
    center_input_sample=False,
    class_embed_type=None,
    class_embeddings_concat=False,
    conv_in_kernel=3,
    conv_out_kernel=3,
    cross_attention_dim=768,
    cross_attention_norm=None,
    down_block_types=["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    downsample_padding=1,
    dual_cross_attention=False,
    encoder_hid_dim=None,
    flip_sin_to_cos=True,
    freq_shift=0,
    in_channels=4,
    layers_per_block=2,
    mid_block_only_cross_attention=None,
    mid_block_scale_factor=1,
    mid_block_type="UNetMidBlock2DCrossAttn",
    norm_eps=1e-05,
    norm_num_groups=32,
    num_class_embeds=None,
    only_cross_attention=False,
    out_channels=4,
    projection_class_embeddings_input_dim=None,
    resnet_out_scale_factor=1.0,
    resnet_skip_time_act=False,
    resnet_time_scale_shift="default",
    sample_size=64,
    time_cond_proj_dim=None,
    time_embedding_act_fn=None,
    time_embedding_type="positional",
    timestep_post_act=None,
    up_block_types=["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    upcast_attention=False,
    use_linear_projection=False,
)
THREE_STAGES = dict(block_out_channels=[320, 640, 1280], mid_block_type=None, layers_per_block=1)
# The published unet/config.json of each small distilled UNet, full size. BK-SDM's are its repository's
# (Nota-NetsPresso/BK-SDM src/unet_config/bk_*/config.json, the Hub folders' own); segmind's small-sd and tiny-sd
# remove the same blocks as BK-SDM-Base and -Tiny (segmind/distill-sd `prepare_unet`); SDXS's are written from
# their architecture (stable-diffusion.cpp's `VERSION_SDXS_512_DS` and `VERSION_SDXS_09`), not read from the Hub.
PUBLISHED_DISTILLED_UNETS = {
    "nota-ai/bk-sdm-base, segmind/small-sd": dict(SD15_UNET, layers_per_block=1),
    "nota-ai/bk-sdm-small": dict(SD15_UNET, layers_per_block=1, mid_block_type=None),
    "nota-ai/bk-sdm-tiny, segmind/tiny-sd": dict(
        SD15_UNET,
        **THREE_STAGES,
        down_block_types=["CrossAttnDownBlock2D"] * 3,
        up_block_types=["CrossAttnUpBlock2D"] * 3,
    ),
    "IDKiro/sdxs-512-dreamshaper": dict(
        SD15_UNET,
        **THREE_STAGES,
        down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    ),
    "IDKiro/sdxs-512-0.9": dict(
        SD15_UNET,
        **THREE_STAGES,
        down_block_types=["CrossAttnDownBlock2D"] * 3,
        up_block_types=["CrossAttnUpBlock2D"] * 3,
        attention_head_dim=[1, 10, 20],
        cross_attention_dim=1024,
        use_linear_projection=True,
    ),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_DISTILLED_UNETS))
def test_published_distilled_unet_configs_give_diffusers_tensors(name):
    """Full size, without a weight in memory: every tensor diffusers' UNet of that config has, by name and shape,
    is one our UNet built from the same config.json expects (the check `convert` makes when it loads a folder)."""
    raw = {"_class_name": "UNet2DConditionModel", "_diffusers_version": "0.15.0", **PUBLISHED_DISTILLED_UNETS[name]}
    cfg = UNetConfig.from_dict(raw, where=name)
    with torch.device("meta"):
        theirs = {k: tuple(v.shape) for k, v in TorchUNet(**cfg_kwargs(raw)).state_dict().items()}
    with shapes_only():
        abstract = nnx.state(UNet2DConditionModel(cfg, nnx.Rngs(0)), nnx.Param)
    ours = {
        checkpoint_name(path): (str(path[-1]), tuple(var.get_value().shape))
        for path, var in nnx.to_flat_state(abstract)
    }
    assert set(ours) == set(theirs)
    misfits = [key for key, (leaf, shape) in ours.items() if not fits(leaf, theirs[key], shape)]
    assert not misfits, misfits


def cfg_kwargs(raw: dict) -> dict:
    return {k: v for k, v in raw.items() if not k.startswith("_")}


def fits(leaf: str, their_shape: tuple, our_shape: tuple) -> bool:
    """Their tensor of that shape, put in our layout (a view of nothing: no memory), has our shape."""
    try:
        return to_our_layout(leaf, np.broadcast_to(np.float32(0), their_shape), our_shape).shape == our_shape
    except ValueError:  # another rank
        return False


def test_vae_matches_diffusers():
    ref = randomize(TorchVAE(**VAE_LAYOUT))
    cfg = VAEConfig.from_dict(dict(ref.config))
    ours = ours_from_torch(lambda: AutoencoderKL(cfg, nnx.Rngs(0)), ref)
    rng = np.random.default_rng(1)
    image = rng.uniform(-1, 1, (2, 32, 24, 3)).astype(np.float32)
    latents = rng.standard_normal((2, 4, 6, 4)).astype(np.float32)
    with torch.no_grad():
        want_moments = ref.quant_conv(ref.encoder(nchw(image)))
        want_image = ref.decode(nchw(latents)).sample
    mean, logvar = ours.encode(image)
    want_mean, want_logvar = np.split(nhwc(want_moments), 2, axis=-1)
    assert rel_error(mean, want_mean) < TOL
    assert rel_error(logvar, np.clip(want_logvar, -30, 20)) < TOL
    assert rel_error(ours.decode(latents), nhwc(want_image)) < TOL


# stabilityai/stable-diffusion-3.5-medium's and black-forest-labs/FLUX.1-dev's vae/config.json: the SD VAE's
# blocks with 16 latent channels, no quant convolutions, a shift and a scale
SD3_VAE = dict(
    block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    layers_per_block=2,
    latent_channels=16,
    norm_num_groups=32,
    sample_size=1024,
    use_quant_conv=False,
    use_post_quant_conv=False,
    scaling_factor=1.5305,
    shift_factor=0.0609,
)


@pytest.mark.slow
def test_the_16_channel_vae_at_its_real_shapes_matches_diffusers():
    ref = randomize(TorchVAE(**SD3_VAE), std=0.02)
    cfg = VAEConfig.from_dict(dict(ref.config))
    ours = ours_from_torch(lambda: AutoencoderKL(cfg, nnx.Rngs(0)), ref)
    rng = np.random.default_rng(2)
    image = rng.uniform(-1, 1, (1, 64, 48, 3)).astype(np.float32)
    latents = rng.standard_normal((1, 8, 6, 16)).astype(np.float32)  # NHWC, as ours takes them
    with torch.no_grad():
        want_moments = ref.encoder(nchw(image))  # no quant_conv
        want_image = ref.decode(nchw(latents)).sample
    mean, _ = ours.encode(image)
    assert rel_error(mean, np.split(nhwc(want_moments), 2, axis=-1)[0]) < TOL
    assert rel_error(ours.decode(latents), nhwc(want_image)) < TOL


@pytest.mark.parametrize("layout", sorted(CLIP_LAYOUTS))
@pytest.mark.parametrize("with_projection", [False, True])
def test_clip_matches_transformers(layout, with_projection, tmp_path):
    tcfg = TorchCLIPConfig(**CLIP_LAYOUTS[layout], **CLIP_COMMON)
    ref = randomize((TorchCLIPProj if with_projection else TorchCLIP)(tcfg))
    ref.save_pretrained(tmp_path)  # the file layout (text_model.* keys) is what we read
    cfg = CLIPTextConfig.from_json(tmp_path / "config.json")
    tensors = read_safetensors([tmp_path / "model.safetensors"])
    ours = load_model(lambda: CLIPTextModel(cfg, nnx.Rngs(0), with_projection), tensors)
    ids = np.random.default_rng(2).integers(0, 998, (2, 77))
    ids[0, 5:], ids[1, 30:] = 999, 999  # end-of-text, then padding with the same id
    with torch.no_grad():
        want = ref(torch.from_numpy(ids), output_hidden_states=True)
    got = ours(ids)
    assert rel_error(got.last_hidden_state, want.last_hidden_state) < TOL
    assert rel_error(got.hidden_states[-2], want.hidden_states[-2]) < TOL
    pooled = want.text_embeds if with_projection else want.pooler_output
    assert rel_error(got.pooled, pooled) < TOL


# What transformers 4.x wrote into every config it saved, beside the architecture: generation
# settings, labels, bookkeeping. Text encoders of older SD folders carry all of it.
LEGACY_TRANSFORMERS_KEYS = {
    "_name_or_path": "openai/clip-vit-large-patch14",
    "add_cross_attention": False,
    "architectures": ["CLIPTextModel"],
    "bad_words_ids": None,
    "chunk_size_feed_forward": 0,
    "do_sample": False,
    "early_stopping": False,
    "finetuning_task": None,
    "forced_eos_token_id": None,
    "id2label": {"0": "LABEL_0", "1": "LABEL_1"},
    "is_decoder": False,
    "length_penalty": 1.0,
    "max_length": 20,
    "num_beams": 1,
    "pruned_heads": {},
    "repetition_penalty": 1.0,
    "task_specific_params": None,
    "temperature": 1.0,
    "tf_legacy_loss": False,
    "top_k": 50,
    "torchscript": False,
    "transformers_version": "4.22.0.dev0",
    "use_bfloat16": False,
}


def test_a_clip_config_with_transformers_bookkeeping_loads():
    raw = {**LEGACY_TRANSFORMERS_KEYS, **CLIP_LAYOUTS["sd1"], **CLIP_COMMON, "model_type": "clip_text_model"}
    cfg = CLIPTextConfig.from_dict(raw)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.hidden_act) == (32, 3, "quick_gelu")


def test_a_text_encoder_that_is_not_clip_is_refused():
    with pytest.raises(ConfigError, match="model_type 't5' is not a CLIP text encoder"):
        CLIPTextConfig.from_dict({"model_type": "t5", "hidden_size": 64, "num_attention_heads": 4})


@pytest.mark.parametrize("config", [UNetConfig, VAEConfig])
def test_an_unknown_diffusers_key_is_refused_by_name(config):
    # diffusers names every architecture switch in config.json; one we do not know may change the network.
    with pytest.raises(ConfigError, match="unknown keys for .*: new_switch"):
        config.from_dict({"new_switch": True})


def test_export_is_the_inverse_of_convert():
    ref = randomize(TorchVAE(**VAE_LAYOUT))
    cfg = VAEConfig.from_dict(dict(ref.config))
    tensors = state_dict_numpy(ref)
    ours = load_model(lambda: AutoencoderKL(cfg, nnx.Rngs(0)), tensors)
    exported = export(ours)
    assert exported.keys() == tensors.keys()
    for name, value in tensors.items():
        np.testing.assert_array_equal(exported[name], value)


def test_weights_that_do_not_fit_are_all_listed():
    ref = randomize(TorchVAE(**VAE_LAYOUT))
    cfg = VAEConfig.from_dict(dict(ref.config))
    tensors = state_dict_numpy(ref)
    del tensors["decoder.conv_in.bias"]
    tensors["decoder.extra.weight"] = np.zeros(3, np.float32)
    tensors["encoder.conv_in.weight"] = np.zeros((16, 3, 5, 5), np.float32)
    with pytest.raises(WeightsError) as err:
        convert(lambda: AutoencoderKL(cfg, nnx.Rngs(0)), tensors, where="vae")
    message = str(err.value)
    assert "missing (1): decoder.conv_in.bias" in message
    assert "unexpected (1): decoder.extra.weight" in message
    assert "mis-shaped (1): encoder.conv_in.weight" in message


def test_legacy_vae_attention_names_load():
    ref = randomize(TorchVAE(**VAE_LAYOUT))
    cfg = VAEConfig.from_dict(dict(ref.config))
    tensors = state_dict_numpy(ref)
    legacy = {}
    for name, value in tensors.items():
        for new, old in (("to_q", "query"), ("to_k", "key"), ("to_v", "value"), ("to_out.0", "proj_attn")):
            name = name.replace(f"attentions.0.{new}.", f"attentions.0.{old}.")
        legacy[name] = value[:, :, None, None] if name.endswith("query.weight") else value  # some are 1x1 convs
    ours = load_model(lambda: AutoencoderKL(cfg, nnx.Rngs(0)), legacy)
    np.testing.assert_array_equal(
        export(ours)["decoder.mid_block.attentions.0.to_q.weight"],
        tensors["decoder.mid_block.attentions.0.to_q.weight"],
    )
