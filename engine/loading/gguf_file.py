"""GGUF transformer files (city96's quantized FLUX.1 and SD 3.5, as ComfyUI-GGUF, Krita and SillyTavern look for
them): read with the `gguf` package, the tensors under their original (BFL / MMDiT) names.

GGUF keeps each tensor's dimensions innermost first and quantizes along the innermost one, in blocks: Q8_0 is 32
int8 values sharing one f16 scale; the K-quants (Q4_K, Q5_K, Q6_K...) are 256-value super-blocks of sub-block scales.
`general.architecture` says what the file holds (city96's converter writes flux, sd3, sdxl, sd1, aura, ltxv, hyvid,
wan...); `comfy.gguf.orig_shape.NAME` gives a tensor's shape where the converter reshaped it to quantize it.

What each tensor becomes (`read_gguf`):
- F32, F16, BF16: views of the mapped file, as they are (widened to the run dtype when the model is built).
- Q8_0: kept as it is, as our int8 (`Int8Kernel` with one scale per block of 32 inputs of each output channel:
  `Q8Tensor.kernel`), so its values are exactly the file's (in f32; a bf16 run rounds each f16 scale to bf16). One
  scale per output channel, as `--quantize int8` holds, would not do: Q8_0's scales differ from block to block along
  each row (in no row of a real file are they all equal), so taking them over would mean quantizing again, adding
  up to half a step of the channel's scale (max |w| / 254), some four times Q8_0's own error where a row has
  outliers.
- Every other quantized type gguf can dequantize (the K-quants, Q4_0, Q5_0...): dequantized by gguf at load, one
  tensor at a time, to the run dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np

from ..errors import SourceError
from .quantize import Int8Kernel

SUFFIX = ".gguf"
PREFIX = "model.diffusion_model."  # ComfyUI's checkpoint prefix, which some files keep


@dataclass
class GGUFContents:
    architecture: str  # general.architecture
    tensors: dict[str, np.ndarray]  # the original names (prefix taken off); dequantized where quantized
    types: dict[str, int] = field(default_factory=dict)  # tensor type -> count, for the log and for people


class Q8Tensor:
    """A Q8_0 tensor, read when it is used. As a linear weight [out, in] it becomes an `Int8Kernel` holding its int8
    values and its scales as they are (`kernel`: one per block of 32 inputs of each output); rows picked from it
    (a fused q/k/v projection's) stay Q8_0; anything else reads its values (each block's f16 scale times its int8
    values, exact in f32) through `np.asarray`."""

    dtype = np.dtype(np.float32)
    BLOCK, BYTES = 32, 34  # values per block; bytes per block: an f16 scale, then 32 int8

    def __init__(self, blocks: np.ndarray, shape: tuple[int, ...]):
        self.blocks, self.shape, self.ndim = blocks, tuple(shape), len(shape)

    def values(self) -> np.ndarray:
        import gguf

        return gguf.quants.dequantize(self.blocks, gguf.GGMLQuantizationType.Q8_0).reshape(self.shape)

    def reshape(self, shape: tuple[int, ...]) -> Q8Tensor:
        return Q8Tensor(self.blocks, shape)

    @property
    def rows_of_blocks(self) -> bool:
        """Whether each row is whole blocks in the file's own rows: a weight [out, in] as Q8_0 stores it, not one
        reshaped to quantize it (`comfy.gguf.orig_shape`), whose blocks may cross its rows."""
        return (
            self.ndim == 2
            and self.blocks.ndim == 2
            and self.blocks.shape == (self.shape[0], self.shape[1] // self.BLOCK * self.BYTES)
            and self.shape[1] % self.BLOCK == 0
        )

    def __getitem__(self, index) -> Q8Tensor | np.ndarray:
        if self.rows_of_blocks and isinstance(index, (slice, np.ndarray)):  # whole rows
            rows = self.blocks[index]
            return Q8Tensor(rows, (rows.shape[0], self.shape[1]))
        return self.values()[index]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        values = self.values()
        return values if dtype is None else values.astype(dtype)

    def kernel(self, dtype) -> Int8Kernel:
        """The weight [out, in] as our kernel [in, out]: the int8 values as they are, the scales [in / 32, out] in
        `dtype` (exact in f32 and f16; bf16 rounds each f16 scale to 8 significant bits)."""
        out, inputs = self.shape
        blocks = np.ascontiguousarray(self.blocks).reshape(out, inputs // self.BLOCK, self.BYTES)
        scale = blocks[:, :, :2].copy().view(np.float16)[:, :, 0]  # [out, in / 32]
        values = blocks[:, :, 2:].copy().view(np.int8).reshape(out, inputs)
        return Int8Kernel(np.ascontiguousarray(values.T), np.ascontiguousarray(scale.T).astype(dtype))


def _string_field(reader, name: str) -> str | None:
    found = reader.get_field(name)
    if found is None:
        return None
    try:
        return bytes(found.parts[found.data[-1]]).decode("utf-8")
    except (IndexError, UnicodeDecodeError, TypeError):
        return None


def _orig_shape(reader, name: str) -> tuple[int, ...] | None:
    found = reader.get_field(f"comfy.gguf.orig_shape.{name}")
    if found is None:
        return None
    return tuple(int(found.parts[i][0]) for i in found.data)


def _open(path: Path):
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as err:  # a truncated or foreign file fails deep in the reader, as any of several errors
        raise SourceError(f"{path}: not a readable GGUF file ({type(err).__name__}: {err})") from err
    architecture = _string_field(reader, "general.architecture")
    if architecture is None:
        raise SourceError(f"{path}: a GGUF file without general.architecture, so what model it holds is unknown")
    return reader, architecture


def read_gguf(path: Path, dtype) -> GGUFContents:
    """The file's tensors by their names (see the module's docstring for what each type becomes); `dtype`: the run
    dtype that dequantized tensors are cast to."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    reader, architecture = _open(path)
    dtype = np.dtype(ml_dtypes.bfloat16) if str(dtype) == "bfloat16" else np.dtype(dtype)
    contents = GGUFContents(architecture, {})
    prefixed = any(t.name.startswith(PREFIX) for t in reader.tensors)
    for tensor in reader.tensors:
        name = tensor.name
        if prefixed:
            if not name.startswith(PREFIX):
                continue
            name = name[len(PREFIX) :]
        kind = Q(tensor.tensor_type)
        shape = _orig_shape(reader, tensor.name) or tuple(int(n) for n in reversed(tensor.shape))
        data = tensor.data
        if kind in (Q.F32, Q.F16, Q.F64):
            array = data
        elif kind == Q.BF16:
            array = data.view(np.uint16).view(ml_dtypes.bfloat16)
        elif kind == Q.Q8_0:
            if data.size * Q8Tensor.BLOCK != int(np.prod(shape)) * Q8Tensor.BYTES:
                raise SourceError(f"{path}: tensor {name}'s {data.size} bytes of Q8_0 do not hold its shape {shape}")
            array = Q8Tensor(data, shape)  # read when used, or kept as int8
        else:
            try:
                array = gguf.quants.dequantize(data, kind).astype(dtype)
            except NotImplementedError as err:
                raise SourceError(f"{path}: tensor {name} is {kind.name}, which gguf cannot dequantize") from err
        if int(np.prod(array.shape)) != int(np.prod(shape)):
            raise SourceError(f"{path}: tensor {name} holds {int(np.prod(array.shape))} values, not its shape {shape}")
        contents.tensors[name] = array.reshape(shape)
        contents.types[kind.name] = contents.types.get(kind.name, 0) + 1
    return contents
