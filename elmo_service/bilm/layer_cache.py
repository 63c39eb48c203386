"""A frozen biLM's layers per sentence, kept for the next time the sentence comes back.

    cache = LayerCache(max_bytes=512 * 2**20)
    key = sentence_key(char_ids [n, W])        # the sentence's own ids, no padding
    cache.get(key) -> layers [L+1, n+2, 2P] | None;  cache.put(key, layers)

Training a task network through a frozen ``Elmo`` feeds it the same sentences
every epoch; the biLM's answer for a sentence depends on the sentence alone
(every sentence starts from a zero state), so the second epoch on only needs the
mixes. Bounded memory: least recently used entries go first once the stored
tensors pass ``max_bytes``. ``Elmo`` clears it whenever a biLM weight changes.

:class:`WeightsWatch` is how ``Elmo`` knows: checked on every frozen forward, it
sees any write to the weights (``p.data`` included), after which the serving
kernel's packed copies are rebuilt and this cache emptied.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

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


class WeightsWatch:
    """Whether a model's weights changed since the last look, however they were written.

    ``_version`` and ``data_ptr`` (free to read) see every write through the
    parameter itself: in-place ops, ``copy_`` under ``no_grad``, ``load_state_dict``,
    optimizer steps, ``.to()``. A write through ``p.data`` goes to a tensor with
    a version counter of its own, so the content is checked too: each run of
    ``_CHUNK`` elements' weighted sum (one matrix-vector product over the weights,
    distinct weights per position, so scaling, copying, swapping rows or elements
    all show). A change smaller than float32 rounding of such a sum can pass
    unseen; it moves the outputs by less than that rounding.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._prints: list[tuple[Tensor, Tensor]] | None = None
        self._weights: dict[tuple, Tensor] = {}

    def changed(self, tensors: list[Tensor]) -> bool:
        """True on the first call and whenever any tensor differs from the last call."""
        key = tuple((t.data_ptr(), t._version, t.dtype, t.device, t.shape) for t in tensors)
        with torch.no_grad():
            prints = [self._fingerprint(t.detach()) for t in tensors]
        same = (
            key == self._key
            and self._prints is not None
            and all(
                torch.equal(a, c) and torch.equal(b, d)
                for (a, b), (c, d) in zip(prints, self._prints, strict=True)
            )
        )
        self._key, self._prints = key, prints
        return not same

    def reset(self) -> None:
        self._key = self._prints = None

    def _fingerprint(self, t: Tensor) -> tuple[Tensor, Tensor]:
        flat = t.reshape(-1)
        rows = flat.numel() // _CHUNK
        wkey = (t.dtype, t.device)
        w = self._weights.get(wkey)
        if w is None:
            w = torch.linspace(1.0, 2.0, _CHUNK, dtype=t.dtype, device=t.device)
            self._weights[wkey] = w
        head = flat[: rows * _CHUNK].view(rows, _CHUNK) @ w
        return head, flat[rows * _CHUNK :].clone()
