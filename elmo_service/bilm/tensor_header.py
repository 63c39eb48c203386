"""What a ``torch.save`` file declares, read without building a tensor or running its code.

A converter must check a foreign checkpoint's tensors (their names, shapes, dtypes,
devices and sizes) before anything is allocated: ``torch.load`` allocates each storage at
the size the file *declares*, so a 1 KB file can ask for 40 GB, and a meta tensor loads
as a tensor with no values. :func:`read_header` parses the file's pickle with an
unpickler that knows only a state dict's vocabulary (``OrderedDict``, the storage types,
``torch._utils._rebuild_tensor_v2``/``_rebuild_parameter``) and turns each tensor into a
:class:`TensorInfo`; anything else in the pickle (a code payload) is refused by name, and
nothing it names is ever imported. Then each storage's declared size is held to the bytes
the file holds for it. Both formats torch writes are read: the zip archive (torch >= 1.6:
``<name>/data.pkl`` + ``<name>/data/<key>``) and the legacy stream (older torch, as
published ELMoForManyLangs models: magic, protocol, system info, the pickle, the storage
keys, then each storage as an 8-byte count and its bytes).

Only once the header holds together may the caller ``torch.load(..., weights_only=True)``
it: no storage is then larger than the file.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elmo_service.errors import ArtifactError

# the pickle of a state dict is small (names and shapes); anything larger is not one
MAX_PICKLE_BYTES = 64 << 20
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
# torch's storage classes (as the pickle names them) -> (dtype name, bytes per element)
STORAGE_TYPES = {
    "FloatStorage": ("float32", 4),
    "DoubleStorage": ("float64", 8),
    "HalfStorage": ("float16", 2),
    "BFloat16Storage": ("bfloat16", 2),
    "LongStorage": ("int64", 8),
    "IntStorage": ("int32", 4),
    "ShortStorage": ("int16", 2),
    "CharStorage": ("int8", 1),
    "ByteStorage": ("uint8", 1),
    "BoolStorage": ("bool", 1),
}
DTYPES = {d for d, _ in STORAGE_TYPES.values()}


@dataclass(frozen=True, slots=True)  # slots: a pickle's BUILD cannot rewrite one
class StorageInfo:
    key: str
    dtype: str
    itemsize: int
    location: str
    numel: int


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor as the file declares it."""

    storage: StorageInfo
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> str:
        return self.storage.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class _StorageType:
    def __init__(self, name: str) -> None:
        self.name = name


def _rebuild_tensor(storage: Any, offset: Any, shape: Any, stride: Any, *_rest: Any) -> TensorInfo:
    if not isinstance(storage, StorageInfo):
        raise ValueError("a tensor without a storage")
    ints = (tuple, list)
    if not (isinstance(shape, ints) and isinstance(stride, ints) and len(shape) == len(stride)):
        raise ValueError("a tensor whose shape and stride are not sizes")
    if not all(isinstance(n, int) and n >= 0 for n in (offset, *shape, *stride)):
        raise ValueError("a tensor with a negative or non-integer size")
    # a saved parameter is contiguous; a stride of 0 would make a huge view of a few bytes
    want = 1
    for n, st in zip(reversed(shape), reversed(stride), strict=True):
        if n > 1 and st != want:
            raise ValueError("a tensor that is not contiguous (not a saved parameter)")
        want *= n
    return TensorInfo(storage, offset, tuple(shape), tuple(stride))


def _rebuild_parameter(data: Any, *_rest: Any) -> Any:
    return data


class MetaTensor:
    """A tensor saved from the meta device: a shape and no values."""


def _rebuild_meta(*_args: Any) -> MetaTensor:
    return MetaTensor()


class _HeaderUnpickler(pickle.Unpickler):
    """A state dict's vocabulary only: every other global is refused, never imported."""

    ALLOWED = {
        ("collections", "OrderedDict"): OrderedDict,
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
        ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch._utils", "_rebuild_meta_tensor_no_storage"): _rebuild_meta,
    }

    def __init__(self, file: Any, legacy: bool) -> None:
        super().__init__(file, encoding="latin1")
        self.legacy = legacy
        self.storages: dict[str, StorageInfo] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED:
            return self.ALLOWED[(module, name)]
        if module == "torch" and name in STORAGE_TYPES:
            return _StorageType(name)
        if module == "torch" and name in DTYPES:
            return name  # a dtype's name (a meta tensor's pickle names its dtype)
        raise ValueError(f"holds code, not only tensors ({module}.{name})")

    def persistent_load(self, pid: Any) -> StorageInfo:
        want = 6 if self.legacy else 5  # legacy ids add a view's metadata
        if not (isinstance(pid, tuple) and len(pid) == want and pid[0] in ("storage", b"storage")):
            raise ValueError("a storage reference that is not one")
        kind, key, location, numel = pid[1:5]
        if self.legacy and pid[5] is not None:
            raise ValueError("a storage view (not written by torch.save of a state dict)")
        if not isinstance(kind, _StorageType):
            raise ValueError("a storage of an unknown type")
        if isinstance(location, bytes):
            location = location.decode("ascii", "replace")
        if not (isinstance(key, str) and isinstance(location, str)):
            raise ValueError("a storage with a malformed key or device")
        if not (isinstance(numel, int) and numel >= 0):
            raise ValueError(f"storage {key} declares {numel!r} values")
        dtype, itemsize = STORAGE_TYPES[kind.name]
        info = StorageInfo(key, dtype, itemsize, location, numel)
        if self.storages.setdefault(key, info) != info:
            raise ValueError(f"storage {key} is declared twice, differently")
        return info


def _unpickle(data: Any, legacy: bool) -> tuple[Any, dict[str, StorageInfo]]:
    u = _HeaderUnpickler(data, legacy)
    try:
        obj = u.load()
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - any malformed pickle: one line
        raise ValueError(f"its pickle is malformed ({type(e).__name__}: {e})") from None
    return obj, u.storages


def _zip_header(path: Path) -> tuple[Any, dict[str, StorageInfo]]:
    with zipfile.ZipFile(path) as z:
        infos = {i.filename: i for i in z.infolist()}
        pkls = [n for n in infos if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkls) != 1:
            raise ValueError("is a zip archive without one data.pkl (not a torch.save file)")
        prefix = pkls[0][: -len("data.pkl")]
        if infos[pkls[0]].file_size > MAX_PICKLE_BYTES:
            raise ValueError(f"its pickle declares {infos[pkls[0]].file_size:,} bytes")
        order = infos.get(prefix + "byteorder")
        if order is not None and z.read(order)[:16].strip() not in (b"little", b""):
            raise ValueError("stores big-endian values")
        obj, storages = _unpickle(io.BytesIO(z.read(pkls[0])), legacy=False)
        for s in storages.values():
            entry = infos.get(f"{prefix}data/{s.key}")
            if entry is None:
                raise ValueError(f"storage {s.key} has no data in the archive")
            if entry.compress_type != zipfile.ZIP_STORED:
                raise ValueError(f"storage {s.key} is compressed (torch.save never does that)")
            if entry.file_size != s.numel * s.itemsize:
                raise ValueError(
                    f"storage {s.key} declares {s.numel:,} values of {s.dtype} "
                    f"({s.numel * s.itemsize:,} bytes); the file holds {entry.file_size:,}"
                )
    return obj, storages


def _legacy_header(path: Path) -> tuple[Any, dict[str, StorageInfo]]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        # the pickles from memory: a file's read(n) would allocate the n a pickle declares
        head = io.BytesIO(f.read(min(size, MAX_PICKLE_BYTES)))
        for what in ("magic number", "protocol version", "system info"):
            value, _ = _unpickle(head, legacy=True)
            if what == "magic number" and value != LEGACY_MAGIC:
                raise ValueError("is neither a zip archive nor a torch.save stream")
        obj, storages = _unpickle(head, legacy=True)
        keys, _ = _unpickle(head, legacy=True)
        if not isinstance(keys, list) or sorted(map(str, keys)) != sorted(storages):
            raise ValueError("lists storages its pickle does not declare")
        f.seek(head.tell())
        for key in keys:  # each: an 8-byte count, then its bytes
            s = storages[key]
            head = f.read(8)
            if len(head) != 8:
                raise ValueError(f"storage {key} has no data in the file")
            (count,) = struct.unpack("<q", head)
            nbytes = s.numel * s.itemsize
            if count != s.numel or f.tell() + nbytes > size:
                raise ValueError(
                    f"storage {key} declares {s.numel:,} values of {s.dtype} "
                    f"({nbytes:,} bytes); the file holds {max(size - f.tell(), 0):,} after it"
                )
            f.seek(nbytes, io.SEEK_CUR)
    return obj, storages


def read_header(path: str | Path) -> dict[str, TensorInfo]:
    """The state dict a ``torch.save`` file declares, each tensor as :class:`TensorInfo`,
    or an ``ArtifactError`` naming the file and what is wrong (not a state dict of
    tensors, code in its pickle, a storage larger than its bytes, a tensor outside its
    storage). Reads the pickle and the sizes only."""
    path = Path(path)
    name = path.name
    try:
        reader = _zip_header if zipfile.is_zipfile(path) else _legacy_header
        obj, _ = reader(path)
    except ValueError as e:
        raise ArtifactError(f"{name} {e}", field=name) from None
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        raise ArtifactError(f"{name} cannot be read: {e}", field=name) from None
    if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
        raise ArtifactError(f"{name} is not a state dict of tensors", field=name)
    for key, t in obj.items():
        if isinstance(t, MetaTensor) or (
            isinstance(t, TensorInfo) and t.storage.location.split(":")[0] not in ("cpu", "cuda")
        ):
            where = "meta" if isinstance(t, MetaTensor) else t.storage.location
            raise ArtifactError(f"{name}: {key} is on device {where!r} (no values)", field=key)
        if not isinstance(t, TensorInfo):
            raise ArtifactError(f"{name}: {key} is not a tensor", field=key)
        if (
            t.numel
            and t.offset + sum((n - 1) * s for n, s in zip(t.shape, t.stride, strict=True))
            >= t.storage.numel
        ):
            raise ArtifactError(
                f"{name}: {key} (shape {list(t.shape)}) reaches past its storage's "
                f"{t.storage.numel:,} values",
                field=key,
            )
    return dict(obj)


__all__ = ["StorageInfo", "TensorInfo", "read_header"]
