"""Reading safetensors: the engine maps the files instead of reading them, and must see what the safetensors
package sees, tensor for tensor and bit for bit; a broken file is refused by name, never half-read."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL as TorchVAE
from flax import nnx
from reference import VAE_LAYOUT, randomize, state_dict_numpy
from safetensors.torch import load_file, save_file

from engine.errors import WeightsError
from engine.loading.weights import ALIGNMENT, convert, map_safetensors
from engine.models.config import VAEConfig
from engine.models.vae import AutoencoderKL

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
]


def as_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:  # numpy has no bf16: compare the bits
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_mapped_file_holds_what_the_safetensors_package_reads(dtype, tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": (torch.randn(7, 5, 3, generator=g) * 50).to(dtype),
        "b.bias": (torch.randn(11, generator=g) * 50).to(dtype),
        "scalar": torch.tensor(3).to(dtype),
        "empty": torch.zeros(0, 4).to(dtype),
    }
    file = tmp_path / "model.safetensors"
    save_file(tensors, str(file), metadata={"format": "pt"})
    want = {name: as_numpy(t) for name, t in load_file(str(file)).items()}
    got = map_safetensors(file)
    assert got.keys() == want.keys()  # the metadata is no tensor
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert got[name].tobytes() == want[name].tobytes(), name
        assert not got[name].flags.writeable  # a view of the file: the engine never writes through it


def with_header(header: object):
    """A damage that replaces the file's JSON header with `header`, keeping the tensor bytes."""

    def damage(data: bytes) -> bytes:
        length = int.from_bytes(data[:8], "little")
        text = json.dumps(header).encode()
        return len(text).to_bytes(8, "little") + text + data[8 + length :]

    return damage


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda data: data[:5], "5 bytes"),
        (lambda data: data[:8] + b"{not json" + data[17:], "header does not parse"),
        (lambda data: data[:-4], "do not hold"),
        (with_header({"w": {"dtype": "F32", "shape": [4, 4]}}), "lacks dtype, shape or data_offsets"),
        (with_header({"w": {"dtype": "F32", "shape": [4], "data_offsets": "0..16"}}), "lacks dtype"),
        (with_header({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [64, 0]}}), "do not hold"),
        (with_header(["w"]), "not a table of tensors"),
    ],
    ids=[
        "shorter than its header length",
        "header not JSON",
        "truncated tensor bytes",
        "an entry without its offsets",
        "offsets of the wrong kind",
        "offsets backwards",
        "header not a table",
    ],
)
def test_a_broken_file_is_refused_by_name(damage, says, tmp_path):
    file = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(4, 4)}, str(file))
    file.write_bytes(damage(file.read_bytes()))
    with pytest.raises(WeightsError, match=says) as err:
        map_safetensors(file)
    assert str(file) in str(err.value)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_converted_params_are_aligned_read_only_copies_of_the_file(dtype, tmp_path):
    # Aligned so the CPU's device_put can use them in place; read-only because it then may.
    ref = randomize(TorchVAE(**VAE_LAYOUT))
    file = tmp_path / "vae.safetensors"
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(file))
    cfg = VAEConfig.from_dict(dict(ref.config))
    _, mapped = convert(lambda: AutoencoderKL(cfg, nnx.Rngs(0)), map_safetensors(file), dtype)
    _, read = convert(lambda: AutoencoderKL(cfg, nnx.Rngs(0)), state_dict_numpy(ref), dtype)
    for (path, a), (_, b) in zip(nnx.to_flat_state(mapped), nnx.to_flat_state(read), strict=True):
        a, b = a.get_value(), b.get_value()
        assert a.dtype == np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype), path
        assert a.ctypes.data % ALIGNMENT == 0 and not a.flags.writeable and a.flags.c_contiguous, path
        np.testing.assert_array_equal(a, b, err_msg=str(path))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "make_view",
    [
        lambda a: a.reshape(200, 300).T,  # a linear kernel: [out, in] -> [in, out]
        lambda a: a[:54000].reshape(150, 40, 3, 3).transpose(2, 3, 1, 0),  # a convolution's: OIHW -> HWIO
        lambda a: a.reshape(60000)[::-1].reshape(300, 200),  # negative strides
        lambda a: a.reshape(300, 200),  # already in order
    ],
    ids=["linear", "convolution", "reversed", "contiguous"],
)
def test_a_kernel_is_copied_into_our_layout_exactly_whatever_its_strides(make_view, dtype):
    # Transposed views are copied in strips (STRIP columns at a time); widths that are no multiple of it included.
    from engine.loading.weights import aligned_copy

    view = make_view(np.random.default_rng(0).standard_normal(60000).astype(np.float32))
    copy = aligned_copy(view, ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)
    np.testing.assert_array_equal(copy, np.ascontiguousarray(view).astype(copy.dtype))
    assert copy.ctypes.data % ALIGNMENT == 0 and not copy.flags.writeable and copy.flags.c_contiguous
