"""A real ``redis-server`` on loopback, for the tests (``conftest.py``) and ``bench/``.

No persistence, protected mode, one port per server; ``stop()`` then ``start()``
keeps the port, so a client sees an outage and a recovery. Needs no pytest: the
fixtures turn :class:`RedisMissing` into a test failure, bench scripts into an exit.
"""

from __future__ import annotations

import shutil
import signal
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

    def __init__(self, workdir: Path, port: int | None = None, password: str | None = None) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RedisMissing(f"redis-server is not installed ({INSTALL_HINT})")
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.password = password  # --requirepass: clients need it
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The URL without the password (give it as ELMO_REDIS_PASSWORD, or see auth_url)."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def auth_url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0" if self.password else self.url

    def start(self, timeout: float = 10.0) -> RedisServer:
        if self.proc is not None and self.proc.poll() is None:
            return self
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(self.workdir), "--daemonize", "no", "--protected-mode", "yes",
               "--loglevel", "warning"]  # fmt: skip
        if self.password:
            cmd += ["--requirepass", self.password]
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
                auth = f"AUTH {self.password}\r\n".encode() if self.password else b""
                s.sendall(auth + b"PING\r\n")
                reply = b""
                while reply.count(b"\r\n") < (2 if auth else 1):
                    chunk = s.recv(64)
                    if not chunk:
                        break
                    reply += chunk
                return reply.endswith(b"+PONG\r\n")
        except OSError:
            return False

    def stop(self) -> None:
        terminate(self.proc)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: no shutdown save; ``start()`` then loads the last ``SAVE`` from the dir."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: connections open, no answers (a stalled Redis) until :meth:`resume`."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def client(self):
        import redis

        return redis.Redis.from_url(self.auth_url)

    def flushall(self) -> None:
        c = self.client()
        try:
            c.flushall()
        finally:
            c.close()
