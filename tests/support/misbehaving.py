"""A tiny threaded HTTP server that answers as a test scripts it, misbehaviour included.

``with Scripted(handler) as srv:`` serves on 127.0.0.1 and a free port; ``handler(req)``
gets a :class:`Request` (method, path, headers, JSON body, and how many requests came
before it) and returns what to do:

* ``Answer(status, body, headers)``: a normal answer (``body``: bytes, or JSON);
* ``Drop()``: close the connection without a byte of answer (a dropped connection);
* ``Garbage()``: answer bytes that are not HTTP (a remote protocol error);
* ``Drip(every, total)``: a 200 whose body arrives one byte every ``every`` seconds;
* ``Stream(lines, cut)``: an ``application/x-ndjson`` answer written line by line (``cut``:
  close the connection after those lines, no end of the chunked body).

``srv.requests`` lists every request received (the retry tests count them).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.support.ports import free_port


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    n: int  # requests before this one


@dataclass
class Answer:
    status: int = 200
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Drop:
    pass


@dataclass
class Garbage:
    pass


@dataclass
class Drip:
    every: float
    total: int = 100


@dataclass
class Stream:
    lines: list[Any]
    cut: bool = False


class Scripted:
    def __init__(self, handler: Callable[[Request], Any]) -> None:
        self.handler = handler
        self.requests: list[Request] = []
        self.port = free_port()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                n = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(n) if n else b""
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = raw
                with outer._lock:
                    req = Request(self.command, self.path, dict(self.headers), body,
                                  len(outer.requests))  # fmt: skip
                    outer.requests.append(req)
                outer._act(self, outer.handler(req))

            do_GET = do_POST = do_PUT = do_DELETE = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _act(self, h: BaseHTTPRequestHandler, what: Any) -> None:
        if isinstance(what, Drop):
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        if isinstance(what, Garbage):
            h.wfile.write(b"NOT HTTP AT ALL\r\n\r\n")
            h.close_connection = True
            return
        if isinstance(what, Drip):
            h.send_response(200)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(what.total))
            h.end_headers()
            for _ in range(what.total):
                if self._stop.wait(what.every):
                    break
                try:
                    h.wfile.write(b" ")
                    h.wfile.flush()
                except OSError:  # the client gave up: what the test wants
                    break
            h.close_connection = True
            return
        if isinstance(what, Stream):
            h.send_response(200)
            h.send_header("Content-Type", "application/x-ndjson")
            h.send_header("Transfer-Encoding", "chunked")
            h.end_headers()
            for line in what.lines:
                data = line if isinstance(line, bytes) else json.dumps(line).encode()
                data += b"\n"
                h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                h.wfile.flush()
            if what.cut:
                h.close_connection = True
                h.connection.shutdown(socket.SHUT_RDWR)
                return
            h.wfile.write(b"0\r\n\r\n")
            return
        a = what if isinstance(what, Answer) else Answer(body=what)
        content = a.body if isinstance(a.body, bytes) else json.dumps(a.body).encode()
        h.send_response(a.status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(content)))
        for k, v in a.headers.items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(content)

    def __enter__(self) -> Scripted:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise TimeoutError("condition not met")
        time.sleep(0.02)
