"""Read a file `torch.save` wrote (plain containers and CPU tensors) as numpy arrays, without importing torch.

A server of an ONNX variant needs its dataset's tables, not torch: importing torch only to read them is
~1.3 s of CPU per server start (more on a busy machine), and a study or the test suite starts dozens.
torch's format (since 1.6) is a zip: `<name>/data.pkl` pickles the containers, each tensor as
`torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`, each storage as a persistent id
naming its raw little-endian bytes `<name>/data/<key>`. Like `torch.load(weights_only=True)`, the
unpickler resolves only an allow-list of names: nothing a file names is executed.
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path

import numpy as np

# torch.<Name>Storage -> element type (what Dataset files and state dicts hold)
_STORAGES = {
    "FloatStorage": np.float32,
    "DoubleStorage": np.float64,
    "HalfStorage": np.float16,
    "LongStorage": np.int64,
    "IntStorage": np.int32,
    "ShortStorage": np.int16,
    "CharStorage": np.int8,
    "ByteStorage": np.uint8,
    "BoolStorage": np.bool_,
}


class _Storage:
    """The element type a pickled storage class stands for."""

    def __init__(self, dtype: type) -> None:
        self.dtype = np.dtype(dtype)


def _rebuild_tensor_v2(
    storage: np.ndarray,
    offset: int,
    size: tuple,
    stride: tuple,
    requires_grad=False,
    hooks=None,
    metadata=None,
) -> np.ndarray:
    """The tensor as a view of its storage (a view shares it, as in torch; stride 0 stays expanded).
    as_strided checks nothing, so a view reaching past its storage is refused here."""
    item = storage.itemsize
    if min((offset, *size, *stride), default=0) < 0 or (
        all(size) and offset + sum((n - 1) * st for n, st in zip(size, stride, strict=True)) >= len(storage)
    ):
        raise pickle.UnpicklingError(
            f"a tensor of size {tuple(size)}, stride {tuple(stride)} at offset {offset} reaches past its "
            f"storage of {len(storage)} elements"
        )
    return np.lib.stride_tricks.as_strided(
        storage[offset:], shape=tuple(size), strides=tuple(s * item for s in stride), writeable=False
    )


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, archive: zipfile.ZipFile, prefix: str, path: Path) -> None:
        super().__init__(file)
        self.archive, self.prefix, self.path = archive, prefix, path
        self.storages: dict[str, np.ndarray] = {}

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor_v2
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name in _STORAGES:
            return _Storage(_STORAGES[name])
        raise pickle.UnpicklingError(f"{self.path}: {module}.{name} is not a tensor or a plain container")

    def persistent_load(self, pid: tuple) -> np.ndarray:
        kind, storage, key, location, _numel = pid
        if kind != "storage" or not isinstance(storage, _Storage) or not str(location).startswith("cpu"):
            raise pickle.UnpicklingError(f"{self.path}: storage {pid!r} is not a CPU tensor storage")
        if key not in self.storages:
            raw = self.archive.read(f"{self.prefix}/data/{key}")
            self.storages[key] = np.frombuffer(raw, dtype=storage.dtype)
        return self.storages[key]


def load(path: str | Path) -> object:
    """The object `torch.save` wrote to `path`, every tensor a read-only numpy array.

    Raises:
        pickle.UnpicklingError naming the file when it holds anything but tensors and plain containers,
        or is big-endian; zipfile.BadZipFile when it is not torch's zip format.
    """
    path = Path(path)
    with zipfile.ZipFile(path) as archive:
        pkl = next((n for n in archive.namelist() if n.endswith("/data.pkl")), None)
        if pkl is None:
            raise pickle.UnpicklingError(f"{path}: no data.pkl (not a file torch.save wrote)")
        prefix = pkl.removesuffix("/data.pkl")
        order = f"{prefix}/byteorder"
        if order in archive.namelist() and archive.read(order).decode() != "little":
            raise pickle.UnpicklingError(f"{path}: big-endian tensors (written on another machine)")
        with archive.open(pkl) as f:
            return _Unpickler(f, archive, prefix, path).load()
