"""Per-sentence layer-vector cache behind one interface: Redis or in-process LRU.

Key: ``<prefix>:emb:<embedder.cache_key_prefix>:<dtype>:<sha256 of the token
texts>`` -- a new model version or tokenizer never reuses old vectors.

Value: a small header then the ``[L+1, T, D]`` array (float32 or float16)::

    magic "ELC2" | dtype u8 | L+1 u16 | T u32 | D u32 | len(version) u8 | version
    | sha256(token texts)[:8] | crc32 u32 | payload

``crc32`` covers every other byte of the entry (header and payload), so an
entry altered anywhere -- a flipped bit in Redis, a ``SETRANGE`` into the
vectors -- is caught; it is zlib's CRC (several GB/s, well under the cost of
encoding the same floats as JSON). Every read is verified against what the
request expects (magic, dtype, shape, model version, token digest, payload
length, checksum); a mismatch is counted as ``corrupt``, the entry deleted and
the vectors recomputed (and stored again). Entries of the previous format
(``ELC1``, no checksum) are deleted and recomputed without counting as
corrupt. Mixes and pooling are computed from cached layers, so task weights
never invalidate the cache.

Redis errors open a circuit breaker: for ``retry_interval`` seconds the
backend is skipped (requests are served uncached), then one request tries
again; a success closes it. A reply of the wrong type or length (a misbehaving
proxy, a "Redis-compatible" server) is such an error too (:class:`BadReply`).
A write the server refuses (``-OOM`` under ``noeviction``, ``-READONLY``) skips
writes alone for ``retry_interval``: the cache it holds is still read.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import struct
import threading
import time
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from cachetools import TTLCache

from elmo_api.metrics import Metrics
from elmo_storage import REPLY_SHAPE_ERRORS, BadReply, client_errors, connect, describe

log = logging.getLogger("elmo_api.cache")

MAGIC = b"ELC2"
_OLD_MAGIC = b"ELC1"  # before checksums: replaced on read, not counted as corrupt
_DTYPES = {"float32": 0, "float16": 1}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_HEAD = struct.Struct("<4sBHIIB")
_DIGEST = 8
_CRC = struct.Struct("<I")


def token_digest(tokens: Sequence[str]) -> bytes:
    h = hashlib.sha256()
    for t in tokens:
        h.update(t.encode("utf-8", "surrogatepass"))
        h.update(b"\x1f")
    return h.digest()


def cache_key(prefix: str, model_prefix: str, dtype: str, digest: bytes) -> str:
    return f"{prefix}:emb:{model_prefix}:{dtype}:{digest[:16].hex()}"


class CorruptEntry(ValueError):
    pass


class StaleEntry(CorruptEntry):
    """An entry of an older format: unusable, but not damaged."""


def pack(layers: np.ndarray, dtype: str, version: str, digest: bytes) -> bytes:
    arr = np.ascontiguousarray(layers, dtype=np.dtype(dtype).newbyteorder("<"))
    n, t, d = arr.shape
    v = version.encode()
    head = _HEAD.pack(MAGIC, _DTYPES[dtype], n, t, d, len(v)) + v + digest[:_DIGEST]
    payload = memoryview(arr).cast("B")
    crc = zlib.crc32(payload, zlib.crc32(head))
    return b"".join((head, _CRC.pack(crc), payload))


def unpack(
    blob: bytes, *, dtype: str, version: str, digest: bytes, shape: tuple[int, int, int]
) -> np.ndarray:
    """Verify and decode; raises CorruptEntry on any mismatch. Returns float32."""
    if not isinstance(blob, bytes | bytearray | memoryview) or len(blob) < _HEAD.size:
        raise CorruptEntry("short entry")
    magic, code, n, t, d, vlen = _HEAD.unpack_from(blob)
    if magic == _OLD_MAGIC:
        raise StaleEntry("entry of the previous format (no checksum)")
    if magic != MAGIC:
        raise CorruptEntry("bad magic")
    if _DTYPE_NAMES.get(code) != dtype:
        raise CorruptEntry("dtype mismatch")
    if (n, t, d) != tuple(shape):
        raise CorruptEntry(f"shape {(n, t, d)} != {tuple(shape)}")
    off = _HEAD.size
    if bytes(blob[off : off + vlen]).decode("utf-8", "replace") != version:
        raise CorruptEntry("model version mismatch")
    off += vlen
    if bytes(blob[off : off + _DIGEST]) != digest[:_DIGEST]:
        raise CorruptEntry("token digest mismatch")
    off += _DIGEST
    dt = np.dtype(dtype).newbyteorder("<")
    if len(blob) - off - _CRC.size != n * t * d * dt.itemsize:
        raise CorruptEntry("payload length mismatch")
    view = memoryview(blob)
    (want,) = _CRC.unpack_from(blob, off)
    if zlib.crc32(view[off + _CRC.size :], zlib.crc32(view[:off])) != want:
        raise CorruptEntry("checksum mismatch")
    off += _CRC.size
    arr = np.frombuffer(blob, dtype=dt, offset=off).reshape(n, t, d)
    if not np.isfinite(arr).all():
        raise CorruptEntry("non-finite values")
    return arr.astype(np.float32, copy=False)  # read-only view when stored as float32


def check_mget(reply: object, n: int) -> list[bytes | None]:
    """MGET's reply: ``n`` entries, each bytes or nil; BadReply otherwise."""
    if not isinstance(reply, list) or len(reply) != n:
        raise BadReply(f"MGET of {n} keys answered {describe(reply)}")
    if not all(v is None or isinstance(v, bytes) for v in reply):
        raise BadReply(f"MGET of {n} keys answered a non-string entry")
    return reply


class CacheBackend(ABC):
    """Bytes in, bytes out. Implementations never raise for backend failures:
    they count them, return misses and skip writes."""

    name: str

    @abstractmethod
    def get_many(self, keys: Sequence[str]) -> list[bytes | None]: ...

    @abstractmethod
    def set_many(self, items: Sequence[tuple[str, bytes]], ttl: int) -> None: ...

    @abstractmethod
    def delete_many(self, keys: Sequence[str]) -> None: ...

    @abstractmethod
    def state(self) -> dict[str, Any]: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


class NullCache(CacheBackend):
    name = "none"

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [None] * len(keys)

    def set_many(self, items: Sequence[tuple[str, bytes]], ttl: int) -> None:
        pass

    def delete_many(self, keys: Sequence[str]) -> None:
        pass

    def state(self) -> dict[str, Any]:
        return {"backend": self.name, "state": "disabled"}


class LocalCache(CacheBackend):
    """In-process LRU bounded in bytes (values' lengths), with a TTL."""

    name = "memory"

    def __init__(
        self, max_bytes: int, ttl: int, timer: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_bytes = max_bytes
        self._lru: TTLCache = TTLCache(maxsize=max_bytes, ttl=ttl, timer=timer, getsizeof=len)
        self._lock = threading.Lock()

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        with self._lock:
            return [self._lru.get(k) for k in keys]

    def set_many(self, items: Sequence[tuple[str, bytes]], ttl: int) -> None:
        with self._lock:
            for k, v in items:
                if len(v) <= self.max_bytes:
                    self._lru[k] = v

    def delete_many(self, keys: Sequence[str]) -> None:
        with self._lock:
            for k in keys:
                self._lru.pop(k, None)

    @property
    def current_bytes(self) -> int:
        return int(self._lru.currsize)

    def state(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "state": "ok",
            "entries": len(self._lru),
            "bytes": self.current_bytes,
            "max_bytes": self.max_bytes,
        }


class CircuitBreaker:
    """closed -> (failure) -> open for ``retry_interval`` -> half-open trial -> closed/open."""

    def __init__(self, retry_interval: float, timer: Callable[[], float] = time.monotonic) -> None:
        self.retry_interval = retry_interval
        self.timer = timer
        self._opened_at: float | None = None
        self._trial = False
        self._lock = threading.Lock()
        self.last_error: str | None = None

    def allow(self) -> bool:
        with self._lock:
            if self._opened_at is None:
                return True
            if self._trial:
                return False  # one trial at a time
            if self.timer() - self._opened_at >= self.retry_interval:
                self._trial = True
                return True
            return False

    def success(self) -> None:
        with self._lock:
            self._opened_at = None
            self._trial = False
            self.last_error = None

    def failure(self, error: str) -> None:
        with self._lock:
            self._opened_at = self.timer()
            self._trial = False
            self.last_error = error

    @property
    def state(self) -> str:
        if self._opened_at is None:
            return "ok"
        return "half_open" if self._trial else "down"


class RedisCache(CacheBackend):
    """Redis via redis-py: MGET for reads, a non-transactional pipeline of SET EX for writes."""

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        password: Any = None,
        timeout: float = 0.25,
        retry_interval: float = 5.0,
        metrics: Metrics | None = None,
        client: Any = None,
    ) -> None:
        import redis

        self.url = url
        self.metrics = metrics
        self.breaker = CircuitBreaker(retry_interval)
        self.client = client or connect(
            url, password=password, timeout=timeout, health_check_interval=0, max_connections=64
        )
        # a refused write (the server is up and says no) pauses writes alone
        self.write_breaker = CircuitBreaker(retry_interval)
        self._refused: type[BaseException] = redis.ResponseError
        self._errors = client_errors()

    def _failed(self, e: BaseException, op: str) -> None:
        was = self.breaker.state
        self.breaker.failure(f"{type(e).__name__}: {e}")
        if self.metrics:
            kind = "bad_reply" if isinstance(e, REPLY_SHAPE_ERRORS) else "backend"
            self.metrics.cache_errors.labels(kind).inc()
        if was == "ok":
            log.warning(
                "redis %s failed (%s); serving uncached, retrying in %.1fs",
                op,
                e,
                self.breaker.retry_interval,
            )

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys or not self.breaker.allow():
            return [None] * len(keys)
        try:
            values = check_mget(self.client.mget(list(keys)), len(keys))
        except self._errors as e:
            self._failed(e, "MGET")
            return [None] * len(keys)
        if self.breaker.state != "ok":
            log.info("redis is back")
        self.breaker.success()
        return values

    def set_many(self, items: Sequence[tuple[str, bytes]], ttl: int) -> None:
        if not items or not self.write_breaker.allow() or not self.breaker.allow():
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for k, v in items:
                pipe.set(k, v, ex=ttl)
            replies = pipe.execute()
            if not isinstance(replies, list) or len(replies) != len(items):
                raise BadReply(f"a pipeline of {len(items)} SETs answered {describe(replies)}")
            if not all(r is True for r in replies):  # redis-py maps +OK to True
                raise BadReply("SET answered something other than OK")
        except self._refused as e:  # e.g. OOM under noeviction: reads still work
            self._write_refused(e)
            return
        except self._errors as e:
            self._failed(e, "SET")
            return
        self.write_breaker.success()
        self.breaker.success()

    def _write_refused(self, e: BaseException) -> None:
        was = self.write_breaker.state
        self.write_breaker.failure(f"{type(e).__name__}: {e}")
        if self.metrics:
            self.metrics.cache_errors.labels("write_refused").inc()
        if was == "ok":
            log.warning(
                "redis refused a cache write (%s); still reading, writes retried in %.1fs",
                e,
                self.write_breaker.retry_interval,
            )

    def delete_many(self, keys: Sequence[str]) -> None:
        if not keys or not self.breaker.allow():
            return
        try:
            n = self.client.delete(*keys)
            if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= len(keys):
                raise BadReply(f"DEL of {len(keys)} keys answered {describe(n)}")
        except self._refused as e:
            self._write_refused(e)
            return
        except self._errors as e:
            self._failed(e, "DEL")
            return
        self.breaker.success()

    def ping(self) -> bool:
        try:
            return self.client.ping() is True  # redis-py maps +PONG to True
        except self._errors:
            return False

    def state(self) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": self.name, "state": self.breaker.state}
        if self.breaker.last_error:
            out["last_error"] = self.breaker.last_error
        if self.write_breaker.state != "ok":
            out["writes"] = "refused"
            out["last_write_error"] = self.write_breaker.last_error
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing a dead connection
            self.client.close()


class SentenceCache:
    """Typed layer: token lists -> verified arrays, using a byte backend."""

    def __init__(
        self,
        backend: CacheBackend,
        *,
        key_prefix: str,
        model_prefix: str,
        version: str,
        dtype: str,
        ttl: int,
        n_layers: int,
        dim: int,
        metrics: Metrics | None = None,
    ) -> None:
        self.backend = backend
        self.key_prefix, self.model_prefix, self.version = key_prefix, model_prefix, version
        self.dtype, self.ttl, self.n_layers, self.dim = dtype, ttl, n_layers, dim
        self.metrics = metrics
        self.enabled = not isinstance(backend, NullCache)
        self.blocking = isinstance(backend, RedisCache)  # network I/O: call it off the event loop

    def digests(self, token_lists: Sequence[Sequence[str]]) -> list[bytes]:
        return [token_digest(t) for t in token_lists]

    def key(self, digest: bytes) -> str:
        return cache_key(self.key_prefix, self.model_prefix, self.dtype, digest)

    def get(
        self, token_lists: Sequence[Sequence[str]], digests: Sequence[bytes]
    ) -> list[np.ndarray | None]:
        """Runs in a worker thread (backend I/O). An entry that fails verification is
        counted (``corrupt``), deleted and read as a miss, so its vectors are recomputed."""
        blobs = self.backend.get_many([self.key(d) for d in digests])
        out: list[np.ndarray | None] = []
        corrupt = 0
        bad: list[str] = []
        for toks, dig, blob in zip(token_lists, digests, blobs, strict=True):
            if blob is None:
                out.append(None)
                continue
            try:
                out.append(
                    unpack(blob, dtype=self.dtype, version=self.version, digest=dig,
                           shape=(self.n_layers, len(toks), self.dim))
                )  # fmt: skip
            except StaleEntry:
                bad.append(self.key(dig))
                out.append(None)
            except (CorruptEntry, ValueError, struct.error) as e:
                corrupt += 1
                bad.append(self.key(dig))
                log.warning("deleting corrupt cache entry %s: %s", self.key(dig), e)
                out.append(None)
        if bad:  # a failed recompute (or a timeout) must not leave them to be read again
            self.backend.delete_many(bad)
        if corrupt and self.metrics:
            self.metrics.cache_errors.labels("corrupt").inc(corrupt)
        return out

    def put(self, arrays: Sequence[np.ndarray], digests: Sequence[bytes]) -> None:
        items = [
            (self.key(d), pack(a, self.dtype, self.version, d))
            for a, d in zip(arrays, digests, strict=True)
        ]
        self.backend.set_many(items, self.ttl)

    def quantize(self, arr: np.ndarray) -> np.ndarray:
        """What a cache round trip would return, so cached == uncached exactly."""
        if self.dtype == "float32" or not self.enabled:
            return arr
        return arr.astype(np.float16).astype(np.float32)

    def state(self) -> dict[str, Any]:
        return {**self.backend.state(), "dtype": self.dtype, "ttl": self.ttl}
