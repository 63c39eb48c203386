"""A real ``redis-server`` on loopback, for the tests (``conftest.py``) and ``bench/``.

No persistence, protected mode, one port per server; ``stop()`` then ``start()``
keeps the port, so a client sees an outage and a recovery. Needs no pytest: the
fixtures turn :class:`RedisMissing` into a test failure, bench scripts into an exit.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from tests.support.ports import free_port
from tests.support.procs import terminate

INSTALL_HINT = "apt-get update && apt-get install -y redis-server"


class RedisMissing(RuntimeError):
    """No ``redis-server`` binary on PATH."""


class RedisServer:
    """A redis-server process on 127.0.0.1:<port>; stop() and start() keep the port."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RedisMissing(f"redis-server is not installed ({INSTALL_HINT})")
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        if self.proc is not None and self.proc.poll() is None:
            return self
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(self.workdir), "--daemonize", "no", "--protected-mode", "yes",
               "--loglevel", "warning"]  # fmt: skip
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: see {self.workdir / 'redis.log'}")
            if self.ping():
                return self
            time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout}s")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        terminate(self.proc)
        self.proc = None

    def client(self):
        import redis

        return redis.Redis.from_url(self.url)

    def flushall(self) -> None:
        c = self.client()
        try:
            c.flushall()
        finally:
            c.close()
