"""uvicorn's HTTP protocol with read deadlines, and the uvicorn options built from Settings.

uvicorn closes idle kept-alive connections (``timeout_keep_alive``) but sets no
deadline on *reading a request*: a socket that connects and never sends, or
sends its headers a byte at a time (slowloris), holds a connection forever.
:class:`DeadlineHttpToolsProtocol` arms one timer per connection:

* from connecting (or from the first byte of a kept-alive connection's next
  request) until the request's headers are complete: ``header_timeout``; when
  it fires the client gets a ``408`` JSON error and the connection is closed;
* from the headers until the body is complete: ``body_timeout``; then the
  connection is closed (the app sees a disconnect and drops the request).

While the app works on a request no deadline runs (``ELMO_REQUEST_TIMEOUT``
bounds that), and after the response uvicorn's keep-alive timer takes over.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from api.encoding import dumps
from api.errors import error_body
from api.settings import Settings

log = logging.getLogger("api.http")

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - uvicorn[standard] installs httptools
    HttpToolsProtocol = None  # type: ignore[assignment,misc]


def _timeout_response(message: str) -> bytes:
    body = dumps(error_body("request_timeout", message, None))
    head = (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    return head + body


if HttpToolsProtocol is not None:

    class DeadlineHttpToolsProtocol(HttpToolsProtocol):  # type: ignore[misc,valid-type]
        header_timeout: float = 10.0
        body_timeout: float = 30.0

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._deadline: asyncio.TimerHandle | None = None

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
            self._arm(self.header_timeout, self._headers_late)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        # -- parser callbacks ------------------------------------------------
        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._deadline is None:  # a kept-alive connection's next request began
                self._arm(self.header_timeout, self._headers_late)

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._arm(self.body_timeout, self._body_late)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._disarm()

        # -- deadlines -------------------------------------------------------
        def _headers_late(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            self.transport.write(
                _timeout_response(f"request headers not received within {self.header_timeout:g}s")
            )
            self.transport.close()

        def _body_late(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            if self.cycle is None or not self.cycle.response_started:
                self.transport.write(
                    _timeout_response(f"request body not received within {self.body_timeout:g}s")
                )
            self.transport.close()

else:  # pragma: no cover
    DeadlineHttpToolsProtocol = None  # type: ignore[assignment,misc]


def deadline_protocol(header_timeout: float, body_timeout: float) -> type | str:
    """The protocol class with these deadlines (``"h11"`` without httptools: no deadlines)."""
    if DeadlineHttpToolsProtocol is None:  # pragma: no cover
        log.warning("httptools is not installed: no header/body read timeouts")
        return "h11"
    return type(
        "DeadlineHttpToolsProtocol",
        (DeadlineHttpToolsProtocol,),
        {"header_timeout": header_timeout, "body_timeout": body_timeout},
    )


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """Connection limits and timeouts for ``uvicorn.run`` / ``uvicorn.Config``."""
    return {
        "http": deadline_protocol(settings.http_header_timeout, settings.http_body_timeout),
        "timeout_keep_alive": settings.http_keepalive_timeout,
        "limit_concurrency": settings.http_max_connections,
    }
