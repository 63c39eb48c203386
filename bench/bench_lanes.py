"""Priority lanes against a real server: interactive latency while batch clients flood it.

One server (``models/default``, no cache, the server's default threads) and, in turns:

  idle        one interactive client: one-sentence requests, back to back (p50/p99)
  alone       ``--batch-clients`` clients posting ``--per-request`` sentences at a time with
              ``"priority": "batch"``, closed loop (sentences/s, tokens/s)
  mixed       the same batch clients, plus the interactive client measuring p50/p99
  fifo        (with ``--fifo``) as mixed, but the batch clients send no priority: everything
              in one lane, first come first served -- the behaviour before lanes

``alone`` and ``mixed`` alternate for ``--rounds`` rounds (the machine is shared: ratios
of neighbouring phases tell more than times). Targets: interactive p99 under
load <= 3x idle p99; batch throughput with interactive traffic >= 85 % of alone.

    .venv/bin/python bench/bench_lanes.py                      # ~1.5 min
    .venv/bin/python bench/bench_lanes.py --duration 20 --rounds 3 --fifo --json out.json
    .venv/bin/python bench/bench_lanes.py --server-env ELMO_INTERACTIVE_THREAD=false
    .venv/bin/python bench/bench_lanes.py --slices     # in process: what slicing costs per token
    .venv/bin/python bench/bench_lanes.py --interactive-rate 10   # light interactive traffic
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import bench_serve, fair  # noqa: E402
from bench.bench_serve import Conn, Server, make_sentences, pct  # noqa: E402

# pooled answers: small bodies with a Content-Length (the model's work is the same)
SHAPE = {"output": "mix", "pooling": "mean"}


def machine() -> dict:
    """CPU model, its ISA (``bench/fair.py``'s reading), torch, cores and the load now."""
    import torch

    return {
        "cpu": fair.cpu_model(),
        "isa": fair.isa(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "load": os.getloadavg(),
    }


async def interactive_client(
    port: int,
    stop: float,
    sentences: list[list[str]],
    rate: float | None = None,
    path: str = "/v1/embed",
    body: Callable[[list[str]], dict] | None = None,
) -> tuple:
    """One client, one sentence per request, back to back until ``stop`` (or, with
    ``rate``, at most ``rate`` requests a second, on a fixed schedule: light traffic whose
    amount does not grow as latency falls): latencies, and the server's own account of each
    (its X-*-Time headers). ``body(sentence)``: the request's JSON (default: an embed of it)."""
    lat: list[float] = []
    parts: list[dict] = []
    conn = Conn(port)
    i = 0
    start = time.perf_counter()
    try:
        while time.perf_counter() < stop:
            if rate:
                await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
            sentence = sentences[i % len(sentences)]
            i += 1
            payload = orjson.dumps(body(sentence) if body else {"sentences": [sentence], **SHAPE})
            t = time.perf_counter()
            status, data = await conn.post(path, payload)
            if status != 200:
                raise RuntimeError(f"{path} answered {status}: {data[:200]!r}")
            lat.append(time.perf_counter() - t)
            parts.append(conn.times)
    finally:
        conn.close()
    return lat, parts


async def batch_clients(
    port: int, n: int, per_request: int, stop: float, sentences: list[list[str]],
    priority: str | None,
) -> dict:  # fmt: skip
    done = {"sentences": 0, "tokens": 0, "errors": 0}
    cursor = [0]

    async def client() -> None:
        conn = Conn(port)
        try:
            while time.perf_counter() < stop:
                i = cursor[0]
                cursor[0] += per_request
                chunk = [sentences[(i + k) % len(sentences)] for k in range(per_request)]
                req: dict = {"sentences": chunk, **SHAPE}
                if priority is not None:
                    req["priority"] = priority
                status, data = await conn.post("/v1/embed", orjson.dumps(req))
                if status != 200:
                    done["errors"] += 1
                    await asyncio.sleep(0.05)
                    continue
                if time.perf_counter() <= stop:  # count only work finished inside the phase
                    done["sentences"] += per_request
                    done["tokens"] += orjson.loads(data)["usage"]["tokens"]
        finally:
            conn.close()

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(n)))
    seconds = min(time.perf_counter(), stop) - start
    return {
        "sentences_per_s": done["sentences"] / seconds,
        "tokens_per_s": done["tokens"] / seconds,
        "errors": done["errors"],
    }


async def phase(args, port: int, kind: str, sentences, probes) -> dict:
    stop = time.perf_counter() + args.duration
    out: dict = {"phase": kind, "load": os.getloadavg()[0]}
    jobs = []
    if kind in ("alone", "mixed", "fifo"):
        prio = None if kind == "fifo" else "batch"
        jobs.append(
            batch_clients(port, args.batch_clients, args.per_request, stop, sentences, prio)
        )
    if kind in ("idle", "mixed", "fifo"):
        if kind != "idle":
            await asyncio.sleep(0)  # the batch clients go first and fill the queue

        async def probe() -> tuple:
            if kind != "idle":
                await asyncio.sleep(min(1.0, args.duration / 5))  # the queue is full by then
            return await interactive_client(port, stop, probes, args.interactive_rate)

        jobs.append(probe())
    results = await asyncio.gather(*jobs)
    for r in results:
        if isinstance(r, dict):
            out.update(r)
        else:
            lat, parts = r
            out.update(interactive_n=len(lat), p50_ms=pct(lat, 50) * 1e3, p99_ms=pct(lat, 99) * 1e3)
            # the closed-loop client sends more as latency falls: what it cost the batch lane
            out["interactive_per_s"] = len(lat) / (
                args.duration - (0 if kind == "idle" else min(1.0, args.duration / 5))
            )
            for name in ("total", "queue", "inference"):  # the server's medians, ms
                out[f"server_{name}_p50_ms"] = statistics.median(p.get(name, 0.0) for p in parts)
                out[f"server_{name}_p99_ms"] = pct([p.get(name, 0.0) for p in parts], 99)
    return out


def model_slices(args) -> dict:
    """In process, no HTTP: what a batch of each padded-token budget costs per token against
    the full budget (the throughput price of slicing), and a lone sentence's time (what an
    interactive request costs the model in a batch of its own). Sizes interleaved per round;
    medians of per-round ratios."""
    from elmo_service.bilm.runner import BatchBudget, plan_batches
    from elmo_service.embedder import Embedder

    emb = Embedder.load(args.model, threads=args.threads)
    emb.warm_up()
    sents = [[t.piece for t in toks] for toks in emb.tokenize(make_sentences(4000, seed=3))]
    costs = [len(s) + 2 for s in sents]
    budgets = sorted({256, 512, 1024, 2048, 4096, *args.slice_sizes})
    cuts = {b: plan_batches(costs, BatchBudget(b, 256)) for b in budgets}
    per_token: dict[int, list[float]] = {b: [] for b in budgets}
    lone: list[float] = []
    for r in range(args.slice_rounds):
        for b in budgets:
            batch = [sents[i] for i in cuts[b][(r * 7) % len(cuts[b])]]
            t = time.perf_counter()
            emb.run_batch(batch)
            per_token[b].append((time.perf_counter() - t) / sum(len(x) + 2 for x in batch))
        t = time.perf_counter()
        emb.run_batch([sents[r]])
        lone.append(time.perf_counter() - t)
    full = max(budgets)
    out = {
        "lone_sentence_ms": statistics.median(lone) * 1e3,
        "full_ms_per_1k_tokens": statistics.median(per_token[full]) * 1e6,
    }
    for b in budgets:
        ratios = [f / x for f, x in zip(per_token[full], per_token[b], strict=True)]
        out[f"efficiency_{b}"] = statistics.median(ratios)  # throughput vs the full budget
        out[f"slice_{b}_ms"] = statistics.median(per_token[b]) * b * 1e3
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per phase")
    ap.add_argument("--rounds", type=int, default=2, help="alone/mixed pairs")
    ap.add_argument("--batch-clients", type=int, default=12)
    ap.add_argument("--per-request", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--fifo", action="store_true", help="also the one-lane baseline")
    ap.add_argument(
        "--interactive-rate", type=float, default=None,
        help="requests/s of the interactive client (default: back to back)",
    )  # fmt: skip
    ap.add_argument("--model", type=Path, default=REPO / "models" / "default")
    ap.add_argument("--server-env", action="append", default=[], metavar="K=V")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--slices", action="store_true", help="the in-process slice costs only")
    ap.add_argument("--slice-sizes", type=int, nargs="*", default=[])
    ap.add_argument("--slice-rounds", type=int, default=15)
    args = ap.parse_args(argv)
    if args.slices:
        info = machine()
        res = model_slices(args)
        print(json.dumps({**info, **{k: round(v, 3) for k, v in res.items()}}))
        return 0
    for kv in args.server_env:
        k, _, v = kv.partition("=")
        bench_serve.SERVER_ENV[k] = v
    info = machine()
    print(json.dumps(info))
    sentences = make_sentences(4000, seed=1)
    probes = make_sentences(500, seed=2)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        srv = Server(args.model, args.threads, Path(tmp), cache=False)
        try:
            srv.wait_ready()
            plan = ["idle"] + ["alone", "mixed"] * args.rounds + (["fifo"] if args.fifo else [])
            for kind in plan:
                if kind == "alone":
                    # past the batcher's interactive window (2 s): batch work alone runs in
                    # full batches, as on a server with no interactive traffic
                    time.sleep(2.5)
                row = asyncio.run(phase(args, srv.port, kind, sentences, probes))
                rows.append(row)
                print(
                    json.dumps(
                        {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}
                    )
                )
        finally:
            srv.stop()
    idle = next(r for r in rows if r["phase"] == "idle")
    pairs = [
        (a, m)
        for a, m in zip(rows, rows[1:], strict=False)
        if a["phase"] == "alone" and m["phase"] == "mixed"
    ]
    p99_ratio = statistics.median(m["p99_ms"] / idle["p99_ms"] for _, m in pairs)
    tput_ratio = statistics.median(m["tokens_per_s"] / a["tokens_per_s"] for a, m in pairs)
    summary = {
        "idle_p50_ms": idle["p50_ms"],
        "idle_p99_ms": idle["p99_ms"],
        "mixed_p50_ms": statistics.median(m["p50_ms"] for _, m in pairs),
        "mixed_p99_ms": statistics.median(m["p99_ms"] for _, m in pairs),
        "mixed_interactive_per_s": statistics.median(m["interactive_per_s"] for _, m in pairs),
        "alone_tokens_per_s": statistics.median(a["tokens_per_s"] for a, _ in pairs),
        "mixed_tokens_per_s": statistics.median(m["tokens_per_s"] for _, m in pairs),
        "p99_vs_idle": p99_ratio,
        "throughput_vs_alone": tput_ratio,
        "target_p99": p99_ratio <= 3.0,
        "target_throughput": tput_ratio >= 0.85,
        "load_after": os.getloadavg(),
    }
    fifo = next((r for r in rows if r["phase"] == "fifo"), None)
    if fifo:
        summary["fifo_p50_ms"], summary["fifo_p99_ms"] = fifo["p50_ms"], fifo["p99_ms"]
        summary["fifo_tokens_per_s"] = fifo["tokens_per_s"]
        summary["mixed_p99_vs_fifo"] = summary["mixed_p99_ms"] / fifo["p99_ms"]
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()}))
    if args.json:
        args.json.write_text(
            json.dumps({"machine": info, "rows": rows, "summary": summary}, indent=2)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
