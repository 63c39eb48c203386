"""``timeout`` as one request's whole deadline, for the sync client.

httpx's timeouts bound each network operation: a server that drips a byte every 2.5 s
holds a request with ``timeout=3`` for as long as it likes. Here every connect, read and
write of the sync client's sockets waits at most until the request's deadline (a context
variable the driver sets around each attempt), so the request as a whole ends by then
(``httpx.ReadTimeout`` and friends, which the driver reports). The async client gets the
same from ``asyncio.timeout``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import httpcore
import httpx

_DEADLINE: ContextVar[float | None] = ContextVar("elmo_client_deadline", default=None)


@contextlib.contextmanager
def deadline(seconds: float | None) -> Iterator[None]:
    """Every socket operation inside ends by ``seconds`` from now (None: no deadline)."""
    token = _DEADLINE.set(None if seconds is None else time.monotonic() + seconds)
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def _clip(timeout: float | None, error: type[Exception]) -> float | None:
    end = _DEADLINE.get()
    if end is None:
        return timeout
    left = end - time.monotonic()
    if left <= 0:
        raise error("the request's deadline passed")
    return left if timeout is None else min(timeout, left)


class _Stream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _clip(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _clip(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:  # fmt: skip
        inner = self._inner.start_tls(
            ssl_context, server_hostname, _clip(timeout, httpcore.ConnectTimeout)
        )
        return _Stream(inner)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _Backend(httpcore.NetworkBackend):
    def __init__(self, inner: httpcore.NetworkBackend) -> None:
        self._inner = inner

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None, socket_options: Any = None):  # fmt: skip
        return _Stream(self._inner.connect_tcp(
            host, port, _clip(timeout, httpcore.ConnectTimeout), local_address, socket_options
        ))  # fmt: skip

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Any = None):  # fmt: skip
        return _Stream(self._inner.connect_unix_socket(
            path, _clip(timeout, httpcore.ConnectTimeout), socket_options
        ))  # fmt: skip

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


def transport(limits: httpx.Limits) -> httpx.HTTPTransport:
    """httpx's own transport, its sockets bounded by the deadline. httpx has no public
    hook for the network backend: its pool's is wrapped (tests/elmo_service/
    test_client_faults.py's dripping server fails if that ever stops working)."""
    t = httpx.HTTPTransport(limits=limits)
    pool = t._pool
    pool._network_backend = _Backend(pool._network_backend)
    return t
