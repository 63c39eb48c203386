"""Fixtures any test may share: a tiny model artifact and a real redis-server.

* ``tiny_model_dir``: a small random biLM (``small_test_config``, word
  tokenizer) saved as an artifact, with one shipped task ``shipped``. Built
  once per session; treat it as read-only.
* ``redis_server``: a real ``redis-server`` on a free loopback port (no
  persistence), one per session; ``redis_server_factory()`` starts extra,
  isolated ones (for tests that stop and restart Redis). A missing
  ``redis-server`` binary FAILS the tests that need it (install:
  ``apt-get install -y redis-server``): it never skips them.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server process on 127.0.0.1:<port>; stop() and start() keep the port."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.fail(
                "redis-server is not installed: the Redis tests need a real server "
                "(apt-get update && apt-get install -y redis-server)",
                pytrace=False,
            )
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
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
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


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator[Callable[[], RedisServer]]:
    started: list[RedisServer] = []

    def make() -> RedisServer:
        server = RedisServer(tmp_path / f"redis{len(started)}").start()
        started.append(server)
        return server

    try:
        yield make
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight artifact (3 output layers x 16 dims, word tokenizer, task ``shipped``)."""
    import torch

    from elmo_service.artifact import save_artifact
    from elmo_service.model import BiLM
    from elmo_service.scalar_mix import MixSpec
    from elmo_service.tokenizers import WordTokenizer
    from tests.support.configs import small_test_config

    torch.manual_seed(1234)
    model = BiLM(small_test_config()).eval()
    path = tmp_path_factory.mktemp("models") / "tiny"
    save_artifact(
        model,
        WordTokenizer(),
        path,
        provenance={"source": "tests/conftest.py", "weights": "random"},
        tasks={"shipped": MixSpec(weights=[0.5, 1.0, -0.5], gamma=0.7)},
    )
    return path
