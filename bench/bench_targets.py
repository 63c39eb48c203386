"""The serving targets in one command, against a real ``elmo-service serve`` with default
settings (docs/serving.md, docs/documents.md), sides alternating within each round:

  (a) 16 concurrent clients' throughput vs the in-process embedder in batches of 16 on the
      same sentences (>= 90 %); one client's p50 vs in-process batch 1 (within 3 ms);
  (b) while 12 batch-priority clients keep the queue full: a one-sentence interactive p99
      vs an idle server's (<= 3x), and batch throughput vs batch clients alone (>= 0.85);
  (c) 200 documents of ~2,000 tokens, 8 streams at a time through POST /v1/embed/document,
      and the same text through ``embed-file --documents``, vs sentence mode in-process on
      the same text (>= 0.9x each); one document of 200,000 tokens (>= 0.65x);
  (d) while 32 documents stream: /v1/embed interactive p99 vs idle (<= 3x), the server's
      RSS growth (< 300 MB), and a 33rd stream answered 429 with Retry-After.

Settings are the defaults except what a target names: (c) ELMO_MAX_DOCUMENT_STREAMS=8,
(d) ELMO_MAX_DOCUMENT_STREAMS=32 (the limit the 33rd stream passes); (a) reuses
``bench_serve.interleaved_targets`` (its server's queue bound raised, which 16 closed-loop
clients never reach). Prints the CPU model and ISA (bench/fair.py), the load average at
start and end, and a table of each target with pass/fail.

    .venv/bin/python bench/bench_targets.py            # the full run (minutes, a quiet machine)
    .venv/bin/python bench/bench_targets.py --quick    # each part tiny: the script runs end to end
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import bench_lanes, bench_serve, fair  # noqa: E402
from bench.bench_embedder import pydoc_prose  # noqa: E402

Server, load_phase = bench_serve.Server, bench_serve.load_phase
interleaved_targets, make_sentences = bench_serve.interleaved_targets, bench_serve.make_sentences

MODEL = REPO / "models" / "default"
MIX = {"output": "mix", "encoding": "base64"}
RATE = 20.0  # (b): the paced interactive client's requests a second


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def prose_words(n_tokens: int) -> str:
    """~``n_tokens`` words of CPython's help prose, repeated as needed."""
    words = " ".join(pydoc_prose()).split()
    out = (words * (n_tokens // max(len(words), 1) + 1))[:n_tokens]
    return " ".join(out)


# -- (a) ---------------------------------------------------------------------------------------
def part_a(q: bool, tmp: Path) -> list[tuple]:
    got = interleaved_targets(
        MODEL, None, None, 16, 1 if q else 3, 1.0 if q else 8.0, MIX, tmp / "a"
    )["median"]
    return [
        ("a", "16 clients / in-process batch 16", got["throughput_fraction"], ">= 0.90",
         got["throughput_fraction"] >= 0.90),
        ("a", "1 client p50 - in-process batch 1 (ms)", got["latency_gap_ms"], "<= 3",
         got["latency_gap_ms"] <= 3.0),
    ]  # fmt: skip


# -- (b) ---------------------------------------------------------------------------------------
def interactive_p99(port: int, seconds: float, rate: float | None = None) -> tuple[float, list]:
    """One client, one sentence a request: back to back, or ``rate`` requests a second on a
    fixed schedule (bench_lanes' client: an amount of traffic that does not grow as the
    answers get faster, as a person's requests do not). Returns the p99 (ms) and every
    latency (ms): a p99 of one ~8 s phase rests on its two or three slowest requests."""
    sents = make_sentences(2_000, seed=int(time.time()))
    if rate:
        lat, _ = asyncio.run(
            bench_lanes.interactive_client(port, time.perf_counter() + seconds, sents, rate)
        )
        return 1e3 * statistics.quantiles(lat, n=100)[98], [1e3 * x for x in lat]
    r = asyncio.run(load_phase(port, 1, seconds, sents, 1, MIX, False))
    return r["p99_ms"], [1e3 * x for x in r["latencies"]]


def part_b(q: bool, tmp: Path, rounds: int | None = None) -> list[tuple]:
    """Both interactive clients: back to back (its request rate grows as its answers get
    faster, and every request takes CPU from the batch clients on 2 cores), and paced at
    RATE requests a second."""
    seconds, rounds = (1.0, 1) if q else (8.0, rounds or 3)
    srv = Server(MODEL, None, tmp / "b")
    got: dict[str, list[float]] = {}
    batch = {**MIX, "priority": "batch"}
    # every phase sends sentences of its own: a phase that replayed another's would be
    # answered from the server's cache (an "alone" phase measured so read 2x too fast)
    seeds = iter(range(300, 10**6))
    try:
        srv.wait_ready()
        # the server's first batch-lane load compiles and fills its kernel caches: not a round
        warm = make_sentences(20_000, seed=next(seeds))
        asyncio.run(load_phase(srv.port, 12, min(seconds, 4.0), warm, 4, batch, True))
        for _ in range(rounds):
            for pace in (None, RATE):
                name = "paced" if pace else "b2b"
                p99, lat = interactive_p99(srv.port, seconds, pace)
                got.setdefault(f"idle {name}", []).append(p99)
                got.setdefault(f"idle {name} pooled", []).extend(lat)
                many = make_sentences(50_000, seed=next(seeds))
                alone = asyncio.run(load_phase(srv.port, 12, seconds, many, 4, batch, True))
                got.setdefault(f"alone {name}", []).append(alone["tokens_per_s"])
                out: dict = {}
                many = make_sentences(50_000, seed=next(seeds))

                def flood(out=out, many=many) -> None:
                    out["b"] = asyncio.run(load_phase(srv.port, 12, seconds, many, 4, batch, True))

                t = threading.Thread(target=flood)
                t.start()
                p99, lat = interactive_p99(srv.port, seconds, pace)
                got.setdefault(f"mixed {name}", []).append(p99)
                got.setdefault(f"mixed {name} pooled", []).extend(lat)
                t.join()
                got.setdefault(f"shared {name}", []).append(out["b"]["tokens_per_s"])
    finally:
        srv.stop()
    rows = []
    for name, label in (("b2b", "back to back"), ("paced", f"{RATE:g}/s")):
        p99 = statistics.median(
            m / i for m, i in zip(got[f"mixed {name}"], got[f"idle {name}"], strict=True)
        )
        tput = statistics.median(
            s / a for s, a in zip(got[f"shared {name}"], got[f"alone {name}"], strict=True)
        )
        print(f"  (b) {label}: idle p99 {got[f'idle {name}']} ms, mixed {got[f'mixed {name}']} ms")
        # the 99th percentile over every round's requests at once (~3x the samples a round has)
        pooled = [
            statistics.quantiles(got[f"{phase} {name} pooled"], n=100)[98]
            for phase in ("mixed", "idle")
        ]
        print(
            f"  (b) {label}: p99 over all rounds' requests: idle {pooled[1]:.1f} ms, mixed "
            f"{pooled[0]:.1f} ms -> {pooled[0] / pooled[1]:.2f}x"
        )
        print(
            f"  (b) {label}: batch tokens/s alone {got[f'alone {name}']}, shared {got[f'shared {name}']}"
        )
        rows += [
            ("b", f"interactive ({label}) p99 under 12 batch clients / idle", p99, "<= 3",
             p99 <= 3.0),
            ("b", f"batch throughput beside it ({label}) / alone", tput, ">= 0.85",
             tput >= 0.85),
        ]  # fmt: skip
    return rows


# -- (c), (d) -------------------------------------------------------------------------------------
def stream_document(url: str, text: str, timeout: float = 3600) -> int:
    """POST one document, read its whole answer; returns the tokens its done line counts."""
    with (
        httpx.Client(timeout=timeout) as c,
        c.stream("POST", url + "/v1/embed/document", json={"document": text, **MIX}) as r,
    ):
        r.raise_for_status()
        last = b""
        for line in r.iter_lines():
            last = line.encode() if isinstance(line, str) else line
    done = orjson.loads(last)
    if not done.get("done"):
        raise RuntimeError(f"document stream ended with {done}")
    return done["tokens"]


def documents_through(url: str, docs: list[str], streams: int) -> float:
    """Tokens/s of ``docs`` through the route, ``streams`` at a time."""
    from concurrent.futures import ThreadPoolExecutor

    t = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        tokens = sum(pool.map(lambda d: stream_document(url, d), docs))
    return tokens / (time.perf_counter() - t)


def sentence_mode(docs: list[str]) -> float:
    """Tokens/s of the same text in sentence mode, in-process (a line a sentence)."""
    from elmo_service.embedder import Embedder

    emb = Embedder.load(MODEL)
    sents = [s.strip() + "." for d in docs for s in d.split(".") if s.strip()]
    emb.embed(sents[:32])
    t = time.perf_counter()
    tokens = sum(len(x.tokens) for x in emb.embed(sents))
    return tokens / (time.perf_counter() - t)


def embed_file_documents(docs: list[str], tmp: Path) -> float:
    """Tokens/s of the command (its start and model load included), a line a document."""
    src, out = tmp / "docs.txt", tmp / "docs.h5"
    src.write_text("\n".join(docs) + "\n")
    exe = Path(sys.executable).with_name("elmo-service")
    t = time.perf_counter()
    subprocess.run(
        [str(exe), "embed-file", "--model", str(MODEL), "--documents", "--average", "--quiet",
         str(src), str(out)], check=True,
    )  # fmt: skip
    seconds = time.perf_counter() - t
    from elmo_service.document import tokenize_document
    from elmo_service.embedder import Embedder

    emb = Embedder.load(MODEL)  # a document's tokens (no per-sentence limit applies to it)
    return sum(len(tokenize_document(emb.tokenizer, d, max_tokens=None)) for d in docs) / seconds


def part_c(q: bool, tmp: Path) -> list[tuple]:
    n_docs, size, big = (8, 200, 2_000) if q else (200, 2_000, 200_000)
    docs = [prose_words(size + k) for k in range(n_docs)]
    one = [prose_words(big)]
    srv = Server(MODEL, None, tmp / "c", max_document_streams=8)
    rows = []
    try:
        srv.wait_ready()
        url = f"http://127.0.0.1:{srv.port}"
        route = documents_through(url, docs, 8)  # sides alternate: route, file, sentences
        sent = sentence_mode(docs)
        # absolute figures too: a ratio's sides move with the kernels (the route's and the
        # sentence mode's) and with the machine between the two measurements
        print(f"  (c) route {route:,.0f} tok/s, sentence mode {sent:,.0f} tok/s", flush=True)
        rows.append(("c", "200 docs x 2k, 8 streams / sentence mode", route / sent, ">= 0.9",
                     route / sent >= 0.9))  # fmt: skip
        file = embed_file_documents(docs, tmp)
        sent = sentence_mode(docs)
        print(f"  (c) embed-file {file:,.0f} tok/s, sentence mode {sent:,.0f} tok/s", flush=True)
        rows.append(("c", "embed-file --documents / sentence mode", file / sent, ">= 0.9",
                     file / sent >= 0.9))  # fmt: skip
        long = documents_through(url, one, 1)
        sent = sentence_mode(one)
        print(f"  (c) one long document {long:,.0f} tok/s, sentence mode {sent:,.0f} tok/s")
        rows.append(("c", "one 200k-token document / sentence mode", long / sent, ">= 0.65",
                     long / sent >= 0.65))  # fmt: skip
    finally:
        srv.stop()
    return rows


def part_d(q: bool, tmp: Path) -> list[tuple]:
    n, size, seconds = (32, 3_000 if q else 20_000, 1.0 if q else 8.0)
    srv = Server(MODEL, None, tmp / "d", max_document_streams=n)
    try:
        srv.wait_ready()
        url = f"http://127.0.0.1:{srv.port}"
        idle = interactive_p99(srv.port, seconds)[0]
        rss0 = rss_mb(srv.proc.pid)
        # the streams open and stay open: each client reads nothing until released, so
        # every document holds its slot (pass 1 runs; pass 2 waits for its reader)
        opened, release, threads = threading.Semaphore(0), threading.Event(), []

        def hold(text: str) -> None:
            with (
                httpx.Client(timeout=3600) as c,
                c.stream("POST", url + "/v1/embed/document", json={"document": text, **MIX}) as r,
            ):
                opened.release()
                release.wait()
                for _ in r.iter_lines():
                    pass

        for k in range(n):
            t = threading.Thread(target=hold, args=(prose_words(size + k),), daemon=True)
            t.start()
            threads.append(t)
        for _ in range(n):
            opened.acquire(timeout=600)
        over = httpx.post(url + "/v1/embed/document", json={"document": "one more"}, timeout=60)
        busy = interactive_p99(srv.port, seconds)[0]
        rss1 = max(rss_mb(srv.proc.pid), rss0)
        release.set()
        for t in threads:
            t.join(3600)
    finally:
        srv.stop()
    ok429 = over.status_code == 429 and "retry-after" in over.headers
    return [
        ("d", "interactive p99 while 32 documents stream / idle", busy / idle, "<= 3",
         busy / idle <= 3.0),
        ("d", "server RSS growth (MB)", rss1 - rss0, "< 300", rss1 - rss0 < 300),
        ("d", "the 33rd stream: 429 with Retry-After", float(over.status_code), "429", ok429),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="each part tiny (seconds)")
    ap.add_argument("--parts", default="abcd", help="which parts to run (default abcd)")
    args = ap.parse_args(argv)
    print(f"CPU: {fair.cpu_model()}; ISA: {fair.isa()}; cores: {os.cpu_count()}")
    print(f"load average at start: {load()}")
    parts = {"a": part_a, "b": part_b, "c": part_c, "d": part_d}
    rows: list[tuple] = []
    with tempfile.TemporaryDirectory(prefix="bench-targets-") as d:
        for p in args.parts:
            print(f"part ({p}) ...", flush=True)
            (Path(d) / p).mkdir()
            rows += parts[p](args.quick, Path(d) / p)
    print(f"load average at end: {load()}")
    print(f"\n{'part':<5}{'target':<66}{'measured':>12}  {'bound':<9}result")
    for part, name, value, bound, ok in rows:
        print(f"{part:<5}{name:<66}{value:>12.3f}  {bound:<9}{'pass' if ok else 'FAIL'}")
    if args.quick:
        print("(--quick: tiny parts, the figures mean nothing)")
        return 0
    return 0 if all(r[4] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
