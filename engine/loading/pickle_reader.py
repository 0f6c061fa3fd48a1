"""PyTorch's pickled files (`.ckpt`, `.pt`, `.pth`, `.bin`) read as numpy arrays, without torch and without
running the pickle's code.

A pickle is a small program: its GLOBAL opcode names any importable callable and REDUCE calls it, so loading an
untrusted `.ckpt` with `pickle.load` (or `torch.load` without `weights_only`) runs whatever its author wrote. Here
the unpickler's `find_class` admits only the names that tensors and plain containers need, each mapped to a
function of ours (`ADMITTED`); any other name is refused before anything is called.

Two layouts (torch/serialization.py): the zip archive of torch >= 1.6 (`NAME/data.pkl` holding the object tree,
whose tensors refer by persistent id to storages `NAME/data/KEY`, raw bytes in `NAME/byteorder`'s order), and
the legacy stream of torch < 1.6 (five pickles: magic number, protocol, system info, the tree, the storage keys;
then each storage as an int64 element count and its bytes). A storage of the archive is mapped, not read, when
it is stored uncompressed, as torch writes it.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from ..errors import SourceError

# torch's typed storage classes, by the name a pickle gives them (`torch FloatStorage`), and torch's dtypes (`torch
# float8_e4m3fn`, which `_rebuild_tensor_v3` names beside an untyped storage).
STORAGE_DTYPES = {
    "DoubleStorage": np.float64,
    "FloatStorage": np.float32,
    "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}
TORCH_DTYPES = {
    "float64": np.float64,
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
    "int64": np.int64,
    "int32": np.int32,
    "int16": np.int16,
    "int8": np.int8,
    "uint8": np.uint8,
    "bool": np.bool_,
}
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # torch/serialization.py's MAGIC_NUMBER
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")


@dataclass(frozen=True)
class StorageType:
    """What `torch FloatStorage` (or `torch.storage UntypedStorage`, dtype None) stands for: an element type."""

    dtype: Any


@dataclass(frozen=True)
class TorchDtype:
    dtype: Any


@dataclass
class Storage:
    key: str
    dtype: Any  # None for an untyped storage: the tensor names its dtype
    data: np.ndarray | None = None  # uint8 bytes, set once read (the legacy layout reads them after the tree)


@dataclass(frozen=True)
class PendingTensor:
    """A tensor as the pickle describes it; `materialize` makes it an array once its storage's bytes are known."""

    storage: Storage
    offset: int  # in elements
    shape: tuple[int, ...]
    stride: tuple[int, ...]  # in elements
    dtype: Any


class InertObject:
    """An object of an admitted class (torch's `ParameterDict`, Lightning's `ModelCheckpoint`) kept as its pickled
    state only: none of the named class's code runs."""

    def __new__(cls, *args: Any, **kwargs: Any) -> InertObject:
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _rebuild_tensor(storage, offset, shape, stride, requires_grad=False, hooks=None, metadata=None) -> PendingTensor:
    if not isinstance(storage, Storage):
        raise pickle.UnpicklingError(f"a tensor's storage is a {type(storage).__name__}, not a storage")
    return PendingTensor(storage, int(offset), tuple(map(int, shape)), tuple(map(int, stride)), storage.dtype)


def _rebuild_tensor_v3(storage, offset, shape, stride, requires_grad, hooks, dtype, metadata=None) -> PendingTensor:
    if not isinstance(dtype, TorchDtype):
        raise pickle.UnpicklingError(f"a tensor's dtype is a {type(dtype).__name__}, not a torch dtype")
    tensor = _rebuild_tensor(storage, offset, shape, stride)
    return PendingTensor(tensor.storage, tensor.offset, tensor.shape, tensor.stride, dtype.dtype)


def _rebuild_parameter(data, requires_grad=False, hooks=None, state=None):
    return data  # nn.Parameter is its tensor here


def _rebuild_from_type(func, cls, args, state):
    return func(*args)  # a tensor with Python attributes: the attributes are dropped


def _encode(text: str, encoding: str = "latin1") -> bytes:
    """`_codecs.encode`, which protocol 2 uses to spell bytes: latin-1 only."""
    if encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"_codecs.encode with {encoding!r}")
    return text.encode("latin1")


def _numpy_scalar(dtype, data: bytes = b""):
    return np.frombuffer(data, np.dtype(dtype), count=1)[0]


def _numpy_reconstruct(cls, shape, typecode):
    if cls is not np.ndarray:
        raise pickle.UnpicklingError("numpy's _reconstruct of something other than an ndarray")
    return np.ndarray.__new__(np.ndarray, shape, typecode)


# (module, name) -> what it becomes. Nothing else is ever looked up.
ADMITTED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch", "Tensor"): TorchDtype(None),  # only named as `_rebuild_from_type_v2`'s class
    ("torch.storage", "UntypedStorage"): StorageType(None),
    ("torch.nn.modules.container", "ParameterDict"): InertObject,
    ("pytorch_lightning.callbacks.model_checkpoint", "ModelCheckpoint"): InertObject,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("__builtin__", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("_codecs", "encode"): _encode,
    ("numpy", "dtype"): np.dtype,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy.core.multiarray", "scalar"): _numpy_scalar,
    ("numpy._core.multiarray", "scalar"): _numpy_scalar,
    ("numpy.core.multiarray", "_reconstruct"): _numpy_reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _numpy_reconstruct,
}
ADMITTED.update({("torch", name): StorageType(dtype) for name, dtype in STORAGE_DTYPES.items()})
ADMITTED.update({("torch", name): TorchDtype(dtype) for name, dtype in TORCH_DTYPES.items()})


class RestrictedUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that resolves only `ADMITTED` names and turns storage references into `Storage`s."""

    def __init__(self, file, where: str, storages: dict[str, Storage]):
        super().__init__(file)
        self.where, self.storages = where, storages

    def find_class(self, module: str, name: str) -> Any:
        admitted = ADMITTED.get((module, name))
        if admitted is None:
            raise SourceError(
                f"{self.where}: the file's pickle calls {module}.{name}: refused (a checkpoint is read only when it "
                "holds tensors and plain containers; convert it to .safetensors where you trust it)"
            )
        return admitted

    def persistent_load(self, pid: Any) -> Storage:
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"an unknown persistent id {str(pid)[:80]}")
        kind, key = pid[1], str(pid[2])
        if not isinstance(kind, StorageType):
            raise pickle.UnpicklingError(f"storage {key} has type {kind!r}")
        if len(pid) > 5 and pid[5] is not None:  # the legacy layout's storage views (torch < 1.0)
            raise pickle.UnpicklingError(f"storage {key} is a view of another, which this reader does not follow")
        return self.storages.setdefault(key, Storage(key, kind.dtype))


def materialize(tensor: PendingTensor, where: str, big_endian: bool = False) -> np.ndarray:
    """The tensor as a (read-only where mapped) view of its storage's bytes; refused when they do not hold it."""
    if tensor.dtype is None:
        raise SourceError(f"{where}: storage {tensor.storage.key} is untyped and its tensor names no dtype")
    dtype = np.dtype(tensor.dtype).newbyteorder(">" if big_endian else "<")
    data = tensor.storage.data
    if data is None or data.size % dtype.itemsize:
        raise SourceError(f"{where}: storage {tensor.storage.key} is missing or not a whole number of {dtype.name}")
    elements = data.view(dtype)
    if len(tensor.shape) != len(tensor.stride) or min(tensor.stride, default=0) < 0 or tensor.offset < 0:
        raise SourceError(
            f"{where}: a tensor of storage {tensor.storage.key} has shape {tensor.shape}, stride {tensor.stride}"
        )
    if 0 in tensor.shape:
        return np.zeros(tensor.shape, dtype.newbyteorder("="))
    last = tensor.offset + sum((size - 1) * step for size, step in zip(tensor.shape, tensor.stride, strict=True))
    if last >= elements.size:
        raise SourceError(
            f"{where}: a tensor of shape {tensor.shape} needs {last + 1} elements of storage {tensor.storage.key}, "
            f"which holds {elements.size} (a truncated or damaged file)"
        )
    strides = tuple(step * dtype.itemsize for step in tensor.stride)
    view = np.lib.stride_tricks.as_strided(elements[tensor.offset :], tensor.shape, strides, writeable=False)
    return view.astype(dtype.newbyteorder("=")) if big_endian else view


def _resolve(obj: Any, where: str, big_endian: bool) -> Any:
    """The tree with each pending tensor made an array."""
    if isinstance(obj, PendingTensor):
        return materialize(obj, where, big_endian)
    if isinstance(obj, dict):
        for key, value in obj.items():
            obj[key] = _resolve(value, where, big_endian)
    elif isinstance(obj, list):
        obj[:] = [_resolve(value, where, big_endian) for value in obj]
    elif isinstance(obj, tuple):
        return tuple(_resolve(value, where, big_endian) for value in obj)
    elif isinstance(obj, InertObject):
        obj.state = _resolve(obj.state, where, big_endian)
    return obj


def _entry_bytes(archive: zipfile.ZipFile, mapped: np.ndarray, info: zipfile.ZipInfo) -> np.ndarray:
    """An archive member's bytes: a view of the mapped file when stored uncompressed, else read."""
    if info.compress_type != zipfile.ZIP_STORED:
        return np.frombuffer(archive.read(info), np.uint8)
    header = mapped[info.header_offset : info.header_offset + 30].tobytes()
    if len(header) < 30 or header[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"no local header for {info.filename}")
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    start = info.header_offset + 30 + name_length + extra_length
    if start + info.file_size > mapped.size:
        raise zipfile.BadZipFile(f"{info.filename} runs past the end of the file")
    return mapped[start : start + info.file_size]


def _load_zip(file: Path, where: str) -> Any:
    mapped = np.memmap(file, dtype=np.uint8, mode="r")
    with zipfile.ZipFile(file) as archive:
        infos = {info.filename: info for info in archive.infolist()}
        pickles = [name for name in infos if name.endswith("/data.pkl") and name.count("/") == 1]
        if len(pickles) != 1:
            raise SourceError(f"{where}: a zip archive without one NAME/data.pkl, so not a PyTorch file")
        root = pickles[0][: -len("data.pkl")]
        big_endian = f"{root}byteorder" in infos and archive.read(f"{root}byteorder").strip() == b"big"
        storages: dict[str, Storage] = {}
        tree = RestrictedUnpickler(io.BytesIO(archive.read(pickles[0])), where, storages).load()
        for key, storage in storages.items():
            info = infos.get(f"{root}data/{key}")
            if info is None:
                raise SourceError(f"{where}: the pickle names storage {key}, which the archive lacks")
            storage.data = _entry_bytes(archive, mapped, info)
    return _resolve(tree, where, big_endian)


def _load_legacy(file: Path, where: str) -> Any:
    storages: dict[str, Storage] = {}
    with open(file, "rb") as stream:
        if RestrictedUnpickler(stream, where, storages).load() != LEGACY_MAGIC:
            raise SourceError(f"{where}: neither a zip archive nor a legacy PyTorch file")
        RestrictedUnpickler(stream, where, storages).load()  # the protocol version
        sys_info = RestrictedUnpickler(stream, where, storages).load()
        tree = RestrictedUnpickler(stream, where, storages).load()
        keys = RestrictedUnpickler(stream, where, storages).load()
        for key in keys:
            storage = storages.get(str(key))
            if storage is None or storage.dtype is None:
                raise SourceError(f"{where}: the file lists storage {key}, which its pickle does not name")
            (count,) = struct.unpack("<q", stream.read(8).rjust(8, b"\0"))
            size = count * np.dtype(storage.dtype).itemsize
            data = stream.read(size)
            if len(data) != size:
                raise SourceError(f"{where}: storage {key} ends after {len(data)} of its {size} bytes (truncated)")
            storage.data = np.frombuffer(data, np.uint8)
    little = not isinstance(sys_info, dict) or sys_info.get("little_endian", True)
    return _resolve(tree, where, big_endian=not little)


def load_pickle(file: str | Path) -> Any:
    """The object tree of a PyTorch file, with every tensor as a numpy array (bf16 and fp8 through ml_dtypes).

    Refused by name (SourceError): a pickle that names a callable or class we do not admit, a truncated or damaged
    file, a tensor its storage does not hold.
    """
    file = Path(file)
    where = str(file)
    try:
        if zipfile.is_zipfile(file):
            return _load_zip(file, where)
        return _load_legacy(file, where)
    except SourceError:
        raise
    except (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, ValueError, TypeError, struct.error) as err:
        raise SourceError(f"{where}: not a readable PyTorch file ({type(err).__name__}: {err})") from err
    except (AttributeError, IndexError, KeyError, MemoryError, OverflowError, RecursionError) as err:
        raise SourceError(f"{where}: a damaged PyTorch file ({type(err).__name__}: {err})") from err


def flatten(tree: Any, prefix: str = "") -> dict[str, np.ndarray]:
    """The arrays of a tree of dicts (and inert objects' `_parameters`, as a `ParameterDict` keeps them), by their
    keys joined with dots; other values are left out."""
    if isinstance(tree, InertObject):
        state = tree.state if isinstance(tree.state, dict) else {}
        tree = state.get("_parameters", {})
    out: dict[str, np.ndarray] = {}
    if isinstance(tree, np.ndarray):
        out[prefix.rstrip(".")] = tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
    return out


def read_tensors(file: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a PyTorch file by its dotted name in the file's tree of dicts (`state_dict.model.x.weight`,
    `string_to_param.*`)."""
    return flatten(load_pickle(file))
