"""Tiny VAEs in madebyollin/taesd's own files: taesd.py's `Encoder()` and `Decoder()` state dicts (`taesd_decoder.pth`,
`taef1_encoder.safetensors`, ... as A1111 and ComfyUI's `models/vae_approx/` hold them), or both in one file under
`encoder.`/`decoder.` as its `TAESD` module saves them, read as our `AutoencoderTiny` (diffusers' layout).

The renaming is diffusers' `scripts/convert_tiny_autoencoder_to_diffusers.py`'s: the encoder's `nn.Sequential` index
N is `encoder.layers.N`; the decoder's starts with a `Clamp()` that holds no weights, so its index N is
`decoder.layers.N-1`. A block's own names are ours already (`conv.0/2/4`, TAEF2's `pool.0/1/3`); its `skip` is an
`nn.Identity` where the width does not change, as in every taesd.py network, so it holds no weights either.

There is no config.json: the config comes from the shapes. taesd.py's two sides read alike: a 3x3 convolution with
bias (from the pictures' channels, or the latents'), the first stage's blocks, then per further stage a convolution
without bias (the encoder's stride-2 downsampling, the decoder's after its upsampling) and that stage's blocks, then a
convolution with bias out (to the latents, or to the pictures). So each bias-free convolution starts a stage, the
outer convolutions' widths are the latent and picture channels, and a block holding `pool.*` tensors is TAEF2's
(`use_midblock_gn`). The rest is diffusers' `AutoencoderTiny` defaults: ReLU, 2x nearest upsampling, and
scaling_factor 1 with no shift: these networks read and write the denoiser's latents themselves (taesd.py's README:
TAESD's "scale_factor" is 1; ComfyUI scales a VAE's latents into them). Anything else is refused by name: keys that
are no index of those Sequentials, a convolution where none goes, widths that differ (taesd.py's F32 variant, TAESANA).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import SourceError, WeightsError
from ..models.config import AutoencoderTinyConfig
from .pickle_reader import read_tensors
from .weights import map_safetensors

SUFFIXES = (".safetensors", ".pth")  # taesd.py's files and their safetensors copies, preferred in that order
SIDES = ("encoder", "decoder")
_INDEXED = re.compile(r"^(\d+)\.(.+)$")  # "3.conv.0.weight": index 3 of the Sequential, then the layer's own name
_BLOCK_PARAM = re.compile(r"^(conv\.[024]|pool\.[013])\.(weight|bias)$")
EXAMPLE_KEYS = "'0.weight', '1.conv.0.weight' (one side's file) or 'decoder.1.weight' (both in one file)"


@dataclass(frozen=True)
class Side:
    """One side's layout as its shapes say: what `AutoencoderTinyConfig` needs of it."""

    width: int  # every block's channels
    blocks: tuple[int, ...]  # blocks per stage, outer stage first (the pictures' end for the encoder)
    channels_in: int  # the first convolution's input: the pictures' (encoder) or the latents' (decoder)
    channels_out: int  # the last convolution's output: the latents' (encoder) or the pictures' (decoder)
    midblock_gn: bool  # some block has TAEF2's `pool` branch


def read_file(file: Path) -> dict[str, np.ndarray]:
    """A file's tensors: mapped from a `.safetensors`, read by the safe pickle reader from a `.pth` (never run)."""
    if file.suffix == ".safetensors":
        return map_safetensors(file)
    if file.suffix == ".pth":
        return read_tensors(file)
    raise SourceError(f"{file}: a tiny VAE file must be one of {', '.join(SUFFIXES)}")


def split_sides(tensors: Mapping[str, np.ndarray], where: str) -> dict[str, dict[str, np.ndarray]]:
    """{"encoder": ..., "decoder": ...}, each side's tensors under its own Sequential's indices: a file of both under
    `encoder.`/`decoder.`, or a file of one side, told by index 0 (a decoder's is its `Clamp`, without weights)."""
    if not tensors:
        raise SourceError(f"{where}: holds no tensors")
    prefixed = any(k.startswith(("encoder.", "decoder.")) for k in tensors)
    if not prefixed:
        one = "encoder" if any(k.startswith("0.") for k in tensors) else "decoder"
    sides: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        side, rest = key.split(".", 1) if prefixed and "." in key else (None if prefixed else one, key)
        if side not in SIDES or not _INDEXED.match(rest):
            raise SourceError(_not_taesd(where, key))
        sides.setdefault(side, {})[rest] = value
    return sides


def _not_taesd(where: str, key: str) -> str:
    return (
        f"{where}: not a tiny VAE in madebyollin/taesd's layout: tensor {key!r} is no index of taesd.py's "
        f"Encoder/Decoder nn.Sequential (its keys look like {EXAMPLE_KEYS}). A diffusers-format VAE is a folder "
        "with its config.json"
    )


def read_side(part: Mapping[str, np.ndarray], side: str, where: str) -> Side:
    """One side's layout from its tensors' shapes (the module docstring says how)."""
    by_index: dict[int, dict[str, np.ndarray]] = {}
    for key, value in part.items():
        index, rest = _INDEXED.match(key).groups()
        by_index.setdefault(int(index), {})[rest] = value
    if side == "decoder" and 0 in by_index:
        raise SourceError(
            f"{where}: decoder index 0 is taesd.py's Clamp, which holds no weights; found {_names(0, by_index)}"
        )
    layers = []  # ("conv", index, has bias, weight shape) | ("block", index, width, has pool)
    for index in sorted(by_index):
        entry = by_index[index]
        if set(entry) <= {"weight", "bias"} and "weight" in entry and np.ndim(entry["weight"]) == 4:
            layers.append(("conv", index, "bias" in entry, tuple(entry["weight"].shape)))
        elif all(_BLOCK_PARAM.match(name) for name in entry) and "conv.0.weight" in entry:
            pool = any(name.startswith("pool.") for name in entry)
            layers.append(("block", index, int(entry["conv.0.weight"].shape[0]), pool))
        else:
            raise SourceError(
                f"{where}: {side} index {index} holds {_names(index, by_index)}, which is neither a 3x3 convolution "
                "(weight, bias) nor a block of taesd.py (conv.0/2/4, TAEF2's pool.0/1/3; a block changing width, "
                "with skip.weight, is in none of its networks)"
            )
    first, last = layers[0], layers[-1]
    if len(layers) < 3 or first[0] != "conv" or last[0] != "conv" or not first[2] or not last[2]:
        raise SourceError(
            f"{where}: the {side} must open and close with a convolution with bias around its blocks (taesd.py's "
            f"{side.capitalize()}); found {', '.join(f'{kind} at {index}' for kind, index, *_ in layers)}"
        )
    stages, widths = [0], {first[3][0], last[3][1]}
    for kind, index, info, shape in layers[1:-1]:
        if kind == "block":
            stages[-1] += 1
            widths.add(info)
        elif info:  # a convolution with bias between the ends: F32Encoder's second strided one, say
            raise SourceError(
                f"{where}: {side} index {index} is a convolution with bias between its blocks, where taesd.py has "
                "only bias-free ones (each starting a stage); the 32x variants (TAESANA) are not supported"
            )
        else:
            stages.append(0)
            widths.update(shape[:2])
    if len(widths) != 1:
        raise SourceError(
            f"{where}: the {side}'s layers have widths {sorted(widths)}; taesd.py's Encoder/Decoder keep one width "
            "throughout (64), as this engine's AutoencoderTiny does (the 32x variants, TAESANA, are not supported)"
        )
    midblock_gn = any(layer[0] == "block" and layer[3] for layer in layers)
    return Side(widths.pop(), tuple(stages), first[3][1], last[3][0], midblock_gn)


def _names(index: int, by_index: Mapping[int, Mapping]) -> str:
    return ", ".join(f"{index}.{name}" for name in sorted(by_index[index]))


def infer_config(sides: Mapping[str, Side], where: str) -> AutoencoderTinyConfig:
    """The config of a decoder, with its encoder when given (else the decoder's mirror, which nothing builds)."""
    decoder = sides["decoder"]
    encoder = sides.get("encoder") or Side(
        decoder.width, decoder.blocks[::-1], decoder.channels_out, decoder.channels_in, decoder.midblock_gn
    )
    problems = []
    if encoder.channels_out != decoder.channels_in:
        problems.append(
            f"the encoder writes {encoder.channels_out} latent channels, the decoder reads {decoder.channels_in}"
        )
    if encoder.midblock_gn != decoder.midblock_gn:
        has = "encoder" if encoder.midblock_gn else "decoder"
        problems.append(f"only the {has} has TAEF2's pool branch")
    if encoder.width != decoder.width:
        problems.append(f"the encoder is {encoder.width} wide, the decoder {decoder.width}")
    if problems:
        raise SourceError(f"{where}: its encoder and decoder are not one tiny VAE's: {'; '.join(problems)}")
    return AutoencoderTinyConfig.from_dict(
        dict(
            in_channels=encoder.channels_in,
            out_channels=decoder.channels_out,
            encoder_block_out_channels=(encoder.width,) * len(encoder.blocks),
            decoder_block_out_channels=(decoder.width,) * len(decoder.blocks),
            latent_channels=decoder.channels_in,
            num_encoder_blocks=encoder.blocks,
            num_decoder_blocks=decoder.blocks,
            use_midblock_gn=decoder.midblock_gn,
        ),
        where=where,
    )


def diffusers_names(side: str, part: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One side's tensors under diffusers' names (`encoder.layers.N`, `decoder.layers.N-1`: the module docstring)."""
    shift = 1 if side == "decoder" else 0
    out = {}
    for key, value in part.items():
        index, rest = _INDEXED.match(key).groups()
        out[f"{side}.layers.{int(index) - shift}.{rest}"] = value
    return out


@dataclass(frozen=True)
class TinyFiles:
    """A tiny VAE read from taesd.py's files: its config and its tensors in diffusers' layout."""

    config: AutoencoderTinyConfig
    tensors: dict[str, np.ndarray]
    encodes: bool  # an encoder was given: it reads pictures too


def read_tiny_vae(files: Iterable[Path], where: str) -> TinyFiles:
    """One tiny VAE from its files (a decoder, with or without its encoder, apart or together); refused by name:
    no decoder, several of a side, sides that are not one VAE's, a layout that is not taesd.py's."""
    found: dict[str, list[tuple[Path, Side]]] = {side: [] for side in SIDES}
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        for side, part in split_sides(read_file(file), str(file)).items():
            found[side].append((file, read_side(part, side, str(file))))
            tensors.update(diffusers_names(side, part))
    for side in SIDES:
        if len(found[side]) > 1:
            names = ", ".join(file.name for file, _ in found[side])
            raise SourceError(f"{where}: holds {len(found[side])} tiny VAE {side}s ({names}); give the file of one")
    if not found["decoder"]:
        raise SourceError(
            f"{where}: a tiny VAE encoder without its decoder; a VAE given to draw with needs the decoder "
            "(taesd.py's *_decoder file): give both files in one folder, or the decoder alone"
        )
    sides = {side: found[side][0][1] for side in SIDES if found[side]}
    return TinyFiles(infer_config(sides, where), tensors, encodes="encoder" in sides)


def weight_files(names: Iterable[str]) -> list[str]:
    """The names that may be taesd.py files, top-level ones only: one per stem, its `.safetensors` before its `.pth`."""
    by_stem: dict[str, str] = {}
    for name in sorted(names):
        path = Path(name)
        if "/" in name or path.suffix not in SUFFIXES:
            continue
        kept = by_stem.get(path.stem)
        if kept is None or SUFFIXES.index(path.suffix) < SUFFIXES.index(Path(kept).suffix):
            by_stem[path.stem] = name
    return sorted(by_stem.values())


def folder_files(folder: Path, where: str) -> list[Path]:
    """A folder's taesd.py files (`weight_files`); none: SourceError saying what a VAE folder holds."""
    names = weight_files(f.name for f in folder.iterdir() if f.is_file())
    if not names:
        raise SourceError(
            f"{where}: no config.json, so this is not a diffusers-format VAE folder, nor one holding a tiny VAE in "
            f"madebyollin/taesd's files ({', '.join('*' + s for s in SUFFIXES)}, e.g. taesd_decoder.safetensors)"
        )
    return [folder / name for name in names]


def check_fits(where: str, error: WeightsError) -> SourceError:
    """A strict load's refusal, said of these files (which have no config.json)."""
    detail = str(error).split("\n", 1)[1] if "\n" in str(error) else str(error)
    return SourceError(f"{where}: the tensors do not fit taesd.py's layout as their shapes describe it\n{detail}")
