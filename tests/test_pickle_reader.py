"""PyTorch's pickled files read without torch and without running their code: what torch.save wrote reads back
bit for bit, in both layouts; a pickle that calls anything beyond tensors and containers is refused by name
before the call; a truncated file is refused."""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from collections import OrderedDict

import ml_dtypes
import numpy as np
import pytest
import torch

from engine.errors import SourceError
from engine.loading.pickle_reader import load_pickle, read_tensors

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int8, torch.uint8, torch.bool]


def as_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:  # numpy has no bf16: compare the bits
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return t.numpy()


def tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = {f"t_{str(d).removeprefix('torch.')}": (torch.randn(3, 5, generator=gen) * 9).to(d) for d in DTYPES}
    base = torch.randn(4, 6, generator=gen)
    out["transposed"] = base.T  # a strided view: the storage is shared, the strides differ
    out["sliced"] = base[1:3, ::2]  # an offset and a step
    out["shared"] = base  # the same storage as the two views
    out["scalar"] = torch.tensor(2.5)
    out["empty"] = torch.zeros(0, 3)
    out["fp8"] = torch.randn(2, 3, generator=gen).to(torch.float8_e4m3fn)  # `_rebuild_tensor_v3`, untyped storage
    return out


@pytest.mark.parametrize("zip_layout", [True, False], ids=["zip", "legacy"])
def test_reads_what_torch_saved(tmp_path, zip_layout):
    want = tensors()
    if not zip_layout:
        want.pop("fp8")  # the legacy writer predates float8
    file = tmp_path / "x.pt"
    torch.save(want, file, _use_new_zipfile_serialization=zip_layout)
    got = read_tensors(file)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        expected = as_numpy(tensor.contiguous())
        assert got[name].dtype == expected.dtype, name
        assert got[name].shape == expected.shape, name
        np.testing.assert_array_equal(
            np.ascontiguousarray(got[name]).view(np.uint8), np.ascontiguousarray(expected).view(np.uint8)
        )


def test_nested_trees_as_embeddings_and_checkpoints_hold_them(tmp_path):
    """A1111's embedding (`string_to_param` as a dict, and as the original textual inversion's ParameterDict) and a
    Lightning checkpoint's `state_dict` beside plain values."""
    vector = torch.randn(2, 8)
    embedding = {
        "string_to_token": {"*": 265},
        "string_to_param": {"*": vector},
        "name": "bad-hands",
        "step": 1500,
        "sd_checkpoint_name": "v1-5",
    }
    torch.save(embedding, tmp_path / "a1111.pt")
    assert read_tensors(tmp_path / "a1111.pt").keys() == {"string_to_param.*"}
    np.testing.assert_array_equal(read_tensors(tmp_path / "a1111.pt")["string_to_param.*"], vector.numpy())
    tree = load_pickle(tmp_path / "a1111.pt")
    assert tree["name"] == "bad-hands" and tree["step"] == 1500 and tree["string_to_token"] == {"*": 265}

    original = dict(embedding, string_to_param=torch.nn.ParameterDict({"*": torch.nn.Parameter(vector)}))
    torch.save(original, tmp_path / "original.pt")
    np.testing.assert_array_equal(read_tensors(tmp_path / "original.pt")["string_to_param.*"], vector.numpy())

    weights = OrderedDict({"model.diffusion_model.conv.weight": torch.ones(2, 3), "alphas": torch.arange(3.0)})
    torch.save({"state_dict": weights, "global_step": 470000, "epoch": np.int64(3)}, tmp_path / "sd.ckpt")
    got = read_tensors(tmp_path / "sd.ckpt")
    assert got.keys() == {"state_dict.model.diffusion_model.conv.weight", "state_dict.alphas"}
    assert load_pickle(tmp_path / "sd.ckpt")["epoch"] == 3


class Calls:
    """A pickle that calls `func(*args)` when loaded."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def zip_with_pickle(tmp_path, payload: bytes, name: str = "bad.ckpt"):
    file = tmp_path / name
    with zipfile.ZipFile(file, "w") as archive:
        archive.writestr("archive/data.pkl", payload)
        archive.writestr("archive/version", "3\n")
    return file


@pytest.mark.parametrize(
    "func, args, refused",
    [
        (os.system, ("touch {marker}",), "system: refused"),
        (eval, ("open({marker!r}, 'w')",), r"(builtins|__builtin__)\.eval: refused"),
        (__import__, ("os",), r"(builtins|__builtin__)\.__import__: refused"),
    ],
    ids=["os.system", "eval", "import"],
)
@pytest.mark.parametrize("zip_layout", [True, False], ids=["zip", "legacy"])
def test_a_pickle_that_calls_a_function_is_refused_by_name(tmp_path, func, args, refused, zip_layout):
    marker = tmp_path / "ran"
    args = tuple(a.format(marker=str(marker)) if isinstance(a, str) else a for a in args)
    payload = pickle.dumps({"weight": Calls(func, *args)}, protocol=2)
    if zip_layout:
        file = zip_with_pickle(tmp_path, payload)
    else:  # a bare pickle stream where the legacy layout's magic number would be
        file = tmp_path / "bad.pt"
        file.write_bytes(payload)
    with pytest.raises(SourceError, match=refused):
        read_tensors(file)
    assert not marker.exists()


def test_an_unknown_class_is_refused_by_name(tmp_path):
    payload = pickle.dumps({"weight": io.BytesIO(b"x")}, protocol=2)
    with pytest.raises(SourceError, match=r"_io\.BytesIO: refused"):
        read_tensors(zip_with_pickle(tmp_path, payload))


@pytest.mark.parametrize("keep", [0.5, 0.98])
def test_a_truncated_file_is_refused(tmp_path, keep):
    file = tmp_path / "x.pt"
    torch.save({"a": torch.randn(64, 64), "b": torch.randn(8)}, file)
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(SourceError, match="x.pt"):
        read_tensors(file)


def test_a_storage_too_small_for_its_tensor_is_refused(tmp_path):
    file = tmp_path / "x.pt"
    torch.save({"a": torch.randn(4, 4)}, file)
    with zipfile.ZipFile(file) as archive:  # rewrite with the storage cut to half
        members = {info.filename: archive.read(info) for info in archive.infolist()}
    storage = next(name for name in members if name.endswith("data/0"))
    members[storage] = members[storage][:32]
    with zipfile.ZipFile(file, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    with pytest.raises(SourceError, match="truncated or damaged"):
        read_tensors(file)


def test_not_a_pytorch_file(tmp_path):
    file = tmp_path / "x.pt"
    file.write_bytes(b"hello, this is text")
    with pytest.raises(SourceError, match="x.pt"):
        read_tensors(file)
