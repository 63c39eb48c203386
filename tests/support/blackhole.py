"""A "black hole" server: a real process that accepts TCP connections and never answers
(a Redis that hangs: a stuck proxy, a stopped VM). For the tests and ``bench/chaos.py``."""

from __future__ import annotations

import subprocess
import sys
import time

from tests.support.ports import free_port

_SERVE = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen(1024)
held = []
while True:
    conn, _ = s.accept()
    held.append(conn)  # never read, never answered, never closed
"""


class BlackHole:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def __enter__(self) -> BlackHole:
        import socket

        self.proc = subprocess.Popen([sys.executable, "-c", _SERVE, str(self.port)])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.02)
        self.__exit__()
        raise RuntimeError("black-hole server did not start")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
