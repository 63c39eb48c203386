"""``Client``: the service from Python, on httpx; concurrency on a thread pool."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any

import httpx

from elmo_client import ops
from elmo_client.deadline import deadline, transport
from elmo_client.document import document_call
from elmo_client.errors import ServiceError, ServiceUnreachable, redact
from elmo_client.shared import EmbeddedSentence, InputError
from elmo_client.wire import (
    Call,
    Http,
    Limits,
    Many,
    Open,
    Reply,
    RetryPolicy,
    Sleep,
    attempts,
    opening,
    stops_the_rest,
)

DEFAULT_TIMEOUT = 60.0
DEFAULT_IN_FLIGHT = 16
DEFAULT_BATCH = 64
# failures of the connection itself (refused, reset, dropped mid-answer, a protocol error):
# an idempotent call retries them; a timeout is the caller's own bound and is not retried
RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadError, httpx.WriteError,
             httpx.RemoteProtocolError, httpx.CloseError)  # fmt: skip


def headers_for(api_key: str | None) -> dict[str, str]:
    h = {"Content-Type": "application/json", "Accept": "application/json"}
    if api_key:
        h["Authorization"] = f"Bearer {api_key}"
    return h


def checked_url(base_url: str) -> httpx.URL:
    """``base_url`` as a URL, or an InputError naming it (its credentials hidden)."""
    try:
        url = httpx.URL(base_url)
    except httpx.InvalidURL as e:
        raise InputError(
            f"{redact(repr(base_url))} is not a URL: {redact(e)}", field="base_url"
        ) from None
    if url.scheme not in ("http", "https") or not url.host:
        raise InputError(
            f"{redact(repr(base_url))} is not an http(s) URL with a host "
            "(e.g. http://127.0.0.1:8000)",
            field="base_url",
        )
    return url


def unreachable(url: str, e: Exception) -> ServiceUnreachable:
    return ServiceUnreachable(url, e, retryable=isinstance(e, RETRYABLE))


def reply_of(r: httpx.Response, url: str, content: bytes) -> Reply:
    return Reply(r.status_code, {k.lower(): v for k, v in r.headers.items()}, content, url)


class Connection:
    """What ``Client`` and ``AsyncClient`` share: their parameters (``Client``'s docstring),
    the httpx client of the subclass's ``_make_http``, and the resources."""

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
        checked_url(base_url)
        self._url = base_url.rstrip("/")
        # what messages and ``base_url`` show: never a URL's user:password@
        self.base_url = redact(self._url)
        self.timeout = timeout
        self.retry = RetryPolicy(retries=retries, deadline=retry_deadline)
        self.max_in_flight = max(1, max_in_flight)
        self._session = ops.Session(batch_size, self.retry, self.base_url)
        limits = httpx.Limits(
            max_connections=self.max_in_flight, max_keepalive_connections=self.max_in_flight
        )
        self._http = self._make_http(
            base_url=self._url, headers=headers_for(api_key), timeout=timeout, limits=limits
        )
        self.tasks = ops.Tasks(self._run)
        self.models = ops.Models(self._run)
        self.jobs = ops.Jobs(self._run)

    def _make_http(self, **kw: Any) -> Any:
        raise NotImplementedError


class Client(Connection):
    """The service's client: ``embed`` as the library's, ``tasks``, ``models``, ``jobs``.

    # Parameters

    base_url : `str`
        The service, e.g. ``"http://127.0.0.1:8000"``.
    api_key : `str`, optional
        Sent as ``Authorization: Bearer``; an admin key for task writes, activation, jobs.
    timeout : `float`, optional
        Seconds one HTTP request may take in all (connect, send, wait, read: a deadline for
        the whole request, not for each read).
    retries : `int`, optional
        Refusals (429, 503), gateway failures and timeouts (408, 502, 504) and connection
        errors retried at most this many times per request (job submission: 429/503
        only) ...
    retry_deadline : `float`, optional
        ... and never past this many seconds after its first attempt (also how long
        ``embed`` keeps asking for chunks of one model version during a rollout).
    max_in_flight : `int`, optional
        Requests one ``embed`` call keeps in flight at once.
    batch_size : `int`, optional
        Sentences per request at most (the server's own limit caps it too).
    """

    _pool: ThreadPoolExecutor | None = None
    _pool_lock = threading.Lock()  # guards the pool's creation only: rare and brief

    def _make_http(self, **kw: Any) -> httpx.Client:
        return httpx.Client(transport=transport(kw["limits"]), **kw)

    # -- the public calls ---------------------------------------------------
    def embed(
        self,
        sentences: Sequence[str | Sequence[str]],
        *,
        mix: Any = None,
        granularity: str = "token",
        output: str | None = None,
        pooling: str = "none",
        priority: str | None = None,
        model_version: str | None = None,
    ) -> ops.EmbedResult:
        """``Embedder.embed`` over HTTP: an ``EmbeddedSentence`` per sentence, in order.

        ``mix``: a task name or a ``MixSpec`` (fills ``.mix``); ``output``: ``"layers"``,
        ``"mix"`` (``.layers`` is then None; with no ``mix``, the server's default mix) or
        ``"both"`` (the default with a mix); ``pooling``: ``"mean"``/``"max"`` over
        positions (``.layers`` ``[L+1, D]``, ``.mix`` ``[D]``). ``priority``:
        ``"interactive"`` or ``"batch"`` (default: the server's, interactive, for a call
        sent in one request; ``"batch"`` for one split into several). The result's
        ``model_version`` names the model that computed every vector; ``model_version=``
        pins it (chunks from another model are asked again until ``retry_deadline``).
        An empty sentence gets an empty answer (zero tokens); an empty list, ``[]``."""
        return self._run(
            ops.embed(
                self._session, sentences, mix=mix, granularity=granularity, output=output,
                pooling=pooling, priority=priority, model_version=model_version,
            )
        )  # fmt: skip

    def embed_document(
        self,
        document: str | Sequence[str],
        chunk_tokens: int | None = None,
        *,
        mix: Any = None,
        granularity: str = "token",
        output: str | None = None,
        pooling: str = "none",
        priority: str | None = None,
    ) -> Iterator[EmbeddedSentence]:
        """``Embedder.embed_document`` over HTTP (``POST /v1/embed/document``): the
        document (a string, or its words) as one sequence, yielded chunk by chunk in
        document order as ``EmbeddedSentence`` values whose tokens carry offsets into the
        document. ``timeout`` bounds the wait for each chunk; a stream that ends without
        the server's ``done`` raises ServiceError."""
        call, reader = document_call(
            self.base_url, document, chunk_tokens, mix=mix, granularity=granularity,
            output=output, pooling=pooling, priority=priority,
        )  # fmt: skip
        r = self._run(opening(call, self.retry, self.base_url))
        try:
            lines = r.iter_lines()
            while True:
                try:
                    with deadline(self.timeout):
                        line = next(lines)
                except StopIteration:
                    break
                except (httpx.TransportError, httpx.StreamError) as e:
                    raise unreachable(reader.url, e) from None
                got = reader.feed(line)
                if got is not None:
                    yield got
            reader.finish()
        finally:
            r.close()

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
                elif isinstance(step, Open):
                    value = self._open(step.call)
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

    def _attempt(self, call: Call) -> Reply:
        url = self.base_url + call.path
        try:
            with deadline(self.timeout):
                r = self._http.request(
                    call.method, call.path, content=call.body(), params=call.params
                )
        except (httpx.TransportError, httpx.InvalidURL) as e:
            raise unreachable(url, e) from None
        return reply_of(r, url, r.content)

    def _open(self, call: Call) -> tuple[Reply, httpx.Response | None]:
        """A streamed answer's status and headers; its body read only when it is an error."""
        url = self.base_url + call.path
        try:
            with deadline(self.timeout):
                req = self._http.build_request(
                    call.method, call.path, content=call.body(), params=call.params
                )
                r = self._http.send(req, stream=True)
                if r.status_code < 400:
                    return reply_of(r, url, b""), r
                try:
                    return reply_of(r, url, r.read()), None
                finally:
                    r.close()
        except (httpx.TransportError, httpx.InvalidURL) as e:
            raise unreachable(url, e) from None

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
