"""A frozen biLM's layers per sentence, kept for the next time the sentence comes back.

    cache = LayerCache(max_bytes=512 * 2**20)
    key = sentence_key(char_ids [n, W])        # the sentence's own ids, no padding
    cache.get(key) -> layers [L+1, n+2, 2P] | None;  cache.put(key, layers)

Training a task network through a frozen ``Elmo`` feeds it the same sentences
every epoch; the biLM's answer for a sentence depends on the sentence alone
(every sentence starts from a zero state), so the second epoch on only needs the
mixes. Bounded memory: least recently used entries go first once the stored
tensors pass ``max_bytes``. ``Elmo`` clears it whenever a biLM weight changes.

:class:`WeightsWatch` is how ``Elmo`` knows: checked on every frozen forward at the
cost of a few integer reads per weight, it sees any write to the weights (``p.data``
included), after which the serving kernel's packed copies are rebuilt and this cache
emptied.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)


def sentence_key(char_ids: np.ndarray) -> bytes:
    """A sentence's identity: a hash of its character ids ``[n, W]`` and their shape
    (16 bytes of blake2b: a collision is ~2^-64 likely over 2^32 sentences)."""
    ids = np.ascontiguousarray(char_ids, dtype=np.int64)
    h = hashlib.blake2b(digest_size=16)
    h.update(np.asarray(ids.shape, dtype=np.int64).tobytes())
    h.update(ids.tobytes())
    return h.digest()


def weights_id(tensors: Iterable[Tensor]) -> str:
    """sha256 of the weights' dtypes, shapes and bytes: the on-disk cache's folder, so
    that layers are only ever read back for the weights that computed them."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b"")
    return h.hexdigest()[:32]


class LayerCache:
    """LRU over ``key -> tensor``, bounded by the tensors' bytes; optionally on disk.

    A tensor larger than the whole budget is not kept in memory. With
    ``directory``, every entry is also written there (one safetensors shard per
    :meth:`flush`, written atomically; no pickle), in a folder per weights
    (:meth:`scope`), and a memory miss reads it back: a later process on the same
    weights starts with them. The folder is not bounded: delete it freely. Not
    thread-safe (one module's forward uses it).
    """

    def __init__(self, max_bytes: int, directory: str | Path | None = None) -> None:
        self.max_bytes = int(max_bytes)
        self.directory = None if directory is None else Path(directory)
        self._entries: OrderedDict[bytes, Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.disk_hits = 0
        self._folder: Path | None = None  # this weights' folder (scope)
        self._on_disk: dict[bytes, Path] = {}  # key -> its shard
        self._pending: dict[bytes, Tensor] = {}  # put since the last flush

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> Tensor | None:
        hit = self._entries.get(key)
        if hit is None and key in self._on_disk:
            hit = self._read(key)
            if hit is not None:
                self.disk_hits += 1
                self._remember(key, hit)
        if hit is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return hit

    def put(self, key: bytes, value: Tensor) -> None:
        if self._folder is not None and key not in self._on_disk:
            self._pending[key] = value
        self._remember(key, value)

    def _remember(self, key: bytes, value: Tensor) -> None:
        size = value.numel() * value.element_size()
        if size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.numel() * old.element_size()
        self._entries[key] = value
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= dropped.numel() * dropped.element_size()

    def clear(self) -> None:
        """Forget what is in memory (what is on disk stays, in its weights' folder)."""
        self._entries.clear()
        self._pending.clear()
        self.bytes = 0

    # -- on disk --------------------------------------------------------------
    def scope(self, weights: str) -> None:
        """Serve the weights ``weights`` (:func:`weights_id`) from now on: memory
        emptied, the disk index read from that weights' folder."""
        self.clear()
        self._on_disk = {}
        if self.directory is None:
            return
        from safetensors import safe_open

        self._folder = self.directory / weights
        for shard in sorted(self._folder.glob("*.safetensors")):
            try:
                with safe_open(shard, framework="pt") as f:
                    names = list(f.keys())
            except Exception as e:  # a damaged shard: its sentences are computed again
                log.warning("layer cache: skipping %s (%s)", shard, e)
                continue
            self._on_disk.update({bytes.fromhex(n): shard for n in names})

    def flush(self) -> None:
        """Write the entries put since the last flush as one shard (atomic, fsync'ed)."""
        if self._folder is None or not self._pending:
            return
        from safetensors.torch import save

        from elmo_service.atomic import write_bytes

        self._folder.mkdir(parents=True, exist_ok=True)
        shard = self._folder / f"{uuid.uuid4().hex}.safetensors"
        data = save({k.hex(): v.detach().cpu().contiguous() for k, v in self._pending.items()})
        write_bytes(shard, data)
        self._on_disk.update(dict.fromkeys(self._pending, shard))
        self._pending.clear()

    def _read(self, key: bytes) -> Tensor | None:
        from safetensors import safe_open

        shard = self._on_disk[key]
        try:
            with safe_open(shard, framework="pt") as f:
                return f.get_tensor(key.hex())
        except Exception as e:  # gone or damaged since: computed again
            log.warning("layer cache: cannot read %s (%s)", shard, e)
            del self._on_disk[key]
            return None

    def stats(self) -> dict:
        return {
            "entries": len(self._entries),
            "bytes": self.bytes,
            "max_bytes": self.max_bytes,
            "hits": self.hits,
            "misses": self.misses,
            "disk_hits": self.disk_hits,
            "on_disk": len(self._on_disk),
        }


# ---------------------------------------------------------------- weights that change
_CHUNK = 256  # elements per fingerprint entry: the fingerprint is 1/256 of the weights
_DATA = torch._C.TensorBase.data  # the getter and setter every tensor's ``.data`` runs
_NUMPY = torch._C.TensorBase.numpy


class WeightsWatch:
    """Whether a model's weights changed since the last look, however they were written.

    A look costs a few integer reads per tensor, never a pass over the weights:

    * ``_version`` and ``data_ptr`` see every write through the tensor itself: in-place
      ops, ``copy_`` under ``no_grad``, ``load_state_dict``, optimizer steps, ``.to()``,
      ``.data = ...``, and writes through ``detach()`` or a view (they share the counter);
    * what hands the storage out with a version counter of its own (``.data``, ``numpy()``,
      the tensor given to ``.data = ...``) is seen being handed out: the watch gives its
      tensors a subclass (:class:`WatchedParameter`, :class:`WatchedTensor`: the same
      tensor otherwise; plain again when pickled) whose ``.data`` and ``numpy()`` note the
      handle and the tensor's content fingerprint at that moment. The next look compares
      the fingerprint, and keeps doing so only while such a handle lives.

    The fingerprint: each run of ``_CHUNK`` elements' weighted sum (one matrix-vector
    product, distinct weights per position, so scaling, copying, swapping rows or elements
    all show). A change smaller than float32 rounding of such a sum can pass unseen; it
    moves the outputs by less than that rounding. Not seen: writes through memory that
    aliased a weight before the watch was made (a ``.data`` tensor taken before, a numpy
    array a tensor was made from), or through a ``detach().numpy()`` view: they bypass the
    tensor entirely. ``Elmo`` makes its watch with the module.
    """

    def __init__(self, tensors: Iterable[Tensor] = ()) -> None:
        """``tensors``: follow their handles from now on, before the first look (a ``.data``
        tensor kept from before the watch saw a weight could be written unseen)."""
        self._key: tuple | None = None
        for t in tensors:
            if not isinstance(t, _Hooks):
                _hook(t)

    def changed(self, tensors: list[Tensor]) -> bool:
        """True on the first call and whenever any tensor differs from the last call."""
        key = []
        for t in tensors:
            if not isinstance(t, _Hooks):
                _hook(t)
            opened = _OPENED.get(id(t))
            writes = 0 if opened is None else opened.look(t)
            key.append((t.data_ptr(), t._version, t.dtype, t.device, t.shape, writes))
        key = tuple(key)
        moved = key != self._key
        self._key = key
        return moved

    def reset(self) -> None:
        self._key = None


class _Opened:
    """A watched tensor whose storage went out: its fingerprint when it first went out
    since the last look (None: nothing out), weak references to the handles (``.data``
    tensors, numpy arrays) still out, and how many content changes looks have found: part
    of every watch's key, so each watch of the tensor sees a change whichever one found it."""

    __slots__ = ("baseline", "handles", "writes")

    def __init__(self) -> None:
        self.baseline: tuple[Tensor, Tensor] | None = None
        self.handles: list[Callable[[], object]] = []
        self.writes = 0

    def look(self, t: Tensor) -> int:
        """Compare the content with the fingerprint taken when the storage went out; keep
        comparing at later looks only while a handle lives (it may still be written)."""
        if self.baseline is None:
            return self.writes
        now = _fingerprint(_DATA.__get__(t))
        if not _same(now, self.baseline):
            self.writes += 1
        self.handles = [h for h in self.handles if h() is not None]
        self.baseline = now if self.handles else None
        return self.writes


_OPENED: dict[int, _Opened] = {}  # id(watched tensor) -> its handles (dropped with it)


def _handed_out(t: Tensor, handle: object) -> None:
    opened = _OPENED.get(id(t))
    if opened is None:
        opened = _OPENED[id(t)] = _Opened()
        weakref.finalize(t, _OPENED.pop, id(t), None)
    if opened.baseline is None:  # what the last look saw, unless version or pointer moved
        opened.baseline = _fingerprint(_DATA.__get__(t))
    try:
        opened.handles.append(weakref.ref(handle))
    except TypeError:  # cannot be followed: the content is compared at every look
        opened.handles.append(lambda: True)


class _Hooks:
    """``.data`` and ``numpy()`` that tell the watch their storage went out."""

    @property
    def data(self) -> Tensor:
        out = _DATA.__get__(self)
        _handed_out(self, out)
        return out

    @data.setter
    def data(self, value: Tensor) -> None:
        _DATA.__set__(self, value)
        _handed_out(self, value)  # the storage is now also ``value``'s, with its own counter

    def numpy(self, *, force: bool = False) -> np.ndarray:
        out = _NUMPY(self, force=force)
        _handed_out(self, out)
        return out

    def __repr__(self, *, tensor_contents=None) -> str:
        plain = _DATA.__get__(self).requires_grad_(self.requires_grad)
        text = repr(plain)
        return f"Parameter containing:\n{text}" if isinstance(self, nn.Parameter) else text


class WatchedParameter(_Hooks, nn.Parameter):
    """A parameter a :class:`WeightsWatch` follows (pickled, it is a plain Parameter)."""


class WatchedTensor(_Hooks, Tensor):
    """A tensor a :class:`WeightsWatch` follows."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # ops give plain tensors


_WATCHED: dict[type, type] = {nn.Parameter: WatchedParameter, Tensor: WatchedTensor}


def _hook(t: Tensor) -> None:
    """Give ``t`` the watched class of its own; where that cannot be done (a tensor
    subclass with a layout of its own), its content is compared at every look."""
    cls = type(t)
    watched = _WATCHED.get(cls)
    if watched is None:
        watched = _WATCHED[cls] = type(f"Watched{cls.__name__}", (_Hooks, cls), {})
    try:
        t.__class__ = watched
    except TypeError:
        _handed_out(t, lambda: True)  # never freed: always compared


def _same(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> bool:
    return all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b, strict=True))


_WEIGHTS: dict[tuple, Tensor] = {}


@torch.no_grad()
def _fingerprint(t: Tensor) -> tuple[Tensor, Tensor]:
    flat = t.reshape(-1)
    rows = flat.numel() // _CHUNK
    if not flat.is_floating_point():
        return flat.clone(), flat[:0]
    wkey = (t.dtype, t.device)
    w = _WEIGHTS.get(wkey)
    if w is None:
        w = _WEIGHTS[wkey] = torch.linspace(1.0, 2.0, _CHUNK, dtype=t.dtype, device=t.device)
    head = flat[: rows * _CHUNK].view(rows, _CHUNK) @ w
    return head, flat[rows * _CHUNK :].clone()
