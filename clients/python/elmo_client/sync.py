"""``Client``: the service from Python, on httpx; concurrency on a thread pool."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any

import httpx

from elmo_service.client import ops
from elmo_service.client.errors import ServiceError, ServiceUnreachable
from elmo_service.client.wire import (
    Call,
    Http,
    Limits,
    Many,
    RetryPolicy,
    Sleep,
    attempts,
    stops_the_rest,
)
from elmo_service.errors import InputError

DEFAULT_TIMEOUT = 60.0
DEFAULT_IN_FLIGHT = 16
DEFAULT_BATCH = 64


def headers_for(api_key: str | None) -> dict[str, str]:
    h = {"Content-Type": "application/json", "Accept": "application/json"}
    if api_key:
        h["Authorization"] = f"Bearer {api_key}"
    return h


def checked_url(make, base_url: str):
    """``make`` (an httpx client class) that refuses an unusable base URL naming it."""
    try:
        url = httpx.URL(base_url)
    except httpx.InvalidURL as e:
        raise InputError(f"{base_url!r} is not a URL: {e}", field="base_url") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise InputError(
            f"{base_url!r} is not an http(s) URL with a host (e.g. http://127.0.0.1:8000)",
            field="base_url",
        )
    return make


class Connection:
    """What ``Client`` and ``AsyncClient`` share: their parameters (``Client``'s docstring),
    the httpx client of the subclass's ``_http_class``, and the resources."""

    _http_class: type

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        retries: int = 20,
        retry_deadline: float = 120.0,
        max_in_flight: int = DEFAULT_IN_FLIGHT,
        batch_size: int = DEFAULT_BATCH,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.retry = RetryPolicy(retries=retries, deadline=retry_deadline)
        self.max_in_flight = max(1, max_in_flight)
        self._session = ops.Session(batch_size)
        self._http = checked_url(self._http_class, self.base_url)(
            base_url=self.base_url,
            headers=headers_for(api_key),
            timeout=timeout,
            limits=httpx.Limits(
                max_connections=self.max_in_flight, max_keepalive_connections=self.max_in_flight
            ),
        )
        self.tasks = ops.Tasks(self._run)
        self.models = ops.Models(self._run)
        self.jobs = ops.Jobs(self._run)


class Client(Connection):
    """The service's client: ``embed`` as the library's, ``tasks``, ``models``, ``jobs``.

    # Parameters

    base_url : `str`
        The service, e.g. ``"http://127.0.0.1:8000"``.
    api_key : `str`, optional
        Sent as ``Authorization: Bearer``; an admin key for task writes, activation, jobs.
    timeout : `float`, optional
        Seconds one HTTP request may take (connect, send, wait, read).
    retries : `int`, optional
        429/503 answers retried at most this many times per request ...
    retry_deadline : `float`, optional
        ... and never past this many seconds after its first attempt.
    max_in_flight : `int`, optional
        Requests one ``embed`` call keeps in flight at once.
    batch_size : `int`, optional
        Sentences per request at most (the server's own limit caps it too).
    """

    _http_class = httpx.Client
    _pool: ThreadPoolExecutor | None = None
    _pool_lock = threading.Lock()  # guards the pool's creation only: rare and brief

    # -- the public calls ---------------------------------------------------
    def embed(
        self,
        sentences: Sequence[str | Sequence[str]],
        *,
        mix: Any = None,
        granularity: str = "token",
        output: str | None = None,
        pooling: str = "none",
    ) -> ops.EmbedResult:
        """``Embedder.embed`` over HTTP: an ``EmbeddedSentence`` per sentence, in order.

        ``mix``: a task name or a ``MixSpec`` (fills ``.mix``); ``output``: ``"layers"``,
        ``"mix"`` (``.layers`` is then None; with no ``mix``, the server's default mix) or
        ``"both"`` (the default with a mix); ``pooling``: ``"mean"``/``"max"`` over
        positions (``.layers`` ``[L+1, D]``, ``.mix`` ``[D]``). The result's
        ``model_version`` names the model that computed every vector."""
        return self._run(
            ops.embed(
                self._session, sentences, mix=mix, granularity=granularity,
                output=output, pooling=pooling,
            )
        )  # fmt: skip

    def limits(self, refresh: bool = False) -> Limits:
        """What one request may hold (``GET /v1/limits``), read once."""
        return self._run(ops.limits(self._session, refresh))

    def ready(self) -> dict[str, Any]:
        """``GET /readyz`` (a 503 while loading raises ServiceError, after retries)."""
        return self._run(ops.one(Call("GET", "/readyz")))

    def close(self) -> None:
        self._http.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the driver ---------------------------------------------------------
    def _run(self, op: ops.Op) -> Any:
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                step = op.send(value) if error is None else op.throw(error)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            try:
                if isinstance(step, Http):
                    value = self._attempt(step.call)
                elif isinstance(step, Call):
                    value = self._send(step)
                elif isinstance(step, Many):
                    value = self._many(step.calls)
                elif isinstance(step, Sleep):
                    time.sleep(step.seconds)
                else:
                    raise TypeError(f"unknown step {step!r}")
            except Exception as e:  # into the operation, so its cleanup runs
                error = e

    def _send(self, call: Call) -> Any:
        return self._run(attempts(call, self.retry, self.base_url))

    def _attempt(self, call: Call) -> tuple[int, str | None, bytes]:
        try:
            r = self._http.request(call.method, call.path, content=call.body(), params=call.params)
        except (httpx.TransportError, httpx.InvalidURL) as e:
            raise ServiceUnreachable(self.base_url + call.path, e) from None
        return r.status_code, r.headers.get("retry-after"), r.content

    def _many(self, calls: list[Call]) -> list[Any]:
        if len(calls) == 1:
            try:
                return [self._send(calls[0])]
            except ServiceError as e:
                return [e]
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.max_in_flight, thread_name_prefix="elmo-client"
                )
        futures = [self._pool.submit(self._send, c) for c in calls]
        pending: set[Future] = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            if any(f.exception() is not None and stops_the_rest(f.exception()) for f in done):
                for f in pending:
                    f.cancel()
                wait(pending)
                break
        out: list[Any] = []
        for f in futures:
            if f.cancelled():
                out.append(None)
            elif f.exception() is not None:
                if not isinstance(f.exception(), ServiceError):
                    raise f.exception()  # unreachable, or a bug: not an answer
                out.append(f.exception())
            else:
                out.append(f.result())
        return out
