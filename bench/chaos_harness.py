"""The chaos suite's harness: result rows and their table, the processes a run starts, the
reference vectors, and the load clients that check every 200 (``bench/chaos.py`` and
``bench/chaos_fleet.py`` share it)."""

from __future__ import annotations

import asyncio
import base64
import os
import random
import signal
import subprocess
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

REPO = Path(__file__).resolve().parent.parent

ADMIN = {"authorization": "Bearer chaos-admin"}
PREFIX = "chaos"
CLIENTS = 8
TOL = 1e-4  # max |served - reference|, relative to max(1, max |reference|)


# ---------------------------------------------------------------- results


@dataclass
class Row:
    attack: str
    requests: int = 0
    status: Counter = field(default_factory=Counter)  # "2xx" "4xx" "429" "5xx" "err"
    wrong: int = 0
    lost_steps: int | None = None
    failures: list[str] = field(default_factory=list)  # expectations that did not hold
    notes: list[str] = field(default_factory=list)
    depends_on: str = ""  # the fix this row needs when it is not on this branch
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        bad = self.status["5xx"] + self.status["err"] + self.wrong + (self.lost_steps or 0)
        return bad == 0 and not self.failures

    def count(self, code: int | None) -> None:
        self.requests += 1
        if code is None:
            self.status["err"] += 1
        elif code == 429:
            self.status["429"] += 1
        elif code >= 500:
            self.status["5xx"] += 1
        elif code >= 400:
            self.status["4xx"] += 1
        else:
            self.status["2xx"] += 1


def table(rows: list[Row]) -> str:
    head = "| attack | requests | 2xx | 4xx | 429 | 5xx | err | wrong vectors | lost steps | verdict | notes |"
    out = [head, "|" + "---|" * 11]
    for r in rows:
        s = r.status
        lost = "" if r.lost_steps is None else str(r.lost_steps)
        verdict = "ok" if r.ok else "FAIL"
        notes = "; ".join(r.failures + r.notes)
        if not r.ok and r.depends_on:
            notes += f" [needs: {r.depends_on}]"
        out.append(
            f"| {r.attack} | {r.requests} | {s['2xx']} | {s['4xx']} | {s['429']} | {s['5xx']} "
            f"| {s['err']} | {r.wrong} | {lost} | {verdict} | {notes} |"
        )
    return "\n".join(out)


# ---------------------------------------------------------------- processes


class Procs:
    """Every process this run starts; all stopped at the end (by pid, never by name)."""

    def __init__(self, root: Path) -> None:
        self.root, self.procs = root, []

    def start(self, name: str, cmd: list[str], env: dict[str, str], **kw: Any) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115 - the process owns it
        p = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=kw.pop("stderr", subprocess.STDOUT), **kw
        )
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen, sig: int = signal.SIGTERM, wait: float = 20) -> None:
        if p.poll() is None:
            p.send_signal(sig)
            try:
                p.wait(wait)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            self.stop(p)


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELMO_") and k != "REDIS_URL"}
    # this checkout's code in every child, whatever the venv's editable install points at
    env["PYTHONPATH"] = str(REPO) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 180) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    return False


class References:
    """Per (model version, sentence): the layers ``Embedder`` computes in this process."""

    def __init__(self, paths: list[Path]) -> None:
        from elmo_service.embedder import Embedder

        self.emb = {}
        for p in paths:
            e = Embedder.load(p, threads=1)
            self.emb[e.version] = e
        self.cache: dict[tuple[str, str], np.ndarray] = {}

    def precompute(self, sentences: list[str]) -> None:
        for v, e in self.emb.items():
            for s, out in zip(sentences, e.embed(sentences), strict=True):
                self.cache[(v, s)] = out.layers

    def get(self, version: str, s: str) -> np.ndarray | None:
        if version not in self.emb:
            return None
        if (version, s) not in self.cache:
            self.cache[(version, s)] = self.emb[version].embed([s])[0].layers
        return self.cache[(version, s)]


def is_wrong(got: np.ndarray, ref: np.ndarray | None) -> bool:
    if ref is None or got.shape != ref.shape or not np.isfinite(got).all():
        return True
    return float(np.abs(got - ref).max()) > TOL * max(1.0, float(np.abs(ref).max()))


# ---------------------------------------------------------------- the load


class Load:
    """Clients posting /v1/embed (layers, base64 float32) and checking every 200."""

    def __init__(self, port: int, refs: References, pool: list[str]) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.refs, self.pool = refs, pool
        self.samples: list[tuple[str, str, np.ndarray]] = []  # checked after (flood)

    async def request(
        self, client: httpx.AsyncClient, row: Row, sents: list[str], check_all: bool = True
    ) -> None:
        body = {"sentences": sents, "output": "layers", "encoding": "base64"}
        try:
            r = await client.post(f"{self.url}/v1/embed", json=body)
        except httpx.HTTPError as e:
            row.count(None)
            if len(row.notes) < 3:
                row.notes.append(f"transport: {type(e).__name__}")
            return
        row.count(r.status_code)
        no_retry = r.status_code == 429 and "retry-after" not in r.headers  # case-insensitive
        if no_retry and "429 without Retry-After" not in row.failures:
            row.failures.append("429 without Retry-After")
        if r.status_code != 200:
            return
        out = r.json()
        version = out["model"]["version"]
        data = out.get("data") or []
        if len(data) != len(sents):
            row.wrong += len(sents)
            return
        for item in data:
            s = sents[item["index"]]
            lay = item["layers"]
            try:
                got = np.frombuffer(base64.b64decode(lay["data"]), dtype="<f4").reshape(
                    lay["shape"]
                )
            except (ValueError, KeyError, TypeError):
                row.wrong += 1
                continue
            if check_all:
                row.wrong += is_wrong(got, self.refs.get(version, s))
            elif len(self.samples) < 200 and random.random() < 0.02:
                self.samples.append((version, s, got.copy()))

    async def clients(self, row: Row, seconds: float, n: int = CLIENTS, per: int = 4) -> None:
        stop = time.monotonic() + seconds
        rng = random.Random(zlib.crc32(row.attack.encode()))

        async def one(client: httpx.AsyncClient) -> None:
            while time.monotonic() < stop:
                await self.request(client, row, rng.sample(self.pool, per))

        async with httpx.AsyncClient(timeout=60) as client:
            await asyncio.gather(*(one(client) for _ in range(n)))

    def check_samples(self, row: Row) -> None:
        for version, s, got in self.samples:
            row.wrong += is_wrong(got, self.refs.get(version, s))
        row.notes.append(f"{len(self.samples)} sampled sentences checked")
        self.samples.clear()

    async def drain(self, timeout: float = 180) -> float:
        """Until a one-sentence request is answered quickly again (the queue emptied)."""
        t0 = time.monotonic()
        async with httpx.AsyncClient(timeout=60) as client:
            while time.monotonic() - t0 < timeout:
                t = time.monotonic()
                try:
                    r = await client.post(
                        f"{self.url}/v1/embed", json={"sentences": ["drain probe ."]}
                    )
                    if r.status_code == 200 and time.monotonic() - t < 1.0:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)
        return time.monotonic() - t0
