"""The fault suite (``make chaos``): load-shaped attacks against real processes, on loopback.

One run starts a real ``redis-server``, a real ``elmo-service serve`` on a copy of
the bundled model (``models/default``) with the Redis cache and the rq job
backend, ``elmo-service worker`` processes, and ``elmo-pretrain`` trainers, then:

  baseline          8 clients for a few seconds: the reference point
  redis-kill        Redis SIGKILLed under load, restarted 2 s later
  cache-corrupt     SETRANGE into every cached payload under load (the header left intact)
  flood             64 clients x 256 new sentences at once (default limits)
  hot-swap          model activate A -> B -> A ... under load
  amplification     4 clients ask for ~20 MB answers and never read; one asks beyond the bound
  idle-flood        1,024 idle sockets (the connection limit): health routes must answer
  redis-nonsense    a second server on a fake Redis answering well-formed nonsense (4 modes)
  redis-nonsense-jobs  the same against the jobs routes
  stale-snapshot, stalled-record, unreadable-state, replica-kill-lb: the fleet's attacks,
                    two replicas on a Redis of their own (bench/chaos_fleet.py says each)
  trainer-kill      a job's trainer process alone SIGKILLed mid-job (the OOM killer's signal)
  worker-kill       a job's rq worker SIGKILLed mid-job, a new worker started
  redis-blips-job   three 6 s Redis outages (the third comes back empty) under a running job
  artifact-trunc    serve on a truncated weights file (manifest left as it was)
  artifact-trunc-rehash  the same with a manifest re-hashed to match
  artifact-nan      serve on weights holding a NaN, manifest consistent
  ckpt-truncated    --resume with the newest checkpoint truncated
  ckpt-bitflip      --resume with one bit flipped inside the newest checkpoint's tensor data
  ckpt-all-bad      --resume with every checkpoint truncated

Every 200 is checked: each sentence's layers are compared with a reference computed
in this process by ``Embedder`` on the model the response names (its version), so a
wrong or non-finite vector is counted, not trusted. Jobs are checked by step counts:
the step a job resumed from against the newest checkpoint before the fault, and the
final step against the budget. It prints a table (attack -> requests -> outcomes) and
exits 1 when any 5xx, transport error, wrong vector, lost step or failed expectation
occurs. A few minutes on 2 cores.

    .venv/bin/python bench/chaos.py [--only flood,hot-swap] [--json out.json] [--keep]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.chaos_fleet import ATTACKS as FLEET  # noqa: E402
from bench.chaos_harness import (  # noqa: E402
    ADMIN,
    PREFIX,
    Load,
    Procs,
    References,
    Row,
    base_env,
    table,
    wait_ready,
)
from elmo_pretrain.sources.synthetic import sentence, write_corpus  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.procs import pids_of  # noqa: E402
from tests.support.redis_server import RedisServer  # noqa: E402

SERVE_THREADS = 2
POOL = 96  # sentences the load clients draw from (so the cache gets hits)
LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d[ T][\d:,.]+ (DEBUG|INFO|WARNING) ")

TINY_JOB = {
    "model": {
        "char_dim": 4,
        "filters": [[1, 8], [2, 8], [3, 16]],
        "n_highway": 1,
        "projection_dim": 16,
        "lstm_dim": 32,
        "n_layers": 2,
        "dropout": 0.1,
        "max_sentence_tokens": 128,
    },
    "data": {"tokens_per_batch": 256, "max_tokens": 48, "pad_multiple": 8},
    "softmax": {"kind": "sampled", "n_samples": 64},
    "optim": {"lr": 0.01, "warmup_steps": 5},
    "train": {"precision": "fp32", "threads": 1, "log_every": 5, "eval_max_sentences": 50},
    "checkpoint": {"every_steps": 10, "every_minutes": 0, "keep": 3},
}  # fmt: skip  (configs/tiny.yaml, checkpointing every 10 steps)
JOB_STEPS = 200


# ---------------------------------------------------------------- models and references


def make_models(models: Path) -> dict[str, Path]:
    """``default`` (the bundled model), ``swap-b`` (its weights scaled: other vectors),
    and the broken ones, each as a folder under ``models``."""
    import torch
    from safetensors.torch import load_file, save_file

    from elmo_service.artifact import load_artifact, save_artifact, sha256_file, version_of

    a = models / "default"
    shutil.copytree(REPO / "models" / "default", a)
    art = load_artifact(a)
    with torch.no_grad():
        for p in art.model.parameters():
            if p.dim() == 2:
                p.mul_(0.97)  # every matrix: a model whose vectors differ everywhere
    b = models / "swap-b"
    save_artifact(
        art.model, art.tokenizer, b, provenance={"source": "chaos: scaled default"}, tasks=art.tasks
    )

    def rehash(d: Path) -> None:
        man = json.loads((d / "manifest.json").read_text())
        man["files"] = {n: sha256_file(d / n) for n in man["files"]}
        man["version"] = version_of(man["files"])
        (d / "manifest.json").write_text(json.dumps(man, indent=2, sort_keys=True) + "\n")

    broken = models.parent / "broken"
    trunc = broken / "trunc"
    shutil.copytree(a, trunc)
    w = trunc / "weights.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    rehashed = broken / "trunc-rehash"
    shutil.copytree(trunc, rehashed)
    rehash(rehashed)
    nan = broken / "nan"
    shutil.copytree(a, nan)
    state = load_file(str(nan / "weights.safetensors"))
    key = max(state, key=lambda k: state[k].numel())  # the biggest matrix holds one NaN
    state[key] = state[key].clone()
    state[key].view(-1)[7] = float("nan")
    save_file(state, str(nan / "weights.safetensors"), metadata={"format": "elmo-service"})
    rehash(nan)
    return {"a": a, "b": b, "trunc": trunc, "trunc-rehash": rehashed, "nan": nan}


# ---------------------------------------------------------------- serving attacks


async def attack_baseline(ctx: Ctx, row: Row) -> None:
    await ctx.load.clients(row, 6)


async def attack_redis_kill(ctx: Ctx, row: Row) -> None:
    async def fault() -> None:
        await asyncio.sleep(2)
        ctx.redis.proc.kill()  # SIGKILL: no goodbye to the clients
        ctx.redis.proc.wait()
        await asyncio.sleep(2)
        ctx.redis.proc = None
        ctx.redis.start()

    await asyncio.gather(ctx.load.clients(row, 10), fault())
    row.notes.append("killed at 2 s, back at 4 s")


async def attack_cache_corrupt(ctx: Ctx, row: Row) -> None:
    r = ctx.redis.client()
    warm = Row("warm")
    async with httpx.AsyncClient(timeout=60) as client:  # every pool sentence cached
        for i in range(0, len(ctx.pool), 16):
            await ctx.load.request(client, warm, ctx.pool[i : i + 16])
    hits = [0]

    async def fault() -> None:
        for _ in range(12):
            keys = list(r.scan_iter(f"{PREFIX}:emb:*", count=1000))
            for k in keys:
                r.setrange(k, 64, b"ZZZZZZZZZZZZZZZZ")  # payload bytes, header intact
            hits[0] += len(keys)
            await asyncio.sleep(0.5)

    await asyncio.gather(ctx.load.clients(row, 7), fault())
    # the attack ends here: what it left in the cache must not count against later rows
    for k in list(r.scan_iter(f"{PREFIX}:emb:*", count=1000)):
        r.delete(k)
    r.close()
    row.notes.append(f"{hits[0]} payloads overwritten")


async def attack_flood(ctx: Ctx, row: Row) -> None:
    rng = random.Random(64)
    # ~24 words a sentence, like natural text (the flood), all new to the cache
    bodies = [[" ".join(sentence(rng) for _ in range(3)) for _ in range(256)] for _ in range(64)]
    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        await asyncio.gather(*(ctx.load.request(client, row, b, check_all=False) for b in bodies))
    took = time.monotonic() - t0
    ctx.load.check_samples(row)
    drained = await ctx.load.drain()
    row.notes.append(f"all answered in {took:.0f} s; queue drained {drained:.0f} s later")


async def attack_hot_swap(ctx: Ctx, row: Row) -> None:
    swaps = Counter()

    async def fault() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            for i in range(6):
                await asyncio.sleep(1.5)
                name = "swap-b" if i % 2 == 0 else "default"
                r = await client.post(f"{ctx.load.url}/v1/models/{name}/activate", headers=ADMIN)
                swaps[r.status_code] += 1

    await asyncio.gather(ctx.load.clients(row, 11), fault())
    row.notes.append("activations: " + ", ".join(f"{n} x {c}" for c, n in sorted(swaps.items())))
    if set(swaps) != {200}:
        row.failures.append("an activation failed")


# ---------------------------------------------------------------- response size, floods, nonsense Redis

SEND_TIMEOUT = 5  # ELMO_HTTP_SEND_TIMEOUT of the chaos server (the default is 30 s)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def raw_post(port: int, body: dict[str, Any], rcvbuf: int = 4096) -> socket.socket:
    """A request on a socket that will never be read (a small receive window)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/embed HTTP/1.1\r\nHost: chaos\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data
    )
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """Reads what was sent; True when the server closed the connection (EOF or reset)."""
    sock.setblocking(False)
    try:
        while sock.recv(1 << 20):
            pass
        return True
    except BlockingIOError:
        return False  # still open, nothing more to read
    except ConnectionResetError:
        return True


async def attack_amplification(ctx: Ctx, row: Row) -> None:
    """4 clients ask for ~20 MB of JSON each and never read; one asks beyond the bound."""
    port = int(ctx.load.url.rsplit(":", 1)[1])
    rng = random.Random(2)
    big = {"sentences": [rng.choice(ctx.pool) for _ in range(256)]}  # cached: no model work
    # ~100 tokens x 256 sentences x (3 layers + a mix) x 256 dims: beyond the 16.8M default
    long = [" ".join(ctx.pool[i : i + 16]) for i in range(0, 96, 16)]
    huge = {"sentences": (long * 43)[:256], "output": "both"}
    before = rss_mib(ctx.server.pid)
    async with httpx.AsyncClient(timeout=60) as client:
        r = await client.post(f"{ctx.load.url}/v1/embed", json=huge)
        row.count(r.status_code)
        if r.status_code != 413 or "ELMO_MAX_RESPONSE_FLOATS" not in r.text:
            row.failures.append(f"over the bound: {r.status_code} {r.text[:100]}")
        else:
            row.notes.append("256 long sentences: 413 naming ELMO_MAX_RESPONSE_FLOATS")
    socks = [raw_post(port, big) for _ in range(4)]
    peak = before
    t0 = time.monotonic()
    load = asyncio.create_task(ctx.load.clients(row, SEND_TIMEOUT + 4))
    open_ = socks
    while open_ and time.monotonic() - t0 < SEND_TIMEOUT + 60:
        await asyncio.sleep(0.5)
        peak = max(peak, rss_mib(ctx.server.pid))
        open_ = [s for s in open_ if not closed_by_server(s)]
    took = time.monotonic() - t0
    await load
    for s in socks:
        s.close()
    await asyncio.sleep(1)
    after = rss_mib(ctx.server.pid)
    row.requests += len(socks)
    if open_:
        row.failures.append(
            f"{len(open_)} never-reading clients still connected after {took:.0f} s"
        )
    else:
        row.notes.append(
            f"4 never-reading clients cut {took:.0f} s after sending (send deadline "
            f"{SEND_TIMEOUT} s); server RSS {before:.0f} -> peak {peak:.0f} -> {after:.0f} MiB"
        )


async def attack_idle_flood(ctx: Ctx, row: Row) -> None:
    """1,024 idle sockets (the default connection limit): health routes must still answer."""
    port = int(ctx.load.url.rsplit(":", 1)[1])
    socks = []
    for _ in range(1024):
        socks.append(socket.create_connection(("127.0.0.1", port)))
    refused = 0
    try:
        await asyncio.sleep(0.5)
        async with httpx.AsyncClient(timeout=10) as client:
            for _ in range(3):
                for path in ("/healthz", "/readyz"):
                    try:
                        r = await client.get(f"{ctx.load.url}{path}")
                    except httpx.HTTPError as e:
                        row.count(None)
                        row.failures.append(f"{path}: {type(e).__name__}")
                        continue
                    row.count(r.status_code)
                    if r.status_code != 200:
                        row.failures.append(f"{path}: {r.status_code}")
                r = await client.post(f"{ctx.load.url}/v1/embed", json={"sentences": ["a flood ."]})
                row.requests += 1
                try:
                    body = r.json()
                except ValueError:
                    body = {}
                if r.status_code == 503 and body.get("code") == "overloaded":
                    refused += 1
                elif r.status_code != 200:
                    row.failures.append(f"embed during the flood: {r.status_code} {r.text[:80]}")
                await asyncio.sleep(0.3)
    finally:
        for s in socks:
            s.close()
    await asyncio.sleep(0.5)
    await ctx.load.clients(row, 3)  # and served again once they are gone
    row.notes.append(
        f"health routes 200 throughout; {refused}/3 embeds answered 503 JSON 'overloaded' "
        "with Retry-After (not counted as 5xx)"
    )


async def attack_redis_nonsense(ctx: Ctx, row: Row, jobs: bool = False) -> None:
    """A second server whose Redis is a fake answering well-formed nonsense (4 modes)."""
    from tests.support.fake_redis import MODES, FakeRedis

    fake = FakeRedis("types").start()
    port = free_port()
    env = {**ctx.serve_env, "REDIS_URL": fake.url, "ELMO_THREADS": "1"}
    proc = ctx.procs.start(
        f"serve-nonsense-{row.attack}",
        [sys.executable, "-m", "elmo_cli.main", "serve", "--port", str(port)],
        env,
    )
    try:
        if not wait_ready(port, proc, timeout=240):
            row.failures.append("the server on the fake Redis did not become ready")
            return
        load = Load(port, ctx.load.refs, ctx.pool)
        url = load.url
        async with httpx.AsyncClient(timeout=60, headers=ADMIN) as c:
            for mode in MODES:
                fake.set_mode(mode)
                if jobs:
                    calls = [("GET", "/v1/jobs", None), ("GET", "/v1/jobs/nosuch", None),
                             ("POST", "/v1/jobs", job_body("chaos-nonsense"))]  # fmt: skip
                else:
                    await load.clients(row, 2, n=4)
                    calls = [
                        ("POST", "/v1/embeddings", {"input": ctx.pool[:3], "model": "default"}),
                        ("POST", "/v1/embed", {"sentences": ctx.pool[:3], "task": "default"}),
                        ("GET", "/v1/tasks", None), ("GET", "/v1/tasks/default", None),
                        ("PUT", "/v1/tasks/chaos", {"weights": [0.0, 1.0, 1.0]}),
                        ("DELETE", "/v1/tasks/chaos", None),
                    ]  # fmt: skip
                for method, path, body in calls:
                    try:
                        r = await c.request(method, f"{url}{path}", json=body)
                    except httpx.HTTPError:
                        row.count(None)
                        continue
                    if r.status_code == 503 and r.json().get("code", "").endswith("unavailable"):
                        row.requests += 1  # the documented answer: the store is unusable
                        row.notes.append(f"{mode}: {method} {path} 503")
                    else:
                        row.count(r.status_code)
                        if r.status_code >= 500:
                            row.failures.append(f"{mode}: {method} {path} {r.status_code}")
        if not row.failures:  # the per-call 503 notes folded into one line
            n503 = sum(n.endswith(" 503") for n in row.notes)
            served = (
                "the jobs routes (list, get, submit)"
                if jobs
                else "the task routes; embeddings served uncached and checked"
            )
            row.notes[:] = [n for n in row.notes if not n.endswith(" 503")] + [
                f"modes {', '.join(MODES)}: no 5xx; {n503} x 503 store_unavailable from {served}"
            ]
    finally:
        ctx.procs.stop(proc)
        fake.stop()


# ---------------------------------------------------------------- job attacks


def job_body(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "corpus": "corpora/book.txt",
        "config": TINY_JOB,
        "budget": {"steps": JOB_STEPS},
        "prepare": {"tokenizer": "word", "vocab_size": 300, "heldout_fraction": 0.05},
    }


def newest_step(train_dir: Path) -> int:
    found = sorted((train_dir / "checkpoints").glob("step-*.pt"))
    return int(found[-1].name[5:13]) if found else 0


async def run_job_attack(ctx: Ctx, row: Row, kill) -> None:
    """Submit a job, ``kill(rec)`` once it has a checkpoint, wait for the end, count steps."""
    url = ctx.load.url
    async with httpx.AsyncClient(timeout=30, headers=ADMIN) as c:
        r = await c.post(f"{url}/v1/jobs", json=job_body(f"chaos-{row.attack}"))
        row.count(r.status_code)
        if r.status_code != 202:
            row.failures.append(f"submit: {r.status_code} {r.text[:120]}")
            return
        job = r.json()["id"]

        async def wait(until, timeout: float) -> dict[str, Any]:
            deadline = time.monotonic() + timeout
            rec: dict[str, Any] = {}
            while time.monotonic() < deadline:
                rec = (await c.get(f"{url}/v1/jobs/{job}")).json()
                if until(rec) or rec.get("state") in ("succeeded", "failed", "cancelled"):
                    return rec
                await asyncio.sleep(0.2)
            return rec

        rec = await wait(lambda j: j["state"] == "running" and j["progress"]["step"] >= 35, 120)
        if rec.get("state") != "running":
            row.failures.append(f"never ran: {rec.get('state')} {rec.get('error')}")
            return
        train_dir = Path(rec["run_dir"]) / "train"
        before = newest_step(train_dir)
        what = kill(rec)
        await asyncio.sleep(1)  # what the fault left on disk: the trainer writes on SIGTERM
        saved = newest_step(train_dir)
        rec = await wait(lambda j: False, 180)
    log = (Path(rec["run_dir"]) / "job.log").read_text()
    resumed = [int(m) for m in re.findall(r"resumed from step-\d+\.pt: step (\d+)", log)]
    final, total = rec["progress"]["step"], rec["progress"]["total_steps"]
    lost = max(0, max(before, saved) - (resumed[-1] if resumed else 0)) + max(0, total - final)
    row.lost_steps = lost
    row.notes.append(
        f"{what}; newest checkpoint at the fault: step {max(before, saved)}; resumed from step "
        f"{resumed[-1] if resumed else 'none'}; final {final}/{total}; state {rec['state']}, "
        f"attempt {rec['attempt']}"
    )
    if rec.get("last_loss"):
        row.notes.append(f"reason recorded: {rec['last_loss']}")
    if rec["state"] != "succeeded":
        row.failures.append(f"job {rec['state']}: {rec.get('error')}")


async def attack_trainer_kill(ctx: Ctx, row: Row) -> None:
    def kill(rec: dict[str, Any]) -> str:
        pids = pids_of("elmo_pretrain.cli", "train", containing=rec["run_dir"])
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        return f"SIGKILL to trainer pid {pids}"

    await run_job_attack(ctx, row, kill)


async def attack_worker_kill(ctx: Ctx, row: Row) -> None:
    def kill(rec: dict[str, Any]) -> str:
        w = ctx.worker
        w.kill()  # the rq worker; its work-horse gets SIGTERM (and checkpoints)
        w.wait()
        ctx.worker = ctx.start_worker()
        return f"SIGKILL to worker pid {w.pid}, a new worker started"

    await run_job_attack(ctx, row, kill)


async def attack_redis_blips_job(ctx: Ctx, row: Row) -> None:
    """Redis goes away three times for 6 s (longer than rq's 5 s job monitoring) while a
    job trains: twice hung (SIGSTOP), then stopped and restarted without its data (no
    persistence here). The job must succeed on its first attempt, every step trained
    once, no loss counted, and the rq worker must live through it."""
    url, worker, name = ctx.load.url, ctx.worker, f"chaos-{row.attack}"
    blips: list[str] = []
    async with httpx.AsyncClient(timeout=60, headers=ADMIN) as c:

        async def job_state(job: str) -> dict[str, Any] | None:
            try:
                r = await c.get(f"{url}/v1/jobs/{job}")
            except httpx.HTTPError:
                row.count(None)
                return None
            row.count(r.status_code)  # 503 while Redis is away is the documented answer
            return r.json() if r.status_code == 200 else None

        async def wait(job: str, until, timeout: float) -> dict[str, Any]:
            deadline, rec = time.monotonic() + timeout, {}
            while time.monotonic() < deadline:
                rec = await job_state(job) or rec
                if rec and (until(rec) or rec["state"] in ("succeeded", "failed", "cancelled")):
                    break
                await asyncio.sleep(0.5)
            return rec

        r = await c.post(f"{url}/v1/jobs", json=job_body(name))
        row.count(r.status_code)
        if r.status_code != 202:
            row.failures.append(f"submit: {r.status_code} {r.text[:120]}")
            return
        job = r.json()["id"]
        rec = await wait(
            job, lambda j: j["state"] == "running" and j["progress"]["step"] >= 20, 120
        )
        if rec.get("state") != "running":
            row.failures.append(f"never ran: {rec.get('state')} {rec.get('error')}")
            return
        step_before = rec["progress"]["step"]
        for i in range(3):
            if i < 2:  # connections stay open and nothing answers
                os.kill(ctx.redis.proc.pid, signal.SIGSTOP)
                await asyncio.sleep(6)
                os.kill(ctx.redis.proc.pid, signal.SIGCONT)
                blips.append("hang")
            else:
                ctx.redis.stop()
                await asyncio.sleep(6)
                ctx.redis.start()
                blips.append("restart-empty")
            await asyncio.sleep(3)
        step_after = (await wait(job, lambda j: True, 30)).get("progress", {}).get("step")
        rec = await wait(job, lambda j: False, 240)
    row.lost_steps = max(0, rec["progress"]["total_steps"] - rec["progress"]["step"])
    row.notes.append(
        f"Redis: {', '.join(blips)} (6 s each, 3 s apart) from step {step_before} to "
        f"{step_after}; "
        f"state {rec['state']}, attempt {rec['attempt']}, losses {rec['losses']}, "
        f"final step {rec['progress']['step']}/{rec['progress']['total_steps']}"
    )
    if rec["state"] != "succeeded":
        row.failures.append(f"job {rec['state']}: {rec.get('error')}")
    if rec["losses"] or rec["attempt"] != 1:
        row.failures.append(f"attempt {rec['attempt']}, {rec['losses']} loss(es) counted")
    if worker.poll() is not None:
        row.failures.append(f"the rq worker died (exit {worker.returncode})")


# ---------------------------------------------------------------- offline attacks


def attack_artifact(ctx: Ctx, row: Row, which: str) -> None:
    port = free_port()
    env = base_env(ELMO_THREADS="1", ELMO_WARMUP="true", ELMO_RUNS_DIR=str(ctx.root / "runs-x"))
    cmd = [
        sys.executable,
        "-m",
        "elmo_cli.main",
        "serve",
        "--port",
        str(port),
        "--model",
        str(ctx.models[which]),
    ]
    err = ctx.root / f"serve-{which}.err"
    with open(err, "wb") as f:
        p = ctx.procs.start(f"serve-{which}", cmd, env, stderr=f)
    row.requests = 1
    try:
        if wait_ready(port, p, timeout=90):
            row.wrong += 1
            row.failures.append("served the broken model")
            r = httpx.post(
                f"http://127.0.0.1:{port}/v1/embed", json={"sentences": ["a test ."]}, timeout=30
            )
            row.count(r.status_code)
            if r.status_code == 200 and ("null" in r.text or "NaN" in r.text):
                row.notes.append("its 200 carried null/NaN vectors")
        else:
            rc = p.wait(30)
            text = err.read_text(errors="replace").splitlines()
            # log records (INFO ...) may precede it; the error itself must be one line
            lines = [x for x in text if x.strip() and not LOG_RECORD.match(x)]
            row.notes.append(f"refused at start: exit {rc}: {lines[-1][:140] if lines else ''}")
            if rc == 0:
                row.failures.append("exit 0")
            if len(lines) != 1:
                row.failures.append(f"{len(lines)} lines on stderr besides log records, not one")
    finally:
        ctx.procs.stop(p, signal.SIGKILL)


def pretrain(ctx: Ctx, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "elmo_pretrain.cli", *args],
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def checkpoint_run(ctx: Ctx) -> Path:
    """A tiny run stopped at step 30, checkpoints at 10, 20, 30 (made once)."""
    base = ctx.root / "ckpt-base"
    if base.exists():
        return base
    prepared = ctx.root / "prepared"
    p = pretrain(ctx, "prepare", str(ctx.data / "corpora" / "book.txt"), "--out", str(prepared),
                 "--tokenizer", "word", "--vocab-size", "300", "--no-progress")  # fmt: skip
    assert p.returncode == 0, p.stderr
    sets = [f"data.path={prepared}", "train.steps=40", "checkpoint.every_steps=10",
            "checkpoint.keep=3", "train.progress=false", "train.eval_max_sentences=20"]  # fmt: skip
    cmd = [
        "train",
        str(REPO / "configs" / "tiny.yaml"),
        "--run-dir",
        str(base),
        "--stop-after",
        "30",
    ]
    p = pretrain(ctx, *cmd, *[x for s in sets for x in ("--set", s)])
    assert p.returncode == 0, p.stdout + p.stderr
    return base


def attack_checkpoint(ctx: Ctx, row: Row, how: str) -> None:
    import torch

    from elmo_pretrain.checkpoint import list_checkpoints, load_checkpoint

    run = ctx.root / f"ckpt-{how}"
    shutil.copytree(checkpoint_run(ctx), run)
    ckpts = list_checkpoints(run)
    good_before = int(ckpts[-1].name[5:13])
    if how == "truncated":
        ckpts[-1].write_bytes(ckpts[-1].read_bytes()[:-4096])
        good_before = int(ckpts[-2].name[5:13])
    elif how == "bitflip":
        st = load_checkpoint(ckpts[-1])
        t = max(st["model"].values(), key=lambda x: x.numel())
        raw = bytearray(ckpts[-1].read_bytes())
        at = raw.find(t.to(torch.float32).numpy().tobytes())
        assert at >= 0, "tensor bytes not found in the checkpoint"
        at += t.numel() * 2  # the middle of the biggest tensor's data
        raw[at] ^= 0x04
        ckpts[-1].write_bytes(bytes(raw))
        good_before = int(ckpts[-2].name[5:13])
    else:  # all
        for c in ckpts:
            c.write_bytes(c.read_bytes()[: c.stat().st_size // 3])
    files_before = sorted(p.name for p in (run / "checkpoints").iterdir())
    p = pretrain(ctx, "train", "--run-dir", str(run), "--resume")
    row.requests = 1
    m = re.search(r"resumed from step-\d+\.pt: step (\d+)", p.stdout)
    resumed = int(m.group(1)) if m else 0
    final = re.findall(r"stopped at step (\d+)", p.stdout)
    if how == "all":
        lines = [x for x in p.stderr.splitlines() if x.strip()]
        after = sorted(q.name for q in (run / "checkpoints").iterdir())
        row.lost_steps = 0 if p.returncode != 0 else good_before  # a restart from 0 loses them
        row.notes.append(f"exit {p.returncode}: {lines[-1][:150] if lines else ''}")
        if p.returncode == 0:
            row.failures.append("resumed from nothing (exit 0)")
        if len(lines) != 1:
            row.failures.append(f"{len(lines)} lines on stderr, not one")
        if after != files_before:
            row.failures.append("files deleted or added")
        return
    row.lost_steps = max(0, good_before - resumed) + (0 if final and int(final[-1]) == 40 else 40)
    row.notes.append(
        f"resumed from step {resumed} (newest intact: {good_before}); final {final[-1] if final else '?'}/40"
    )
    if p.returncode != 0:
        row.failures.append(f"exit {p.returncode}: {p.stderr.strip()[-150:]}")


def attack_divergence(ctx: Ctx, row: Row, lr: str) -> None:
    """Train with plain SGD at an absurd lr, no clipping (lr 1e30: NaN at step 2; lr 1e6:
    finite weights, held-out NLL of millions of nats). The trainer must stop with exit 2
    and one line, keep only finite checkpoints, write no bare NaN/Infinity in any JSON,
    and ``export`` must refuse the run."""
    from elmo_pretrain.checkpoint import list_checkpoints, load_checkpoint, nonfinite_tensors

    prepared = ctx.root / "prepared-divergence"
    if not prepared.exists():
        p = pretrain(ctx, "prepare", str(ctx.data / "corpora" / "book.txt"), "--out", str(prepared),
                     "--tokenizer", "word", "--vocab-size", "300", "--no-progress")  # fmt: skip
        assert p.returncode == 0, p.stderr
    run = ctx.root / f"diverge-{lr}"
    sets = [f"data.path={prepared}", f"optim.lr={lr}", "optim.name=sgd", "optim.clip_norm=0",
            "optim.warmup_steps=0", "train.steps=30", "checkpoint.every_steps=1",
            "train.progress=false", "train.eval_max_sentences=20"]  # fmt: skip
    cmd = ["train", str(REPO / "configs" / "tiny.yaml"), "--run-dir", str(run)]
    p = pretrain(ctx, *cmd, *[x for s in sets for x in ("--set", s)])
    row.requests = 2
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    row.notes.append(f"train exit {p.returncode}: {lines[-1][:110] if lines else ''}")
    if p.returncode != 2:
        row.failures.append(f"train exit {p.returncode}, not 2")
    if len(lines) != 1 or "diverged" not in lines[0]:
        row.failures.append(f"{len(lines)} stderr lines, not one naming the divergence")

    def no_bare_constants(c: str):
        raise ValueError(c)

    try:
        recs = [json.loads(x, parse_constant=no_bare_constants)
                for x in (run / "metrics.jsonl").read_text().splitlines()]  # fmt: skip
        if recs[-1].get("reason") != "diverged":
            row.failures.append(f"stop record reason {recs[-1].get('reason')!r}")
    except ValueError as e:
        row.failures.append(f"metrics.jsonl holds a bare {e}")
    bad = [c.name for c in list_checkpoints(run) if nonfinite_tensors(load_checkpoint(c)["model"])]
    if bad:
        row.failures.append(f"non-finite checkpoints kept: {bad}")
    out = ctx.root / f"diverge-{lr}-model"
    p = pretrain(ctx, "export", str(run), str(out))
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    row.notes.append(f"export exit {p.returncode}")
    if p.returncode != 2 or len(lines) != 1 or out.exists():
        row.failures.append(
            f"export exit {p.returncode}, {len(lines)} lines; folder written: {out.exists()}"
        )


# ---------------------------------------------------------------- the run


@dataclass
class Ctx:
    root: Path
    procs: Procs
    redis: RedisServer
    models: dict[str, Path]
    data: Path
    load: Load
    pool: list[str]
    worker_env: dict[str, str]
    worker: subprocess.Popen | None = None
    server: subprocess.Popen | None = None
    serve_env: dict[str, str] = field(default_factory=dict)
    fleet: Any = None  # bench/chaos_fleet.py's replicas, started by the first fleet attack
    closers: list = field(default_factory=list)  # run at the end (e.g. the fleet's Redis)

    def start_worker(self) -> subprocess.Popen:
        n = len(self.procs.procs)
        return self.procs.start(
            f"worker{n}", [sys.executable, "-m", "elmo_cli.main", "worker"], self.worker_env
        )


# attack -> (runner, which fix it needs when that fix is not on the branch)
SERVING = {
    "baseline": (attack_baseline, ""),
    "redis-kill": (attack_redis_kill, ""),
    "cache-corrupt": (attack_cache_corrupt, "cache payload checksums"),
    "flood": (attack_flood, "admission control: 429 + Retry-After"),
    "hot-swap": (attack_hot_swap, ""),
    "amplification": (attack_amplification, "the response bound and the send deadline"),
    "idle-flood": (attack_idle_flood, "health routes exempt from the connection limit"),
    "redis-nonsense": (attack_redis_nonsense, "Redis reply validation (cache, tasks)"),
    "redis-nonsense-jobs": (lambda c, r: attack_redis_nonsense(c, r, jobs=True), "Redis reply validation in the jobs store"),
}  # fmt: skip
JOBS = {
    "trainer-kill": (attack_trainer_kill, ""),
    "worker-kill": (attack_worker_kill, ""),
    "redis-blips-job": (attack_redis_blips_job, ""),
}
OFFLINE = {
    "artifact-trunc": (lambda c, r: attack_artifact(c, r, "trunc"), "one-line start-up errors"),
    "artifact-trunc-rehash": (lambda c, r: attack_artifact(c, r, "trunc-rehash"), "one-line start-up errors"),
    "artifact-nan": (lambda c, r: attack_artifact(c, r, "nan"), "non-finite weights refused at load"),
    "ckpt-truncated": (lambda c, r: attack_checkpoint(c, r, "truncated"), ""),
    "ckpt-bitflip": (lambda c, r: attack_checkpoint(c, r, "bitflip"), ""),
    "ckpt-all-bad": (lambda c, r: attack_checkpoint(c, r, "all"), ""),
    "diverge-nan": (lambda c, r: attack_divergence(c, r, "1e30"), "divergence stops the trainer"),
    "diverge-overflow": (lambda c, r: attack_divergence(c, r, "1e6"), "divergence stops the trainer"),
}  # fmt: skip
ALL = {**SERVING, **FLEET, **JOBS, **OFFLINE}


async def main_async(args: argparse.Namespace, root: Path) -> list[Row]:
    only = [a for a in (args.only.split(",") if args.only else ALL)]
    unknown = [a for a in only if a not in ALL]
    if unknown:
        raise SystemExit(f"chaos: unknown attack(s) {unknown}; known: {', '.join(ALL)}")
    procs = Procs(root)
    redis = RedisServer(root / "redis").start()
    rows: list[Row] = []
    ctx: Ctx | None = None
    try:
        print(f"chaos: working in {root}", flush=True)
        models = make_models(root / "models")
        data = root / "data"
        (data / "corpora").mkdir(parents=True)
        write_corpus(data / "corpora" / "book.txt", n_sentences=1500, seed=11)
        rng = random.Random(7)
        pool = [sentence(rng) for _ in range(POOL)]
        refs = References([models["a"], models["b"]])
        refs.precompute(pool)
        env = base_env(
            REDIS_URL=redis.url, ELMO_REDIS_PREFIX=PREFIX, ELMO_JOBS_QUEUE=f"{PREFIX}-jobs",
            ELMO_MODELS_DIR=str(root / "models"), ELMO_MODEL="default", ELMO_DATA_DIR=str(data),
            ELMO_RUNS_DIR=str(root / "runs"), ELMO_ADMIN_KEYS="chaos-admin",
            ELMO_JOBS_POLL_INTERVAL="0.2", ELMO_JOBS_STOP_TIMEOUT="30",
        )  # fmt: skip
        port = free_port()
        ctx = Ctx(
            root,
            procs,
            redis,
            models,
            data,
            Load(port, refs, pool),
            pool,
            {**env, "ELMO_THREADS": "1"},
        )
        need_server = any(a in SERVING or a in JOBS or a in FLEET for a in only)
        if need_server:
            serve_env = {**env, "ELMO_THREADS": str(SERVE_THREADS),
                         "ELMO_HTTP_SEND_TIMEOUT": str(SEND_TIMEOUT)}  # fmt: skip
            ctx.serve_env = serve_env
            server = ctx.server = procs.start(
                "serve",
                [sys.executable, "-m", "elmo_cli.main", "serve", "--port", str(port)],
                serve_env,
            )
            if not wait_ready(port, server):
                raise SystemExit(
                    f"chaos: the server did not become ready; see {root / 'serve.log'}"
                )
        if any(a in JOBS for a in only):
            ctx.worker = ctx.start_worker()
        for name in only:
            fn, needs = ALL[name]
            row = Row(name, depends_on=needs)
            print(f"chaos: {name} ...", flush=True)
            t0 = time.monotonic()
            try:
                res = fn(ctx, row)
                if asyncio.iscoroutine(res):
                    await res
            except Exception as e:  # the harness itself broke: the row fails, visibly
                row.failures.append(f"harness: {type(e).__name__}: {e}")
            row.seconds = time.monotonic() - t0
            rows.append(row)
            print(f"chaos: {name}: {'ok' if row.ok else 'FAIL'} in {row.seconds:.0f} s", flush=True)
    finally:
        procs.stop_all()
        for close in ctx.closers if ctx is not None else ():
            close()
        redis.stop()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated attacks (default: all): " + ", ".join(ALL))
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--keep", action="store_true", help="keep the working folder (logs)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="elmo-chaos-"))
    t0 = time.monotonic()
    try:
        rows = asyncio.run(main_async(args, root))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print(table(rows))
    bad = [r.attack for r in rows if not r.ok]
    print(
        f"\n{len(rows)} attacks in {time.monotonic() - t0:.0f} s; "
        + (f"FAILED: {', '.join(bad)}" if bad else "all held")
    )
    if args.json:
        Path(args.json).write_text(json.dumps([
            {"attack": r.attack, "requests": r.requests, **dict(r.status), "wrong": r.wrong,
             "lost_steps": r.lost_steps, "ok": r.ok, "failures": r.failures, "notes": r.notes,
             "depends_on": r.depends_on, "seconds": round(r.seconds, 1)} for r in rows
        ], indent=1))  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
