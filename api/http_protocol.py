"""uvicorn's HTTP protocol with read deadlines, and the uvicorn options built from Settings.

uvicorn closes idle kept-alive connections (``timeout_keep_alive``) but sets no
deadline on *reading a request*: a socket that connects and never sends, or
sends its headers a byte at a time (slowloris), holds a connection forever.
:class:`DeadlineHttpToolsProtocol` arms one timer per connection:

* from connecting until the first byte: ``first_byte_timeout`` (short: a socket
  that sends nothing is closed soon, with a ``408``);
* from connecting (or from the first byte of a kept-alive connection's next
  request) until the request's headers are complete: ``header_timeout``; when
  it fires the client gets a ``408`` JSON error and the connection is closed;
* from the headers until the body is complete: ``body_timeout``; then the
  connection is closed (the app sees a disconnect and drops the request).

While the app works on a request no deadline runs (``ELMO_REQUEST_TIMEOUT``
bounds that), and after the response uvicorn's keep-alive timer takes over.

Two more guards, for what the server sends and for floods:

* a send deadline (``send_timeout``): when the client stops reading and the
  response backs up past the transport's high-water mark, a timer starts; if the
  client has read nothing of it when it fires, the connection is aborted and the
  buffered answer freed (like nginx's ``send_timeout``: a deadline between two
  reads, not on the whole answer, so a slow reader that keeps reading is never cut);
* the connection limit (``max_connections``, in place of uvicorn's
  ``limit_concurrency``): beyond it a request is answered 503 in the JSON error
  shape, except the health routes (``/healthz``, ``/readyz``, ``/metrics``), which
  always answer, so a liveness probe does not restart a pod that is only flooded.
  It counts *busy* connections (a request whose headers are in, not yet answered) and
  requests in progress, never idle ones nor ones still sending their headers: sockets
  that send nothing, or drip header bytes, cannot lock other clients out (they only
  wait for ``first_byte_timeout`` / ``header_timeout``).
"""

from __future__ import annotations

import asyncio
import logging
import struct
from typing import Any

try:
    import fcntl
    import termios

    _SIOCOUTQ: int | None = termios.TIOCOUTQ  # same value as SIOCOUTQ on Linux
except (ImportError, AttributeError):  # pragma: no cover - not Linux
    _SIOCOUTQ = None

from elmo_api.encoding import dumps
from elmo_api.errors import error_body
from elmo_api.settings import Settings

log = logging.getLogger("api.http")

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - uvicorn[standard] installs httptools
    HttpToolsProtocol = None  # type: ignore[assignment,misc]


# answered whatever the connection count: probes must see a flooded server as alive
EXEMPT_PATHS = frozenset({b"/healthz", b"/readyz", b"/metrics"})


def _error_response(status: bytes, code: str, message: str, extra: bytes = b"") -> bytes:
    body = dumps(error_body(code, message, None))
    head = (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n" + extra
        + b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
    )  # fmt: skip
    return head + body


def _timeout_response(message: str) -> bytes:
    return _error_response(b"408 Request Timeout", "request_timeout", message)


def overloaded_app(limit: int) -> Any:
    """The ASGI app that answers a request beyond the connection limit: JSON 503."""
    body = dumps(
        error_body(
            "overloaded",
            f"the server has {limit} open connections, its limit (ELMO_HTTP_MAX_CONNECTIONS); "
            "retry shortly",
            None,
        )
    )
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"),
        (b"connection", b"close"),
    ]

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


def _kernel_send_queue(transport: asyncio.Transport) -> int:
    """Bytes in the socket's kernel send queue (Linux ``SIOCOUTQ``); 0 where unknown."""
    sock = transport.get_extra_info("socket")
    if sock is None or _SIOCOUTQ is None:
        return 0
    try:
        buf = fcntl.ioctl(sock.fileno(), _SIOCOUTQ, b"\0\0\0\0")
    except OSError:
        return 0
    return struct.unpack("i", buf)[0]


if HttpToolsProtocol is not None:

    class DeadlineHttpToolsProtocol(HttpToolsProtocol):  # type: ignore[misc,valid-type]
        first_byte_timeout: float = 2.0
        header_timeout: float = 10.0
        body_timeout: float = 30.0
        send_timeout: float = 30.0
        max_connections: int | None = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._deadline: asyncio.TimerHandle | None = None
            self._send_deadline: asyncio.TimerHandle | None = None
            self._send_left = 0  # bytes buffered when the send deadline was armed
            self._busy = False  # a request begun and not yet answered: counts for the limit
            self._connected_at = 0.0
            self._first_byte = True  # nothing received yet on this connection
            # uvicorn's limit becomes ours (see on_headers_complete): under the plain
            # uvicorn CLI, --limit-concurrency then also exempts the health routes
            if self.max_connections is None:
                self.max_connections = self.limit_concurrency
            self.limit_concurrency = None
            self._overloaded = (
                overloaded_app(self.max_connections) if self.max_connections else None
            )

        def _arm(self, seconds: float, handler: Any) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, handler)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        # -- connection ----------------------------------------------------
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._connected_at = self.loop.time()
            if self.first_byte_timeout < self.header_timeout:
                self._arm(self.first_byte_timeout, self._first_byte_late)
            else:
                self._arm(self.header_timeout, self._headers_late)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._disarm_send()
            super().connection_lost(exc)

        # -- the send deadline -------------------------------------------------
        def pause_writing(self) -> None:  # the transport's buffer is above its high-water mark
            super().pause_writing()
            self._arm_send()

        def resume_writing(self) -> None:  # the client drained it
            super().resume_writing()
            self._disarm_send()

        def _unsent(self) -> int:
            """Bytes not yet taken by the client: the transport's buffer and the kernel's
            send queue (which only empties as the client reads)."""
            return self.transport.get_write_buffer_size() + _kernel_send_queue(self.transport)

        def _arm_send(self) -> None:
            self._disarm_send()
            self._send_left = self._unsent()
            self._send_deadline = self.loop.call_later(self.send_timeout, self._send_late)

        def _disarm_send(self) -> None:
            if self._send_deadline is not None:
                self._send_deadline.cancel()
                self._send_deadline = None

        def _send_late(self) -> None:
            """No drain for ``send_timeout``: abort, unless the client read something
            meanwhile (while paused nothing is added, so a smaller buffer is progress)."""
            self._send_deadline = None
            if self.transport.is_closing():
                return
            left = self._unsent()
            if left < self._send_left:
                self._arm_send()
                return
            log.warning(
                "closing %s: it read nothing of its response for %gs (%d bytes buffered)",
                self.client, self.send_timeout, left,
            )  # fmt: skip
            self.transport.abort()  # drops the buffer; the app sees a disconnect

        def send_400_response(self, msg: str) -> None:  # unparsable HTTP: JSON, as everywhere
            self.transport.write(_error_response(b"400 Bad Request", "invalid_http", msg))
            self.transport.close()

        # -- parser callbacks ------------------------------------------------
        def on_message_begin(self) -> None:
            super().on_message_begin()
            # not busy yet: a socket dripping its headers a byte at a time counts for
            # nothing until they are complete (#50: 1,100 such sockets locked embeds out)
            if self._first_byte:  # the headers' deadline still counts from connecting
                self._first_byte = False
                spent = self.loop.time() - self._connected_at
                self._arm(max(0.0, self.header_timeout - spent), self._headers_late)
            elif self._deadline is None:  # a kept-alive connection's next request began
                self._arm(self.header_timeout, self._headers_late)

        def on_response_complete(self) -> None:
            self._busy = bool(self.pipeline)  # a pipelined request starts next
            super().on_response_complete()

        def _busy_connections(self) -> int:
            return sum(1 for c in self.connections if getattr(c, "_busy", True))

        def on_headers_complete(self) -> None:
            self._busy = True  # a request in: counts until answered (this one included)
            limit, app = self.max_connections, self.app
            over = limit is not None and (
                len(self.tasks) >= limit or self._busy_connections() >= limit
            )
            if over and self.url.split(b"?", 1)[0] not in EXEMPT_PATHS:
                self.app = self._overloaded  # this request only
            try:
                super().on_headers_complete()
            finally:
                self.app = app
            self._arm(self.body_timeout, self._body_late)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._disarm()

        # -- deadlines -------------------------------------------------------
        def _first_byte_late(self) -> None:
            self._late(f"no request received within {self.first_byte_timeout:g}s")

        def _headers_late(self) -> None:
            self._late(f"request headers not received within {self.header_timeout:g}s")

        def _body_late(self) -> None:
            self._late(
                f"request body not received within {self.body_timeout:g}s",
                answer=self.cycle is None or not self.cycle.response_started,
            )

        def _late(self, message: str, answer: bool = True) -> None:
            """A deadline passed: a 408 saying which (unless an answer has begun), then close."""
            self._deadline = None
            if self.transport.is_closing():
                return
            if answer:
                self.transport.write(_timeout_response(message))
            self.transport.close()

else:  # pragma: no cover
    DeadlineHttpToolsProtocol = None  # type: ignore[assignment,misc]


def deadline_protocol(
    header_timeout: float,
    body_timeout: float,
    send_timeout: float = 30.0,
    max_connections: int | None = None,
    first_byte_timeout: float = 2.0,
) -> type | str:
    """The protocol class with these deadlines and connection limit (``"h11"`` without
    httptools: no deadlines)."""
    if DeadlineHttpToolsProtocol is None:  # pragma: no cover
        log.warning("httptools is not installed: no header/body/send timeouts")
        return "h11"
    return type(
        "DeadlineHttpToolsProtocol",
        (DeadlineHttpToolsProtocol,),
        {"header_timeout": header_timeout, "body_timeout": body_timeout,
         "send_timeout": send_timeout, "max_connections": max_connections,
         "first_byte_timeout": first_byte_timeout},
    )  # fmt: skip


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """Connection limits and timeouts for ``uvicorn.run`` / ``uvicorn.Config``."""
    http = deadline_protocol(
        settings.http_header_timeout,
        settings.http_body_timeout,
        settings.http_send_timeout,
        settings.http_max_connections,
        settings.http_first_byte_timeout,
    )
    return {
        "http": http,
        "timeout_keep_alive": settings.http_keepalive_timeout,
        # without httptools, uvicorn's own limit (plain-text 503s, health routes included)
        "limit_concurrency": None if http != "h11" else settings.http_max_connections,
    }
