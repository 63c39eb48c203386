"""Pure-ASGI middleware: body size (413), JSON content type (415), batch announcements,
the model version that answered (``X-Model-Version``), where an embedding answer's time
went (``X-Total-Time`` and its parts).

The body is read here, bounded by ``ELMO_MAX_BODY_BYTES`` (declared
Content-Length or counted while streaming), then replayed to the app; later
``receive`` calls go to the server, so disconnect detection still works.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elmo_api.dialects import TEI_PATHS
from elmo_api.encoding import dumps
from elmo_api.errors import error_body
from elmo_api.metrics import ASGIApp, Message, Metrics, Receive, Scope, Send
from elmo_api.served import SERVED_KEY
from elmo_api.timing import TIMING_KEY, RequestTiming

_BODY_METHODS = {"POST", "PUT", "PATCH"}
TICKET_KEY = "elmo.batch_ticket"
EMBED_PATHS = frozenset({"/v1/embed", "/v1/embeddings"})
# keys the router sets in the scope it is handed; see elmo_api.metrics.route_label
ROUTING_KEYS = ("route", "endpoint")


async def _send_error(send: Send, status: int, code: str, message: str, field: str | None) -> None:
    body = dumps(error_body(code, message, field))
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _is_json(content_type: str) -> bool:
    mt = content_type.split(";", 1)[0].strip().lower()
    return mt == "application/json" or (mt.startswith("application/") and mt.endswith("+json"))


def _form_default(content_type: str) -> bool:
    """No content type, or curl's default for ``-d``: the body is taken as JSON."""
    mt = content_type.split(";", 1)[0].strip().lower()
    return mt in ("", "application/x-www-form-urlencoded")


class RequestGuardMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: Callable[[], int]) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        headers = {
            k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])
        }
        limit = self.max_body_bytes()
        declared = headers.get("content-length")
        has_body = headers.get("transfer-encoding", "").lower() == "chunked" or (
            declared not in (None, "0")
        )
        content_type = headers.get("content-type", "")
        inner = scope
        if has_body and _form_default(content_type):
            # `curl -d '{...}'` sends JSON labelled as a form: read it as the JSON it is.
            # A copy, as ASGI asks of middleware that changes the scope.
            inner = dict(scope)
            inner["headers"] = [
                (k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-type"
            ] + [(b"content-type", b"application/json")]
        elif has_body and not _is_json(content_type):
            got = headers.get("content-type") or "none"
            await _send_error(
                send,
                415,
                "unsupported_media_type",
                f"Content-Type must be application/json, got {got}",
                "content-type",
            )
            return
        if declared is not None:
            try:
                n = int(declared)
            except ValueError:
                await _send_error(
                    send, 400, "invalid_request", "bad Content-Length header", "content-length"
                )
                return
            if n > limit:
                await _send_error(
                    send,
                    413,
                    "body_too_large",
                    f"request body is {n} bytes; the limit is {limit}",
                    "body",
                )
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _send_error(
                    send,
                    413,
                    "body_too_large",
                    f"request body exceeds the limit of {limit} bytes",
                    "body",
                )
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        if inner is scope:
            await self.app(scope, replay, send)
            return
        try:
            await self.app(inner, replay, send)
        finally:
            # what the router matched, back out to the metrics middleware (the rest of the
            # copy, i.e. the rewritten content type, stays inside)
            for key in ROUTING_KEYS:
                if key in inner:
                    scope[key] = inner[key]


class AnnounceMiddleware:
    """Announce an embedding request to the batcher the moment it arrives.

    The batcher then knows that work is on its way while the request is still
    being read, parsed and looked up in the cache, and can fill the next batch
    with it instead of starting without it (see :mod:`elmo_api.batcher`). The ticket
    is retired when the request submits, or at the latest when it ends.
    """

    def __init__(self, app: ASGIApp, holder: Callable[[], object]) -> None:
        self.app = app
        self.holder = holder

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or scope.get("path") not in EMBED_PATHS
        ):
            await self.app(scope, receive, send)
            return
        served = getattr(self.holder(), "current", None)
        if served is None:
            await self.app(scope, receive, send)
            return
        ticket = served.runner.announce()
        scope[TICKET_KEY] = ticket
        try:
            await self.app(scope, receive, send)
        finally:
            ticket.retire()


class ModelVersionMiddleware:
    """``X-Model-Id`` / ``X-Model-Version`` on every answer computed by a model: the one
    the route resolved (``elmo_api.deps.serving`` leaves it in the scope), so a client behind
    a balancer can tell which version computed its vectors, across swaps and replicas."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_version(message: Any) -> None:
            served = scope.get(SERVED_KEY)
            if message["type"] == "http.response.start" and served is not None:
                headers = [
                    *message.get("headers", ()),
                    (b"x-model-id", served.name.encode("latin-1", "replace")),
                    (b"x-model-version", served.version.encode("latin-1", "replace")),
                ]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_version)


class TimingMiddleware:
    """``X-Total-Time``, ``X-Tokenization-Time``, ``X-Queue-Time``, ``X-Inference-Time``
    (milliseconds, TEI's names) on every answer that ran an embedding path.

    Every ``POST /v1/...`` gets an :class:`elmo_api.timing.RequestTiming` in its scope as it
    arrives (before its body is read: the total counts reading it); the embedding path
    (``elmo_api.routers.common.embed_request`` -> ``ServedModel.embed``) fills in the lane and
    the parts, and marks it used. The total is taken when the status line goes out (a
    streamed answer's body is sent after it). Successful answers' figures also feed
    ``elmo_request_phase_seconds{lane, phase}``.
    """

    def __init__(self, app: ASGIApp, metrics: Callable[[], Metrics | None]) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or not (scope.get("path", "").startswith("/v1/") or scope.get("path") in TEI_PATHS)
        ):
            await self.app(scope, receive, send)
            return
        timing = RequestTiming()
        scope[TIMING_KEY] = timing

        async def send_with_timing(message: Message) -> None:
            if message["type"] == "http.response.start" and timing.used:
                total = timing.total()
                message = {
                    **message,
                    "headers": [*message.get("headers", ()), *timing.headers(total)],
                }
                m = self.metrics()
                if m is not None and 200 <= message["status"] < 300:
                    for phase, seconds in timing.phases(total).items():
                        m.phase_seconds.labels(timing.lane, phase).observe(seconds)
            await send(message)

        await self.app(scope, receive, send_with_timing)
