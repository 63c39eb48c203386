"""A fake Redis: a real process on loopback that speaks RESP and answers well-formed nonsense.

It stands for a misbehaving proxy or a "Redis-compatible" server: every reply parses
as RESP, but its type or length is not what the command asks for. The handshake
(``HELLO``, ``CLIENT``, ``SELECT``) is answered as Redis would, so the nonsense
reaches the data commands. Modes:

* ``ok``: ``+OK`` to everything (``PING`` included);
* ``int``: ``:1`` to everything;
* ``short``: arrays one element short (``MGET`` of n keys -> n-1 nils, ``HGETALL``
  -> three elements), ``GET``/``HGET`` -> an array, everything else ``+OK``;
* ``types``: ``PING`` -> ``+PONG`` (it looks healthy), then a wrong type for every
  data command: ``MGET`` -> an integer, ``GET``/``HGET`` -> an array, ``HGETALL`` ->
  a bulk string, ``SET``/``DEL``/``HSET``/``HDEL``/``EXISTS`` -> a bulk string, the rest ``:7``.

``FAKE.MODE <mode>`` switches the mode at run time (answered ``+OK``), so one
process can play each part in turn. ``FakeRedis`` runs it as a subprocess with a
``url``, ``start()``, ``stop()`` and ``set_mode()``, like
:class:`tests.support.redis_server.RedisServer`; ``fake_redis`` is a pytest fixture
(a factory: ``fake_redis("types")``) that tests import.

    python -m tests.support.fake_redis --port 6390 --mode types
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from tests.support.ports import free_port
from tests.support.procs import terminate

MODES = ("ok", "int", "short", "types")


def bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


def array(items: list[bytes]) -> bytes:
    return b"*%d\r\n" % len(items) + b"".join(items)


def reply(mode: str, command: list[bytes], proto: int = 2) -> bytes:
    """The nonsense answer to one command in ``mode`` (``proto``: the RESP version in use)."""
    nil = b"_\r\n" if proto == 3 else b"$-1\r\n"
    name = command[0].upper() if command else b""
    n_args = len(command) - 1
    if name in (b"CLIENT", b"SELECT", b"READONLY"):
        return b"+OK\r\n"
    if name == b"HELLO":  # the protocol the client asks for (redis-py asks for RESP3)
        proto = int(command[1]) if n_args else 2
        if proto == 2:
            return array([bulk(b"server"), bulk(b"fake"), bulk(b"proto"), b":2\r\n"])
        return b"%2\r\n" + bulk(b"server") + bulk(b"fake") + bulk(b"proto") + b":3\r\n"
    if name == b"QUIT":
        return b"+OK\r\n"
    if mode == "ok":
        return b"+OK\r\n"
    if mode == "int":
        return b":1\r\n"
    if mode == "short":
        if name == b"MGET":
            return array([nil] * max(0, n_args - 1))
        if name == b"HGETALL":
            return array([bulk(b"k"), bulk(b"{}"), bulk(b"dangling")])
        if name in (b"GET", b"HGET"):
            return array([bulk(b"x")])
        return b"+OK\r\n"
    # types
    if name == b"PING":
        return b"+PONG\r\n"
    if name == b"MGET":
        return b":%d\r\n" % n_args
    if name in (b"GET", b"HGET"):
        return array([bulk(b"x"), bulk(b"y")])
    if name == b"HGETALL":
        return bulk(b"not a hash")
    if name in (b"SET", b"DEL", b"HSET", b"HDEL", b"EXISTS", b"HSETNX", b"EXPIRE"):
        return bulk(b"QUEUED")
    return b":7\r\n"


class _Conn:
    """RESP arrays of bulk strings (what clients send), and inline commands (``PING\\r\\n``)."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader

    async def command(self) -> list[bytes] | None:
        line = await self.reader.readline()
        if not line:
            return None
        if not line.startswith(b"*"):
            return line.strip().split()
        out = []
        for _ in range(int(line[1:])):
            head = await self.reader.readline()  # $<len>
            data = await self.reader.readexactly(int(head[1:]) + 2)
            out.append(data[:-2])
        return out


async def serve(port: int, mode: str) -> None:
    state = {"mode": mode}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = _Conn(reader)
        proto = 2
        try:
            while (cmd := await conn.command()) is not None:
                name = cmd[0].upper() if cmd else b""
                if name == b"FAKE.MODE" and len(cmd) == 2:
                    state["mode"] = cmd[1].decode()
                    writer.write(b"+OK\r\n")
                    continue
                if name == b"HELLO" and len(cmd) > 1:
                    proto = int(cmd[1])
                writer.write(reply(state["mode"], cmd, proto))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


class FakeRedis:
    """The fake as a subprocess on 127.0.0.1:<port>."""

    def __init__(self, mode: str = "types", port: int | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.mode = mode
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _send(self, payload: bytes) -> bytes:
        with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
            s.sendall(payload)
            return s.recv(64)

    def start(self, timeout: float = 15.0) -> FakeRedis:
        root = str(Path(__file__).resolve().parents[2])
        cmd = [sys.executable, "-m", "tests.support.fake_redis", "--port", str(self.port),
               "--mode", self.mode]  # fmt: skip
        self.proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the fake redis exited with {self.proc.returncode}")
            try:
                self._send(b"CLIENT SETNAME probe\r\n")
                return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the fake redis did not answer on port {self.port}")

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        assert self._send(array([bulk(b"FAKE.MODE"), bulk(mode.encode())])) == b"+OK\r\n"
        self.mode = mode

    def stop(self) -> None:
        terminate(self.proc)
        self.proc = None

    def __enter__(self) -> FakeRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


try:
    import pytest
except ImportError:  # pragma: no cover - bench scripts run without pytest
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    @pytest.fixture
    def fake_redis() -> Iterator[Callable[[str], FakeRedis]]:
        """``fake_redis("short")``: a started fake in that mode, stopped after the test."""
        started: list[FakeRedis] = []

        def make(mode: str = "types") -> FakeRedis:
            started.append(FakeRedis(mode).start())
            return started[-1]

        try:
            yield make
        finally:
            for f in started:
                f.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description="A fake Redis that answers well-formed nonsense.")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--mode", choices=MODES, default="types")
    args = ap.parse_args()
    asyncio.run(serve(args.port, args.mode))


if __name__ == "__main__":
    main()
