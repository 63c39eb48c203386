"""What one request costs the server's event loop, by route: the CPU time of the server's
main thread (the event loop: HTTP, routing, validation, tokenization, the cache, the answer)
per request, from /proc, against a real ``elmo-service serve`` with default settings.

One client on a keep-alive connection, one request at a time, so the event loop does nothing
else. Target (a) of #54 (16 closed-loop clients against in-process batches of 16) is bounded
by it: all 16 clients wait for the same batch, so their answers and their next requests pass
through the event loop one after the other while the model waits (docs/benchmarks.md).

    .venv/bin/python bench/bench_request_cost.py            # ~1 min, a quiet machine
    .venv/bin/python bench/bench_request_cost.py --n 300    # quicker
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import sys
import tempfile
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import fair  # noqa: E402
from bench.bench_serve import Server, make_sentences  # noqa: E402

MIX = {"output": "mix", "encoding": "base64"}


def cases(
    sentences: list[list[str]], r: int, n: int
) -> dict[str, tuple[str, str, list[bytes | None]]]:
    """name -> (method, path, bodies) for round ``r`` of ``n`` requests: the cached cases cycle
    over 50 bodies (warmed first); the new ones get sentences of their own (20 to warm up)."""
    few = sentences[:50]
    fresh = [sentences[50 + (2 * r + k) * (n + 20) :][: n + 20] for k in (0, 1)]
    return {
        "GET /healthz": ("GET", "/healthz", [None]),
        "POST /tokenize (TEI)": (
            "POST", "/tokenize", [orjson.dumps({"inputs": " ".join(s)}) for s in few],
        ),
        "POST /v1/embed, cached, words": (
            "POST", "/v1/embed", [orjson.dumps({"sentences": [s], **MIX}) for s in few],
        ),
        "POST /v1/embed, cached, text": (
            "POST", "/v1/embed", [orjson.dumps({"sentences": [" ".join(s)], **MIX}) for s in few],
        ),
        "POST /v1/embed, new sentences": (
            "POST", "/v1/embed", [orjson.dumps({"sentences": [s], **MIX}) for s in fresh[0]],
        ),
        "POST /v1/embeddings (OpenAI), new": (
            "POST", "/v1/embeddings",
            [orjson.dumps({"input": " ".join(s), "model": "default"}) for s in fresh[1]],
        ),
    }  # fmt: skip


def measure(port: int, pid: int, method: str, path: str, bodies: list, n: int) -> float:
    """Event-loop CPU milliseconds per request over ``n`` requests (after a warm pass)."""
    conn = http.client.HTTPConnection("127.0.0.1", port)
    headers = {"content-type": "application/json"}

    def one(i: int) -> None:
        conn.request(method, path, bodies[i % len(bodies)], headers)
        r = conn.getresponse()
        body = r.read()
        if r.status != 200:
            raise SystemExit(f"{method} {path}: {r.status} {body[:200]!r}")

    cached = len(bodies) < n
    for i in range(min(len(bodies), 100) if cached else 20):
        one(i)
    start = 0 if cached else 20
    c0 = fair.cpu_seconds(pid, pid)
    for i in range(start, start + n):
        one(i)
    conn.close()
    return 1e3 * (fair.cpu_seconds(pid, pid) - c0) / n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1500, help="requests per case and round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    print("\n".join(fair.header(1)))
    sentences = make_sentences(50 + 2 * args.rounds * (args.n + 20), seed=5)
    with tempfile.TemporaryDirectory(prefix="bench-request-cost-") as tmp:
        srv = Server(REPO / "models" / "default", None, Path(tmp))
        try:
            srv.wait_ready()
            results: dict[str, list[float]] = {}
            for r in range(args.rounds):  # cases alternate within each round
                for name, (method, path, bodies) in cases(sentences, r, args.n).items():
                    ms = measure(srv.port, srv.proc.pid, method, path, bodies, args.n)
                    results.setdefault(name, []).append(ms)
        finally:
            srv.stop()
    print(f"\nevent-loop CPU per request (median of {args.rounds} rounds of {args.n}):")
    for name, got in results.items():
        runs = ", ".join(f"{x:.3f}" for x in got)
        print(f"  {name:32s} {statistics.median(got):6.3f} ms  ({runs})")
    print(fair.footer())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
