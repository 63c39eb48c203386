"""The chaos suite's fleet attacks: two replicas (``elmo-service serve``) on a Redis of their
own that keeps a snapshot folder, under load, every 200 checked (``bench/chaos.py`` runs them):

  stale-snapshot    redis SAVE; activate B; redis SIGKILLed, restarted from the snapshot
                    (A): no replica may go back to A, the record and its generation return
  stalled-record    activate while redis is SIGSTOPped (50 ms after the call, SIGCONT 2 s
                    later), 5 times: each answer must be true (200 only when recorded, "not
                    recorded" only when not); a retry is a no-op
  unreadable-state  a third replica on a fake Redis answering nonsense, and a replica
                    SIGSTOPped: no view may say agree while it cannot see; stale is reported
  replica-kill-lb   load through the shipped HAProxy config (docker/haproxy/haproxy.cfg,
                    rendered for loopback as tests/deploy/test_haproxy.py does); one replica
                    SIGKILLed: no request cut without an answer, every 5xx in haproxy's log
                    (``CHAOS_HAPROXY_CFG=path``: try a candidate config instead)
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.chaos_harness import ADMIN, REPO, Load, Row, wait_ready
from tests.support.ports import free_port
from tests.support.redis_server import RedisServer

FLEET_PREFIX = "chaos-fleet"
INTERVAL, TTL = 0.5, 3.0  # ELMO_FLEET_INTERVAL / ELMO_FLEET_TTL of these replicas


@dataclass
class Replica:
    name: str
    port: int
    proc: subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Fleet:
    """Two replicas on their own redis-server (its folder keeps ``SAVE``'s snapshot)."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.redis = RedisServer(ctx.root / "fleet-redis").start()
        self.replicas = [self.start(f"r{i}") for i in (1, 2)]
        for r in self.replicas:
            if not wait_ready(r.port, r.proc, timeout=300):
                raise RuntimeError(f"fleet replica {r.name} not ready: see {r.name}.log")

    def env(self, name: str, redis_url: str | None = None) -> dict[str, str]:
        return {
            **self.ctx.serve_env, "REDIS_URL": redis_url or self.redis.url,
            "ELMO_REDIS_PREFIX": FLEET_PREFIX, "ELMO_REPLICA_ID": name, "ELMO_THREADS": "1",
            "ELMO_FLEET_INTERVAL": str(INTERVAL), "ELMO_FLEET_TTL": str(TTL),
        }  # fmt: skip

    def start(self, name: str, redis_url: str | None = None) -> Replica:
        port = free_port()
        cmd = [sys.executable, "-m", "elmo_cli.main", "serve", "--port", str(port)]
        return Replica(name, port, self.ctx.procs.start(name, cmd, self.env(name, redis_url)))

    def record(self) -> dict[str, Any] | None:
        c = self.redis.client()
        try:
            raw = c.get(f"{FLEET_PREFIX}:fleet:desired")
            return None if raw is None else json.loads(raw)
        finally:
            c.close()

    def close(self) -> None:
        if self.redis.proc is not None:
            self.redis.resume()  # a stalled one would not hear SIGTERM
        self.redis.stop()


def fleet_of(ctx: Any) -> Fleet:
    if getattr(ctx, "fleet", None) is None:
        ctx.fleet = Fleet(ctx)
        ctx.closers.append(ctx.fleet.close)
    return ctx.fleet


async def served(client: httpx.AsyncClient, r: Replica) -> str | None:
    try:
        return (await client.get(r.url + "/readyz", timeout=5)).json()["model"]["id"]
    except (httpx.HTTPError, KeyError, ValueError):
        return None


async def until(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await cond():
            return True
        await asyncio.sleep(0.2)
    return False


async def all_serve(client: httpx.AsyncClient, reps: list[Replica], name: str, timeout=90) -> bool:
    async def ok() -> bool:
        return all([await served(client, r) == name for r in reps])

    return await until(ok, timeout)


async def activate(client: httpx.AsyncClient, r: Replica, name: str) -> httpx.Response:
    return await client.post(f"{r.url}/v1/models/{name}/activate", headers=ADMIN, timeout=120)


def load_on(ctx: Any, r: Replica | int) -> Load:
    return Load(r if isinstance(r, int) else r.port, ctx.load.refs, ctx.pool)


# ---------------------------------------------------------------- the attacks


async def attack_stale_snapshot(ctx: Any, row: Row) -> None:
    f = fleet_of(ctx)
    async with httpx.AsyncClient(timeout=60) as c:
        for name in ("default", "swap-b"):
            r = await activate(c, f.replicas[0], name)
            if r.status_code != 200 or not await all_serve(c, f.replicas, name):
                row.failures.append(f"setup: activating {name}: {r.status_code}")
                return
            if name == "default":
                f.redis.client().save()  # the snapshot holds default
        gen = f.record()["generation"]
        seen: set[str | None] = set()

        async def fault() -> None:
            await asyncio.sleep(1)
            f.redis.kill()  # kill -9: restarted from the snapshot (default, an older generation)
            f.redis.start()
            t = time.monotonic()
            while time.monotonic() - t < 6:
                seen.update([await served(c, r) for r in f.replicas])
                await asyncio.sleep(0.2)

        loads = [load_on(ctx, r).clients(row, 8, n=3) for r in f.replicas]
        await asyncio.gather(fault(), *loads)
    rec = f.record()
    seen.discard(None)
    row.notes.append(
        f"redis SIGKILLed, restarted from a snapshot holding default: replicas served "
        f"{sorted(seen)}; record back to {rec and rec['name']} at generation "
        f"{rec and rec['generation']} (was {gen})"
    )
    if seen != {"swap-b"}:
        row.failures.append(f"a replica went back: served {sorted(seen)}")
    if not rec or (rec["name"], rec["generation"]) != ("swap-b", gen):
        row.failures.append(f"the record was not put back: {rec}")
    logs = "".join((ctx.root / f"{r.name}.log").read_text(errors="replace") for r in f.replicas)
    if "put back" not in logs:
        row.failures.append("no replica logged putting the record back")


async def attack_stalled_record(ctx: Any, row: Row) -> None:
    f = fleet_of(ctx)
    r1, r2 = f.replicas
    outcomes: list[str] = []
    async with httpx.AsyncClient(timeout=120) as c:

        async def tries() -> None:
            for i in range(5):
                name = ("default", "swap-b")[i % 2]
                call = asyncio.ensure_future(activate(c, r1, name))
                await asyncio.sleep(0.05)
                f.redis.pause()
                await asyncio.sleep(2.0)
                f.redis.resume()
                r = await call
                await asyncio.sleep(0.5)  # what the stalled Redis had pending has run
                rec = f.record() or {}
                code = r.json().get("code") if r.status_code != 200 else "recorded"
                row.requests += 1  # the activation: judged below, not as a 5xx
                outcomes.append(f"{r.status_code} {code}")
                if r.status_code == 200 and rec.get("name") != name:
                    row.failures.append(f"200 for {name}, the record is {rec.get('name')}")
                elif code == "fleet_unavailable" and rec.get("name") == name:
                    row.failures.append(f"503 'not recorded' for {name}, but it is recorded")
                elif r.status_code not in (200, 503):
                    row.failures.append(f"activate {name}: {r.status_code}")
                gen = rec.get("generation")
                again = await activate(c, r1, name)  # a retry: safe, a no-op once recorded
                row.count(again.status_code)
                after = f.record() or {}
                if again.status_code != 200 or after.get("name") != name:
                    row.failures.append(f"the retry of {name}: {again.status_code}, {after}")
                elif rec.get("name") == name and after.get("generation") != gen:
                    row.failures.append(f"the retry of {name} made a new generation")
                if not await all_serve(c, f.replicas, name, timeout=60):
                    row.failures.append(f"the replicas did not converge on {name}")

        await asyncio.gather(tries(), load_on(ctx, r2).clients(row, 30, n=2))
    counts = {o: outcomes.count(o) for o in sorted(set(outcomes))}
    row.notes.append(
        "activations during a 2 s SIGSTOP: "
        + ", ".join(f"{n} x {o}" for o, n in counts.items())
        + "; each retry 200, a no-op when recorded"
    )


async def _metric(c: httpx.AsyncClient, r: Replica, name: str) -> float | None:
    for line in (await c.get(r.url + "/metrics")).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


async def attack_unreadable_state(ctx: Any, row: Row) -> None:
    from tests.support.fake_redis import FakeRedis

    f = fleet_of(ctx)
    r1, r2 = f.replicas
    fake = FakeRedis("types").start()
    lost = f.start("r3-nonsense", fake.url)
    claims: list[str] = []
    try:
        if not wait_ready(lost.port, lost.proc, timeout=300):
            row.failures.append("the replica on the fake Redis did not become ready")
            return
        async with httpx.AsyncClient(timeout=60) as c:

            async def watch(r: Replica, seconds: float) -> list[dict]:
                views, t = [], time.monotonic()
                while time.monotonic() - t < seconds:
                    views.append((await c.get(r.url + "/v1/models")).json()["fleet"])
                    await asyncio.sleep(0.25)
                return views

            views, _ = await asyncio.gather(
                watch(lost, TTL + 2), load_on(ctx, lost).clients(row, TTL + 2, n=2)
            )
            claims += [f"{lost.name} agree" for v in views if v["agree"]]
            ready = await c.get(lost.url + "/readyz")
            stale = ready.json().get("fleet", {}).get("stale")
            metric = await _metric(c, lost, "elmo_fleet_stale")
            row.notes.append(
                f"{lost.name}: {len(views)} views, none agree; /readyz {ready.status_code} "
                f"stale={stale}; elmo_fleet_stale {metric}"
            )
            if not (views and views[-1]["stale"] and stale and metric == 1.0):
                row.failures.append(f"{lost.name} did not report stale: {views[-1:]}")
            # a peer SIGSTOPped (it cannot beat): the others cannot account for it
            r2.proc.send_signal(signal.SIGSTOP)
            try:
                views = await watch(r1, TTL + 2)
            finally:
                r2.proc.send_signal(signal.SIGCONT)
            late = [v for v in views if v["missing"]]
            claims += [f"{r1.name} agree with {r2.name} stopped" for v in late if v["agree"]]
            if not late or r2.name not in late[-1]["missing"]:
                row.failures.append(f"{r1.name} never listed the stopped {r2.name} missing")

            async def agree_again() -> bool:
                return (await c.get(r1.url + "/v1/models")).json()["fleet"]["agree"]

            if not await until(agree_again, 30):
                row.failures.append(f"{r1.name} did not agree again once {r2.name} resumed")
            row.notes.append(f"{r2.name} SIGSTOPped {TTL + 2:.0f} s: listed missing by {r1.name}")
    finally:
        ctx.procs.stop(lost.proc)
        fake.stop()
    if claims:
        row.failures.append(f"{len(claims)} views claimed agreement: {claims[0]}")


_HTTPLOG_STATUS = re.compile(r" \d+/\d+/-?\d+/-?\d+/\+?\d+ (\d{3}) ")


def _render_shipped_haproxy(lb_port: int, servers: dict[str, int]) -> str:
    """The shipped config (or ``$CHAOS_HAPROXY_CFG``: a candidate) rendered for loopback."""
    from tests.deploy.test_haproxy import HAPROXY_CFG, render

    path = Path(os.environ.get("CHAOS_HAPROXY_CFG") or HAPROXY_CFG)
    return render(path.read_text(), lb_port, servers)


async def attack_replica_kill_lb(ctx: Any, row: Row) -> None:
    f = fleet_of(ctx)
    haproxy = shutil.which("haproxy")
    if haproxy is None:
        row.failures.append("haproxy is not installed (apt-get install haproxy)")
        return
    lb_port = free_port()
    cfg = ctx.root / "haproxy.cfg"
    cfg.write_text(_render_shipped_haproxy(lb_port, {r.name: r.port for r in f.replicas}))
    log = ctx.root / "haproxy.log"
    lb = ctx.procs.start("haproxy", [haproxy, "-W", "-db", "-f", str(cfg)], {}, cwd=REPO)
    try:
        async with httpx.AsyncClient(timeout=10) as c:

            async def in_rotation() -> bool:  # every replica answered through the balancer
                seen = set()
                for _ in range(8):
                    try:
                        r = await c.post(
                            f"http://127.0.0.1:{lb_port}/v1/embed", json={"sentences": ["a ."]}
                        )
                    except httpx.HTTPError:
                        return False
                    seen.add(r.headers.get("x-elmo-replica"))
                return seen >= {r.name for r in f.replicas}

            if not await until(in_rotation, 60):
                row.failures.append("haproxy never put both replicas in rotation")
                return
        victim = f.replicas[1]
        probe = Row("lb")

        async def fault() -> None:
            await asyncio.sleep(3)
            victim.proc.kill()  # SIGKILL under load

        await asyncio.gather(load_on(ctx, lb_port).clients(probe, 10, n=6), fault())
    finally:
        ctx.procs.stop(lb)
    logged = [int(m.group(1)) for m in _HTTPLOG_STATUS.finditer(log.read_text(errors="replace"))]
    got5 = probe.status["5xx"]
    logged5 = sum(1 for s in logged if s >= 500)
    row.requests += probe.requests
    row.wrong += probe.wrong
    row.status.update({k: v for k, v in probe.status.items() if k != "5xx"})
    row.notes.append(
        f"{victim.name} SIGKILLed at 3 s behind the shipped haproxy.cfg: {probe.requests} "
        f"requests, {got5} x 5xx answered ({logged5} in haproxy's log), "
        f"{probe.status['err']} cut without an answer"
    )
    if got5 > logged5:
        row.failures.append(f"{got5 - logged5} 5xx answers not in haproxy's log")
    if probe.status["err"]:
        row.failures.append(f"{probe.status['err']} requests cut without an answer")


ATTACKS = {
    "stale-snapshot": (attack_stale_snapshot, "generations never go back"),
    "stalled-record": (attack_stalled_record, "activation reads its record back"),
    "unreadable-state": (attack_unreadable_state, "no view claims what it cannot see"),
    "replica-kill-lb": (attack_replica_kill_lb, "the shipped HAProxy config (deploy fix)"),
}
