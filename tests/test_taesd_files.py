"""`--vae` given a tiny VAE in madebyollin/taesd's own files (taesd.py's `Encoder()`/`Decoder()` state dicts, as
`taesd_decoder.pth`, `taef2_encoder.safetensors`, ..., or both in one file as its `TAESD` module saves them), with no
config.json: the config is read from the shapes, and the VAE encodes and decodes as the PyTorch modules do.

The PyTorch side is written here in taesd.py's own layout at tiny widths (its `Block`, `Clamp`, `conv` and the two
`nn.Sequential`s, TAEF2's `use_midblock_gn` pool branch in the blocks at the latents' resolution), saved as taesd.py's
users save it (`torch.save(decoder.state_dict())`, or safetensors). A decoder alone draws pictures (the picture
diffusers draws with the same weights renamed by its `convert_tiny_autoencoder_to_diffusers.py`) and refuses, by
name, the requests that need a picture read.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import tiny_pipeline
import torch
from diffusers import AutoencoderKL, AutoencoderTiny, DDIMScheduler, StableDiffusionPipeline
from flax import nnx
from reference import randomize
from safetensors.numpy import save_file
from test_image_modes import picture

from engine import GenerationRequest, InvalidRequest, SourceError, load_pipeline
from engine.loading.vae import attach_vae, load_vae

RELATIVE = 1e-5  # of the largest magnitude: f32 on both sides
WIDTH = 8
# (latent channels, encoder blocks per stage, decoder blocks per stage, TAEF2's pool branch): taesd.py's stage
# structure (four stages, 8 pixels per latent) with fewer blocks
LAYOUTS = {
    "taesd": (4, (1, 2, 1, 1), (1, 1, 2, 1), False),
    "taef2": (32, (1, 1, 1, 2), (2, 1, 1, 1), True),
}
LATENT_SIDE = 16


# -- taesd.py's layout in PyTorch, tiny ----------------------------------------------------------------------------


def conv(n_in: int, n_out: int, **kwargs) -> torch.nn.Conv2d:
    return torch.nn.Conv2d(n_in, n_out, 3, padding=1, **kwargs)


class Clamp(torch.nn.Module):
    def forward(self, x):
        return torch.tanh(x / 3) * 3


class Block(torch.nn.Module):
    """taesd.py's `Block` at one width (its `skip` an `nn.Identity`), with TAEF2's `pool` branch when asked."""

    def __init__(self, n: int, use_midblock_gn: bool = False):
        super().__init__()
        self.conv = torch.nn.Sequential(conv(n, n), torch.nn.ReLU(), conv(n, n), torch.nn.ReLU(), conv(n, n))
        self.skip = torch.nn.Identity()
        self.fuse = torch.nn.ReLU()
        self.pool = None
        if use_midblock_gn:
            wide = 4 * n
            self.pool = torch.nn.Sequential(
                torch.nn.Conv2d(n, wide, 1, bias=False),
                torch.nn.GroupNorm(4, wide),
                torch.nn.ReLU(),
                torch.nn.Conv2d(wide, n, 1, bias=False),
            )

    def forward(self, x):
        if self.pool is not None:
            x = x + self.pool(x)
        return self.fuse(self.conv(x) + self.skip(x))


def encoder(latent: int, blocks: tuple[int, ...], gn: bool) -> torch.nn.Sequential:
    """taesd.py's `Encoder`: conv, blocks; per further stage a stride-2 conv without bias and its blocks (the last
    stage's with the pool branch for TAEF2); a conv to the latents."""
    layers = [conv(3, WIDTH)]
    for i, count in enumerate(blocks):
        if i:
            layers.append(conv(WIDTH, WIDTH, stride=2, bias=False))
        layers += [Block(WIDTH, gn and i == len(blocks) - 1) for _ in range(count)]
    return torch.nn.Sequential(*layers, conv(WIDTH, latent))


def decoder(latent: int, blocks: tuple[int, ...], gn: bool) -> torch.nn.Sequential:
    """taesd.py's `Decoder`: Clamp, conv, ReLU; per stage its blocks (the first stage's with the pool branch for
    TAEF2) and, but the last, a 2x upsampling and a conv without bias; a conv to the pictures."""
    layers = [Clamp(), conv(latent, WIDTH), torch.nn.ReLU()]
    for i, count in enumerate(blocks):
        layers += [Block(WIDTH, gn and i == 0) for _ in range(count)]
        if i < len(blocks) - 1:
            layers += [torch.nn.Upsample(scale_factor=2), conv(WIDTH, WIDTH, bias=False)]
    return torch.nn.Sequential(*layers, conv(WIDTH, 3))


class TAESD(torch.nn.Module):
    """taesd.py's `TAESD`, holding both: its state dict is the one-file layout (`encoder.N`, `decoder.N`)."""

    def __init__(self, layout: str, seed: int = 0):
        super().__init__()
        latent, enc, dec, gn = LAYOUTS[layout]
        self.encoder, self.decoder = encoder(latent, enc, gn), decoder(latent, dec, gn)
        randomize(self, seed, std=0.15)


def numpy_state(module: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}


def save(module: torch.nn.Module, file) -> str:
    """A state dict as taesd.py's users save it: `torch.save` for `.pth`, safetensors otherwise."""
    if file.suffix == ".pth":
        torch.save(module.state_dict(), file)
    else:
        save_file(numpy_state(module), file)
    return str(file)


@pytest.fixture(scope="module")
def taesd_modules():
    return {layout: TAESD(layout, seed=i) for i, layout in enumerate(LAYOUTS)}


def write(kind: str, vae: TAESD, folder) -> str:
    """The source `--vae` is given, as people have it."""
    if kind == "decoder file (.pth)":
        return save(vae.decoder, folder / "taesd_decoder.pth")
    if kind == "one file of both":
        return save(vae, folder / "taef2.safetensors")
    # a folder of taesd.py's two files, a .pth beside the .safetensors of the same name (the .safetensors is read)
    save(vae.encoder, folder / "taef2_encoder.safetensors")
    save(vae.decoder, folder / "taef2_decoder.safetensors")
    save(torch.nn.Sequential(torch.nn.Linear(2, 2)), folder / "taef2_decoder.pth")  # a .pth that is never read
    return str(folder)


def close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and np.abs(want).max() > 0.05  # a picture, not a constant
    assert np.abs(got - want).max() <= RELATIVE * np.abs(want).max()


@pytest.mark.parametrize(
    "layout, kind",
    [("taesd", "decoder file (.pth)"), ("taef2", "one file of both"), ("taef2", "folder of both files")],
)
def test_taesd_files_decode_and_encode_as_their_pytorch_modules(layout, kind, taesd_modules, tmp_path):
    """The config from the shapes (latent channels, blocks per stage, the pool branch), diffusers' scaling (1, no
    shift); decode (and encode, where the encoder is given) equal to taesd.py's modules within 1e-5 relative."""
    vae = taesd_modules[layout]
    latent, enc, dec, gn = LAYOUTS[layout]
    loaded = load_vae(write(kind, vae, tmp_path))
    cfg = loaded.config
    assert loaded.class_name == "AutoencoderTiny" and loaded.encodes == (kind != "decoder file (.pth)")
    assert (cfg.latent_channels, cfg.num_decoder_blocks, cfg.use_midblock_gn) == (latent, dec, gn)
    assert cfg.decoder_block_out_channels == (WIDTH,) * 4 and cfg.vae_scale_factor == 8
    assert (cfg.scaling_factor, cfg.shift_factor, cfg.latent_magnitude, cfg.latent_shift) == (1.0, 0.0, 3, 0.5)
    ours = nnx.merge(loaded.graphdef, loaded.params)
    rng = np.random.default_rng(3)
    latents = rng.standard_normal((1, latent, LATENT_SIDE, LATENT_SIDE)).astype(np.float32) * 2
    with torch.no_grad():
        want = vae.decoder(torch.from_numpy(latents)).numpy() * 2 - 1  # ours returns [-1, 1]
    got = np.asarray(ours.decode(latents.transpose(0, 2, 3, 1))).transpose(0, 3, 1, 2)
    close(got, want)
    if not loaded.encodes:
        with pytest.raises(InvalidRequest, match="a decoder alone: it draws pictures but cannot read one"):
            ours.encode(np.zeros((1, 8 * LATENT_SIDE, 8 * LATENT_SIDE, 3), np.float32))
        return
    assert cfg.num_encoder_blocks == enc
    images = rng.uniform(-1, 1, (1, 3, 8 * LATENT_SIDE, 8 * LATENT_SIDE)).astype(np.float32)
    with torch.no_grad():
        want = vae.encoder(torch.from_numpy(images) / 2 + 0.5).numpy()  # taesd.py reads [0, 1]
    mean, _ = ours.encode(images.transpose(0, 2, 3, 1))
    close(np.asarray(mean).transpose(0, 3, 1, 2), want)


def test_a_hub_repo_of_taesd_files_fetches_only_them(taesd_modules, monkeypatch, tmp_path):
    """A Hub id without config.json (madebyollin/taef2): its top-level weight files, one per name (.safetensors before
    .pth), fetched and read; offline, whatever the local cache holds."""
    import huggingface_hub

    write("folder of both files", taesd_modules["taef2"], tmp_path)  # what the download leaves in the cache
    files = [
        "README.md",
        "taef2_encoder.safetensors",
        "taef2_encoder.pth",
        "taef2_decoder.safetensors",
        "taef2_decoder.pth",
        "images/preview.safetensors",
    ]
    asked, online = [], [True]

    def list_repo_files(repo_id):
        if not online[0]:
            raise OSError("no network")
        return files

    def snapshot_download(repo_id, allow_patterns=None, local_files_only=False):
        asked.append((repo_id, allow_patterns, local_files_only))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "list_repo_files", list_repo_files)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    for connected in (True, False):
        online[0] = connected
        loaded = load_vae("madebyollin/taef2")
        assert loaded.name == "madebyollin/taef2" and loaded.encodes and loaded.config.use_midblock_gn
    want = ["taef2_decoder.safetensors", "taef2_encoder.safetensors"]
    assert asked == [("madebyollin/taef2", want, False), ("madebyollin/taef2", None, True)]


# -- refusals ------------------------------------------------------------------------------------------------------


def kl_vae(folder, modules):
    vae = AutoencoderKL(**tiny_pipeline.VAE_FACTOR8)
    return save(vae, folder / "vae.safetensors")


def widths_differ(folder, modules):
    state = numpy_state(modules["taesd"].decoder)
    state["3.conv.0.weight"] = np.zeros((16, WIDTH, 3, 3), np.float32)  # one block 16 wide
    save_file(state, folder / "taesd_decoder.safetensors")
    return str(folder / "taesd_decoder.safetensors")


def misshaped(folder, modules):
    state = numpy_state(modules["taesd"].decoder)
    state["3.conv.2.weight"] = np.zeros((WIDTH, WIDTH, 1, 1), np.float32)
    save_file(state, folder / "taesd_decoder.safetensors")
    return str(folder / "taesd_decoder.safetensors")


def other_latents(folder, modules):
    save(modules["taesd"].encoder, folder / "taesd_encoder.safetensors")
    save(modules["taef2"].decoder, folder / "taef2_decoder.safetensors")
    return str(folder)


def two_decoders(folder, modules):
    save(modules["taesd"].decoder, folder / "taesd_decoder.safetensors")
    save(modules["taesd"].decoder, folder / "taesdxl_decoder.safetensors")
    return str(folder)


def encoder_alone(folder, modules):
    return save(modules["taesd"].encoder, folder / "taesd_encoder.pth")


def f32_encoder(folder, modules):
    """taesd.py's F32Encoder opening (TAESANA): two strided convolutions with bias before the first block."""
    layers = [conv(3, WIDTH, stride=2), torch.nn.ReLU(), conv(WIDTH, WIDTH, stride=2), torch.nn.ReLU(), Block(WIDTH)]
    save(torch.nn.Sequential(*layers, conv(WIDTH, 4)), folder / "taesana_encoder.safetensors")
    save(modules["taesd"].decoder, folder / "taesana_decoder.safetensors")
    return str(folder)


def nothing(folder, modules):
    (folder / "README.md").write_text("weights elsewhere")
    return str(folder)


@pytest.mark.parametrize(
    "make, message",
    [
        (kl_vae, r"not a tiny VAE in madebyollin/taesd's layout: tensor 'decoder\.conv_in\.bias' is no index"),
        (widths_differ, r"the decoder's layers have widths \[8, 16\]; taesd.py's Encoder/Decoder keep one width"),
        (misshaped, r"do not fit taesd.py's layout .*\n  mis-shaped \(1\): decoder\.layers\.2\.conv\.2\.weight"),
        (other_latents, r"not one tiny VAE's: the encoder writes 4 latent channels, the decoder reads 32"),
        (two_decoders, r"holds 2 tiny VAE decoders \(taesd_decoder.safetensors, taesdxl_decoder.safetensors\)"),
        (encoder_alone, r"a tiny VAE encoder without its decoder"),
        (f32_encoder, r"encoder index 2 is a convolution with bias between its blocks"),
        (nothing, r"no config.json, so this is not a diffusers-format VAE folder, nor one holding a tiny VAE"),
    ],
)
def test_files_that_are_not_one_taesd_are_refused_by_name(make, message, taesd_modules, tmp_path):
    with pytest.raises(SourceError, match=message):
        load_vae(make(tmp_path, taesd_modules))


# -- a decoder alone in the engine ---------------------------------------------------------------------------------


def diffusers_tiny(vae: TAESD) -> AutoencoderTiny:
    """The same weights in diffusers' AutoencoderTiny, renamed as its convert_tiny_autoencoder_to_diffusers.py does
    (the encoder's index N is `encoder.layers.N`, the decoder's `decoder.layers.N-1`)."""
    _, enc, dec, _ = LAYOUTS["taesd"]
    width = (WIDTH,) * 4
    ref = AutoencoderTiny(
        encoder_block_out_channels=width,
        decoder_block_out_channels=width,
        num_encoder_blocks=enc,
        num_decoder_blocks=dec,
    )
    state = {f"encoder.layers.{k}": v for k, v in vae.encoder.state_dict().items()}
    for key, value in vae.decoder.state_dict().items():
        index, rest = key.split(".", 1)
        state[f"decoder.layers.{int(index) - 1}.{rest}"] = value
    ref.load_state_dict(state)  # strict: every name and shape of diffusers' layout
    return ref.eval()


def test_a_decoder_alone_draws_diffusers_picture_and_refuses_to_read_one(taesd_modules, tmp_path):
    """Text to image with `taesd_decoder.pth` as the VAE: diffusers' picture with the same decoder; a request that
    brings a picture to read is refused by name, and hires fix offers only the latent upscalers."""
    folder = tmp_path / "sd1"
    base = tiny_pipeline.write("sd1", folder)
    vae = taesd_modules["taesd"]
    engine = load_pipeline(folder, vae=write("decoder file (.pth)", vae, tmp_path), previews=False)
    try:
        latents = np.random.default_rng(5).standard_normal((1, 4, 8, 8)).astype(np.float32)
        args = dict(prompt="a red circle", num_inference_steps=2, guidance_scale=5.0, height=64, width=64)
        reference = StableDiffusionPipeline(**{**base.components, "vae": diffusers_tiny(vae)})
        reference.scheduler = DDIMScheduler.from_config(reference.scheduler.config)
        with torch.no_grad():
            want = reference(latents=torch.from_numpy(latents), output_type="np", **args).images
        got = engine.generate(scheduler="ddim", latents=latents, num_images=1, **args).arrays
        assert got.std() > 0.01 and np.abs(got - want).max() < 1 / 255
        assert all(name.startswith("Latent") for name in engine.limits.upscalers)
        for given in (dict(image=picture(64)), dict(image=picture(64), mask_image=picture(64))):
            with pytest.raises(InvalidRequest, match=r"decoder alone: it draws pictures but cannot read one, so send "):
                engine.submit(GenerationRequest("a red circle", height=64, width=64, **given))
    finally:
        engine.close()


def test_a_decoder_alone_is_refused_for_a_model_that_reads_a_picture_in_every_request(taesd_modules, tmp_path):
    """An inpainting model or one that only edits (FLUX.1 Kontext) cannot draw without the encoder: refused at start."""
    decoder_alone = load_vae(write("decoder file (.pth)", taesd_modules["taesd"], tmp_path))
    model = types.SimpleNamespace(name="an inpainting model")
    with pytest.raises(SourceError, match=r"decoder alone, and the model an inpainting model reads a picture in every"):
        attach_vae(model, decoder_alone, reads_pictures=True)
