"""Upscalers: RRDBNet (ESRGAN, Real-ESRGAN) and SRVGGNetCompact equal the published architectures written here in
PyTorch, f32 within 1e-4 relative, at the published sizes; every key layout loads to one param tree; x2plus
unshuffles; tiles equal the whole picture; unknown layouts, pickled code and oversized outputs are refused by name.

The PyTorch networks follow the papers' structure as the published code builds it: Real-ESRGAN's (basicsr's)
`RRDBNet` and `SRVGGNetCompact`, and the original ESRGAN's one `nn.Sequential` (`model.N`, `model.1.sub.N.RDBK.convJ.0`)
that the community models keep. Their weights are torch's default init (PReLUs redrawn), seeded.
"""

from __future__ import annotations

import os
import pickle
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flax import nnx
from PIL import Image
from reference import nchw, nhwc, rel_error
from safetensors.numpy import save_file
from torch import nn

from engine.errors import InvalidRequest, SourceError, WeightsError
from engine.loading.upscaler import ARCHITECTURES, detect, load_upscaler
from engine.loading.upscaler_folder import UpscalerFolder
from engine.loading.weights import checkpoint_name
from engine.models.upscalers import RRDBNetConfig, SRVGGNetCompactConfig
from engine.nn.layers import shapes_only
from engine.sampling.upscale import run_network, spans, upscale, upscale_to

TOL = 1e-4


def lrelu() -> nn.Module:
    return nn.LeakyReLU(0.2, inplace=True)


class DenseBlock(nn.Module):
    """Real-ESRGAN's ResidualDenseBlock: five convs over the growing concatenation, x5 * 0.2 + x."""

    def __init__(self, nf: int, gc: int, old: bool = False):
        super().__init__()
        for i in range(1, 6):
            c = nn.Conv2d(nf + (i - 1) * gc, gc if i < 5 else nf, 3, 1, 1)
            # The old layout wraps each conv in a conv block (`conv1.0`), with its activation beside it.
            setattr(self, f"conv{i}", nn.Sequential(c, *([lrelu()] if i < 5 else [])) if old else c)
        self.old = old

    def forward(self, x):
        seen = x
        for i in range(1, 5):
            out = getattr(self, f"conv{i}")(seen)
            seen = torch.cat([seen, out if self.old else F.leaky_relu(out, 0.2)], 1)
        return self.conv5(seen) * 0.2 + x


class RRDB(nn.Module):
    def __init__(self, nf: int, gc: int, old: bool = False):
        super().__init__()
        names = ("RDB1", "RDB2", "RDB3") if old else ("rdb1", "rdb2", "rdb3")
        self.names = names
        for name in names:
            setattr(self, name, DenseBlock(nf, gc, old))

    def forward(self, x):
        out = x
        for name in self.names:
            out = getattr(self, name)(out)
        return out * 0.2 + x


class TorchRRDBNet(nn.Module):
    """Real-ESRGAN's RRDBNet: `scale` 2 or 1 pixel-unshuffles the input by 2 or 4; the trunk always upsamples x4."""

    def __init__(self, nf: int = 64, nb: int = 23, gc: int = 32, scale: int = 4):
        super().__init__()
        self.shuffle = {4: 1, 2: 2, 1: 4}[scale]
        self.conv_first = nn.Conv2d(3 * self.shuffle**2, nf, 3, 1, 1)
        self.body = nn.Sequential(*[RRDB(nf, gc) for _ in range(nb)])
        self.conv_body = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_up1 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_up2 = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_hr = nn.Conv2d(nf, nf, 3, 1, 1)
        self.conv_last = nn.Conv2d(nf, 3, 3, 1, 1)

    def forward(self, x):
        if self.shuffle > 1:
            x = F.pixel_unshuffle(x, self.shuffle)
        feat = self.conv_first(x)
        feat = feat + self.conv_body(self.body(feat))
        for up in (self.conv_up1, self.conv_up2):
            feat = F.leaky_relu(up(F.interpolate(feat, scale_factor=2, mode="nearest")), 0.2)
        return self.conv_last(F.leaky_relu(self.conv_hr(feat), 0.2))


class Shortcut(nn.Module):
    def __init__(self, sub: nn.Module):
        super().__init__()
        self.sub = sub

    def forward(self, x):
        return x + self.sub(x)


class OldESRGAN(nn.Module):
    """The original ESRGAN: one flattened `nn.Sequential` as `model`, as 4x-UltraSharp, Remacri and NMKD keep it."""

    def __init__(self, nf: int = 64, nb: int = 23, gc: int = 32, upsamples: int = 2):
        super().__init__()
        conv = lambda: nn.Conv2d(nf, nf, 3, 1, 1)  # noqa: E731
        trunk = Shortcut(nn.Sequential(*[RRDB(nf, gc, old=True) for _ in range(nb)], conv()))
        ups = [m for _ in range(upsamples) for m in (nn.Upsample(scale_factor=2, mode="nearest"), conv(), lrelu())]
        self.model = nn.Sequential(nn.Conv2d(3, nf, 3, 1, 1), trunk, *ups, conv(), lrelu(), nn.Conv2d(nf, 3, 3, 1, 1))

    def forward(self, x):
        return self.model(x)


class TorchCompact(nn.Module):
    """Real-ESRGAN's SRVGGNetCompact with PReLU: convs and PReLUs, pixel shuffle, plus the input upsampled."""

    def __init__(self, nf: int = 64, num_conv: int = 32, upscale: int = 4):
        super().__init__()
        layers = [nn.Conv2d(3, nf, 3, 1, 1), nn.PReLU(nf)]
        for _ in range(num_conv):
            layers += [nn.Conv2d(nf, nf, 3, 1, 1), nn.PReLU(nf)]
        layers.append(nn.Conv2d(nf, 3 * upscale**2, 3, 1, 1))
        self.body = nn.ModuleList(layers)
        self.upscale = upscale

    def forward(self, x):
        out = x
        for layer in self.body:
            out = layer(out)
        return F.pixel_shuffle(out, self.upscale) + F.interpolate(x, scale_factor=self.upscale, mode="nearest")


def seeded(make, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = make()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and name.endswith("weight"):  # PReLU slopes: not all 0.25
                p.uniform_(0.0, 0.5)
    return model.eval()


def numpy_state(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def torch_run(model: nn.Module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return nhwc(model(nchw(x)))


def ours(tmp_path, tensors: dict[str, np.ndarray], name: str = "net.safetensors"):
    save_file(tensors, str(tmp_path / name))
    return load_upscaler(tmp_path / name)


def run_raw(loaded, x: np.ndarray) -> np.ndarray:
    return np.asarray(nnx.merge(loaded.graphdef, loaded.params)(x))


def pixels(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


@pytest.mark.parametrize(
    "make, config",
    [
        (
            lambda: TorchRRDBNet(nf=16, nb=2, gc=8, scale=4),
            RRDBNetConfig(num_features=16, num_blocks=2, growth_channels=8),
        ),
        (
            lambda: TorchRRDBNet(nf=16, nb=1, gc=8, scale=2),
            RRDBNetConfig(num_features=16, num_blocks=1, growth_channels=8, shuffle_factor=2),
        ),
        (
            lambda: TorchRRDBNet(nf=8, nb=1, gc=8, scale=1),
            RRDBNetConfig(num_features=8, num_blocks=1, growth_channels=8, shuffle_factor=4),
        ),
        (lambda: TorchCompact(nf=16, num_conv=3), SRVGGNetCompactConfig(num_features=16, num_convs=3)),
        (
            lambda: TorchCompact(nf=8, num_conv=2, upscale=2),
            SRVGGNetCompactConfig(num_features=8, num_convs=2, upscale=2),
        ),
    ],
    ids=["x4", "x2plus", "x1", "compact-x4", "compact-x2"],
)
def test_small_networks_equal_torch(tmp_path, make, config):
    model = seeded(make)
    loaded = ours(tmp_path, numpy_state(model))
    assert loaded.config == config
    x = np.random.default_rng(1).random((1, 16, 20, 3), np.float32)
    assert rel_error(run_raw(loaded, x), torch_run(model, x)) < TOL


@pytest.mark.parametrize(
    "make, architecture, config",
    [
        (lambda: TorchRRDBNet(), "RRDBNet", RRDBNetConfig()),  # RealESRGAN_x4plus
        (lambda: TorchCompact(), "SRVGGNetCompact", SRVGGNetCompactConfig()),  # realesr-general-x4v3
    ],
    ids=["RealESRGAN_x4plus", "realesr-general-x4v3"],
)
def test_published_sizes_equal_torch(tmp_path, make, architecture, config):
    """23 RRDBs of 64 features and growth 32; 32 compact convs of 64: the published networks, on 32x32."""
    model = seeded(make)
    loaded = ours(tmp_path, numpy_state(model))
    assert (loaded.architecture, loaded.config, loaded.scale) == (architecture, config, 4)
    x = np.random.default_rng(2).random((1, 32, 32, 3), np.float32)
    assert rel_error(run_raw(loaded, x), torch_run(model, x)) < TOL


def published_shapes(model: nn.Module) -> dict[str, np.ndarray]:
    """A state dict of the model's shapes, without its values (detection reads shapes only)."""
    return {k: np.broadcast_to(np.float32(0), v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "make, wrap, config",
    [
        (lambda: TorchRRDBNet(scale=2), "params_ema", RRDBNetConfig(shuffle_factor=2)),  # RealESRGAN_x2plus
        (lambda: TorchRRDBNet(nb=6), "params_ema", RRDBNetConfig(num_blocks=6)),  # RealESRGAN_x4plus_anime_6B
        (lambda: OldESRGAN(), None, RRDBNetConfig()),  # 4x-UltraSharp, Remacri, NMKD
        (lambda: OldESRGAN(upsamples=1), None, RRDBNetConfig(num_upsamples=1)),  # a 2x old-layout model
        (lambda: TorchCompact(), "params", SRVGGNetCompactConfig()),  # realesr-general-x4v3
    ],
    ids=["x2plus", "anime_6B", "UltraSharp", "old-2x", "general-x4v3"],
)
def test_published_layouts_are_detected(make, wrap, config):
    with torch.device("meta"):
        model = make()
    architecture, found, tensors = detect(published_shapes(model), "file")
    assert found == config and architecture == type(config).__name__.removesuffix("Config")
    assert set(tensors) == our_names(architecture, found)  # every tensor renamed to our tree's names


def our_names(architecture: str, config) -> set[str]:
    with shapes_only():
        _, state = nnx.split(ARCHITECTURES[architecture](config, nnx.Rngs(0)))
    return {checkpoint_name(path) for path, _ in nnx.to_flat_state(state)}


def test_every_layout_loads_to_one_tree(tmp_path):
    """Real-ESRGAN's names (a .pth under params_ema), the old ESRGAN Sequential (.pth and .safetensors) and BSRGAN's
    names: the same weights load to the same params and the same picture."""
    new = seeded(lambda: TorchRRDBNet(nf=16, nb=2, gc=8))
    old = OldESRGAN(nf=16, nb=2, gc=8).eval()
    with torch.no_grad():
        for (_, p_old), (_, p_new) in zip(old.named_parameters(), new.named_parameters(), strict=True):
            p_old.copy_(p_new)
    x = np.random.default_rng(3).random((1, 12, 12, 3), np.float32)
    np.testing.assert_allclose(torch_run(old, x), torch_run(new, x), rtol=1e-6, atol=1e-6)
    torch.save({"params_ema": new.state_dict()}, tmp_path / "new.pth")
    torch.save(old.state_dict(), tmp_path / "old.pth")
    old_state = numpy_state(old)
    assert "model.1.sub.0.RDB1.conv1.0.weight" in old_state and "model.10.weight" in old_state
    save_file(old_state, str(tmp_path / "old.safetensors"))
    bsrgan = {
        re.sub(r"^body\.(\d+)\.rdb", r"RRDB_trunk.\1.RDB", k)
        .replace("conv_body", "trunk_conv")
        .replace("conv_up", "upconv")
        .replace("conv_hr", "HRconv"): v
        for k, v in numpy_state(new).items()
    }
    save_file(bsrgan, str(tmp_path / "bsrgan.safetensors"))
    files = ["new.pth", "old.pth", "old.safetensors", "bsrgan.safetensors"]
    loaded = [load_upscaler(tmp_path / f) for f in files]
    reference = nnx.to_flat_state(loaded[0].params)
    for other in loaded[1:]:
        assert other.config == loaded[0].config
        for (path, a), (path_b, b) in zip(reference, nnx.to_flat_state(other.params), strict=True):
            assert path == path_b and np.array_equal(a.get_value(), b.get_value())
    assert rel_error(run_raw(loaded[1], x), torch_run(new, x)) < TOL


def test_x2plus_unshuffles_an_odd_picture_as_spandrel(tmp_path):
    """x2plus reads the picture reflect-padded to even sides, unshuffled by 2, and its output is cropped back."""
    model = seeded(lambda: TorchRRDBNet(nf=8, nb=1, gc=8, scale=2))
    loaded = ours(tmp_path, numpy_state(model))
    assert loaded.scale == 2
    picture = pixels(15, 11)
    x = torch.from_numpy(picture.astype(np.float32) / 255).permute(2, 0, 1)[None]
    with torch.no_grad():
        ref = model(F.pad(x, (0, 1, 0, 1), mode="reflect"))[:, :, :30, :22].clamp(0, 1)
    ref = (ref[0].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    got = run_network(loaded, picture, tile=64)
    assert got.shape == (30, 22, 3)
    assert np.abs(got.astype(int) - ref).max() <= 1


@pytest.mark.parametrize(
    "make, tile, size",
    [
        (lambda: TorchRRDBNet(nf=8, nb=1, gc=4), 12, (53, 71)),
        (lambda: TorchRRDBNet(nf=8, nb=1, gc=4, scale=2), 13, (101, 119)),  # tiles and overlap on the unshuffle's grid
        (lambda: TorchCompact(nf=8, num_conv=4), 17, (53, 71)),
    ],
    ids=["x4", "x2plus", "compact"],
)
def test_tiles_equal_the_whole_picture(tmp_path, make, tile, size):
    """With the receptive radius as the overlap, every window smaller than the picture along both sides."""
    loaded = ours(tmp_path, numpy_state(seeded(make)))
    picture, radius, grid = pixels(*size), loaded.config.receptive_radius, getattr(loaded.config, "shuffle_factor", 1)
    for side in size:
        window, cores = spans(-(-side // grid) * grid, -(-tile // grid) * grid, radius)
        assert window < side and len(cores) >= 3
    whole = run_network(loaded, picture, tile=1024)
    heard = []
    tiled = run_network(loaded, picture, tile, radius, lambda *p: heard.append(p))
    assert heard[-1][0] == heard[-1][1] == len(heard) >= 9
    assert tiled.shape == whole.shape == (size[0] * loaded.scale, size[1] * loaded.scale, 3)
    assert np.abs(tiled.astype(int) - whole).max() <= 1  # 1/255


def test_upscale_runs_the_network_then_lanczos_to_the_size(tmp_path):
    loaded = ours(tmp_path, numpy_state(seeded(lambda: TorchCompact(nf=8, num_conv=2, upscale=2))))
    picture = pixels(10, 12)
    once = run_network(loaded, picture)
    assert np.array_equal(upscale(picture, 2, loaded), once)  # the network's own scale: no resampling
    as_pil = upscale(Image.fromarray(picture), 3, loaded)  # two passes (x4), then Lanczos down to x3
    twice = Image.fromarray(run_network(loaded, once)).resize((36, 30), Image.Resampling.LANCZOS)
    assert as_pil.size == (36, 30) and np.array_equal(np.asarray(as_pil), np.asarray(twice))


@pytest.mark.parametrize(
    "name, resample", [("Lanczos", Image.Resampling.LANCZOS), ("Nearest", Image.Resampling.NEAREST)]
)
def test_resamplers_are_pil(name, resample):
    picture = pixels(9, 7)
    want = np.asarray(Image.fromarray(picture).resize((14, 18), resample))
    assert np.array_equal(upscale(picture, 2, name), want)
    assert np.array_equal(np.asarray(upscale_to(Image.fromarray(picture), 14, 18, name)), want)


def test_an_upscale_past_the_size_limit_is_refused_by_name():
    picture = pixels(100, 80)
    with pytest.raises(InvalidRequest, match=r"upscale to 20000x25000 is over .* 8192 pixels a side"):
        upscale(picture, 250, "Lanczos")
    with pytest.raises(InvalidRequest, match=r"64x64 is over .* 4096 pixels a side and 0 megapixels"):
        upscale_to(picture, 64, 64, "Nearest", max_side=4096, max_pixels=4000)
    with pytest.raises(InvalidRequest, match="unknown upscaler 'Bicubic'"):
        upscale(picture, 2, "Bicubic")
    with pytest.raises(InvalidRequest, match="scale must be a positive number"):
        upscale(picture, float("nan"), "Lanczos")


class Calls:
    """A pickle that calls `func(*args)` when loaded."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def test_unknown_layouts_and_pickled_code_are_refused_by_name(tmp_path):
    folder = tmp_path / "ESRGAN"
    folder.mkdir()
    marker = tmp_path / "ran"
    (folder / "evil.pth").write_bytes(pickle.dumps({"conv_first.weight": Calls(os.system, f"touch {marker}")}))
    save_file({"encoder.conv_in.weight": np.zeros((4, 3, 3, 3), np.float32)}, str(folder / "vae.safetensors"))
    torch.save(seeded(lambda: TorchCompact(nf=8, num_conv=1)).state_dict(), folder / "good.pth")
    (folder / "notes.txt").write_text("not a model")

    with pytest.raises(SourceError, match=r"system: refused"):
        load_upscaler(folder / "evil.pth")
    with pytest.raises(
        WeightsError, match=r"not an upscaler this engine knows.* encoder\.conv_in\.weight \(4, 3, 3, 3\)"
    ):
        load_upscaler(folder / "vae.safetensors")
    assert not marker.exists()

    offered = UpscalerFolder.for_models(models=tmp_path)
    assert offered.names() == ["Lanczos", "Nearest", "good"]
    assert offered.entries["good"].scale == 4 and offered.entries["good"].architecture == "SRVGGNetCompact"
    assert set(offered.refused) == {"evil", "vae"}
    with pytest.raises(SourceError, match=r"'evil' is not offered: .*system: refused"):
        offered.get("evil")
    with pytest.raises(InvalidRequest, match=r"unknown upscaler 'nope'; this server offers Lanczos, Nearest, good"):
        offered.get("nope")
    assert offered.get("Lanczos") == "Lanczos"
    good = offered.get("good")
    assert good is offered.get("good") and good.scale == 4
    assert upscale(pixels(6, 5), 4, good).shape == (24, 20, 3)


def test_weights_that_do_not_fit_are_named(tmp_path):
    tensors = numpy_state(seeded(lambda: TorchCompact(nf=8, num_conv=2)))
    del tensors["body.3.weight"]  # a PReLU's slopes
    tensors["body.2.weight"] = tensors["body.2.weight"][:, :4]
    with pytest.raises(WeightsError, match=r"(?s)missing \(1\): body\.3\.weight.*mis-shaped \(1\): body\.2\.weight"):
        ours(tmp_path, tensors)
