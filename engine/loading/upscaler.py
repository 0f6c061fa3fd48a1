"""Upscaler files (`.safetensors`, `.pth`, `.pt`) -> an RRDBNet or SRVGGNetCompact and its param tree, the architecture,
scale, depth and width told from the keys and shapes alone, as spandrel's `ESRGANArch` and `CompactArch` do.

Four key layouts reach one param tree (Real-ESRGAN's names, `engine/models/upscalers.py`):
- Real-ESRGAN / basicsr: `conv_first`, `body.N.rdbK.convJ`, `conv_body`, `conv_up1`, `conv_hr`, `conv_last`, in a
  `.pth` under `params_ema` or `params`;
- BSRGAN / RealSR: `RRDB_trunk.N.RDBK.convJ`, `trunk_conv`, `upconv1`, `HRconv`;
- the community "old ESRGAN" layout (4x-UltraSharp, Remacri, NMKD): one `nn.Sequential` `model`: `model.0` the first
  conv, `model.1.sub.N.RDBK.convJ.0` the RRDBs and `model.1.sub.{blocks}` the trunk's conv, then per 2x an
  upsampling, a conv and an activation (`model.3`, `model.6`), the HR conv and the last conv two and four places on;
- SRVGGNetCompact (realesr-general-x4v3): `body.N` convs with PReLU weights between them.

A `.pth` is read by `pickle_reader`, which admits only tensors and plain containers and refuses any other callable by
name before it runs. A file of any other layout is refused with what it holds.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from flax import nnx

from ..errors import SourceError, WeightsError
from ..models.upscalers import RRDBNet, RRDBNetConfig, SRVGGNetCompact, SRVGGNetCompactConfig
from .pickle_reader import read_tensors
from .weights import convert, map_safetensors

UPSCALER_SUFFIXES = (".safetensors", ".pth", ".pt")
ARCHITECTURES = {"RRDBNet": RRDBNet, "SRVGGNetCompact": SRVGGNetCompact}
# The prefixes under which basicsr saves a network's state dict; the EMA weights are the ones published for use.
WRAPPERS = ("params_ema.", "params.", "state_dict.", "model_state_dict.")
# BSRGAN / RealSR names -> Real-ESRGAN's.
BSRGAN_RENAMES = (
    (re.compile(r"^RRDB_trunk\.(\d+)\.RDB(\d)\."), r"body.\1.rdb\2."),
    (re.compile(r"^trunk_conv\."), "conv_body."),
    (re.compile(r"^upconv(\d)\."), r"conv_up\1."),
    (re.compile(r"^HRconv\."), "conv_hr."),
)
OLD_RRDB = re.compile(r"^model\.1\.sub\.(\d+)\.RDB(\d)\.conv(\d)\.0\.(weight|bias)$")
OLD_SEQUENTIAL = re.compile(r"^model\.(\d+)\.(weight|bias)$")


@dataclass(frozen=True)
class LoadedUpscaler:
    name: str  # the file's stem: what `/sdapi/v1/upscalers` and the page call it
    path: Path
    architecture: str  # "RRDBNet" | "SRVGGNetCompact"
    config: RRDBNetConfig | SRVGGNetCompactConfig
    graphdef: nnx.GraphDef
    params: nnx.State  # host numpy arrays, f32

    @property
    def scale(self) -> int:
        return self.config.scale


def read_state_dict(file: str | Path) -> dict[str, np.ndarray]:
    """A file's tensors by name, unwrapped from basicsr's `params_ema` (else `params`): mapped from a `.safetensors`,
    read by the safe pickle reader from a `.pth` / `.pt`."""
    file = Path(file)
    if file.suffix == ".safetensors":
        tensors = map_safetensors(file)
    elif file.suffix in (".pth", ".pt"):
        tensors = read_tensors(file)
    else:
        raise SourceError(f"{file}: an upscaler must be one of {', '.join(UPSCALER_SUFFIXES)}")
    for prefix in WRAPPERS:
        inner = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        if inner:
            return inner
    return dict(tensors)


def _sequence_length(tensors: Mapping[str, np.ndarray], prefix: str) -> int:
    """1 + the largest N of `{prefix}.N.*` (spandrel's `get_seq_len`); 0 where there is none."""
    found = [int(m.group(1)) for k in tensors if (m := re.match(rf"^{re.escape(prefix)}\.(\d+)\.", k))]
    return max(found) + 1 if found else 0


def _from_old_esrgan(tensors: Mapping[str, np.ndarray], where: str) -> dict[str, np.ndarray]:
    """The community layout renamed to Real-ESRGAN's (see the module docstring for the places)."""
    blocks = _sequence_length(tensors, "model.1.sub") - 1  # the last entry is the trunk's conv
    length = _sequence_length(tensors, "model")
    upsamples, rest = divmod(length - 5, 3)  # conv, trunk, 3 per 2x, HR conv, activation, last conv
    if blocks < 1 or rest or upsamples < 0:
        raise WeightsError(f"{where}: an old-layout ESRGAN whose `model` has {length} places, which is no 2^n scale")
    places = {0: "conv_first", length - 3: "conv_hr", length - 1: "conv_last"}
    places.update({3 * i: f"conv_up{i}" for i in range(1, upsamples + 1)})
    out = {}
    for key, value in tensors.items():
        if m := OLD_RRDB.match(key):
            out[f"body.{m[1]}.rdb{m[2]}.conv{m[3]}.{m[4]}"] = value
        elif key.startswith(f"model.1.sub.{blocks}."):
            out["conv_body." + key.rsplit(".", 1)[1]] = value
        elif (m := OLD_SEQUENTIAL.match(key)) and int(m[1]) in places:
            out[f"{places[int(m[1])]}.{m[2]}"] = value
        else:
            out[key] = value  # unexpected: the strict load names it
    return out


def _rename_bsrgan(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for key, value in tensors.items():
        for pattern, repl in BSRGAN_RENAMES:
            key = pattern.sub(repl, key)
        out[key] = value
    return out


def _rrdbnet_config(tensors: Mapping[str, np.ndarray]) -> RRDBNetConfig:
    """The config from Real-ESRGAN-named tensors' shapes. An input of 4 or 16 times the output's channels is
    Real-ESRGAN's pixel unshuffle by 2 or 4 (x2plus, x1), as spandrel tells it."""
    features, first_in = tensors["conv_first.weight"].shape[:2]
    out_channels = tensors["conv_last.weight"].shape[0]
    shuffle = next((r for r in (2, 4) if first_in == out_channels * r * r), 1)
    return RRDBNetConfig(
        in_channels=first_in // shuffle**2,
        out_channels=out_channels,
        num_features=features,
        num_blocks=_sequence_length(tensors, "body"),
        growth_channels=tensors["body.0.rdb1.conv1.weight"].shape[0],
        num_upsamples=sum(1 for k in tensors if re.fullmatch(r"conv_up\d+\.weight", k)),
        shuffle_factor=shuffle,
    )


def _compact_config(tensors: Mapping[str, np.ndarray], where: str) -> SRVGGNetCompactConfig:
    """The config from `body.N`'s shapes: convs at the even places, PReLUs at the odd, a last conv to out * scale^2
    channels (the scale and channels found as spandrel's `get_scale_and_output_channels` does)."""
    last = _sequence_length(tensors, "body") - 1
    features, in_channels = tensors["body.0.weight"].shape[:2]
    shuffled = tensors[f"body.{last}.weight"].shape[0]
    for out_channels in (in_channels, 3, 4, 1):
        scale = math.isqrt(shuffled // out_channels)
        if shuffled % out_channels == 0 and scale * scale * out_channels == shuffled:
            break
    else:
        raise WeightsError(f"{where}: SRVGGNetCompact's last conv has {shuffled} outputs, not channels x scale^2")
    return SRVGGNetCompactConfig(
        in_channels=in_channels,
        out_channels=out_channels,
        num_features=features,
        num_convs=(last - 2) // 2,
        upscale=scale,
    )


def detect(
    tensors: Mapping[str, np.ndarray], where: str
) -> tuple[str, RRDBNetConfig | SRVGGNetCompactConfig, dict[str, np.ndarray]]:
    """(architecture, config, the tensors under our names) for a state dict of a layout we know; WeightsError naming
    what the file holds otherwise."""
    keys = set(tensors)
    if {"model.0.weight", "model.1.sub.0.RDB1.conv1x1.weight"} <= keys:
        raise WeightsError(
            f"{where}: an ESRGAN+ network (RRDBs with conv1x1 and noise), which this engine does not run"
        )
    if {"model.0.weight", "model.1.sub.0.RDB1.conv1.0.weight"} <= keys:
        renamed = _from_old_esrgan(tensors, where)
        return "RRDBNet", _rrdbnet_config(renamed), renamed
    if {"conv_first.weight", "RRDB_trunk.0.RDB1.conv1.weight", "trunk_conv.weight", "conv_last.weight"} <= keys:
        renamed = _rename_bsrgan(tensors)
        return "RRDBNet", _rrdbnet_config(renamed), renamed
    if {"conv_first.weight", "body.0.rdb1.conv1.weight", "conv_body.weight", "conv_last.weight"} <= keys:
        return "RRDBNet", _rrdbnet_config(tensors), dict(tensors)
    if {"body.0.weight", "body.1.weight"} <= keys and tensors["body.1.weight"].ndim == 1:
        return "SRVGGNetCompact", _compact_config(tensors, where), dict(tensors)
    shown = ", ".join(f"{k} {tuple(tensors[k].shape)}" for k in sorted(keys)[:8])
    raise WeightsError(
        f"{where}: not an upscaler this engine knows (RRDBNet: ESRGAN, Real-ESRGAN, BSRGAN, the old ESRGAN layout; "
        f"SRVGGNetCompact); its {len(keys)} tensors begin {shown or 'with none'}"
    )


def load_upscaler(file: str | Path) -> LoadedUpscaler:
    """An upscaler file as its network's graph and f32 params; every tensor must fit (missing, unexpected and
    mis-shaped ones named together), a file of no known layout or a pickle naming code is refused by name."""
    file = Path(file)
    architecture, config, tensors = detect(read_state_dict(file), str(file))
    model = ARCHITECTURES[architecture]
    graphdef, params = convert(lambda: model(config, nnx.Rngs(0)), tensors, np.float32, where=str(file))
    return LoadedUpscaler(file.stem, file, architecture, config, graphdef, params)
