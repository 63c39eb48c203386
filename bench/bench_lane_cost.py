"""What a paced interactive client costs the batch lane, and where (target b of the one-door
issue): 12 closed-loop batch clients alone, and beside one client posting 20 requests a
second of one sentence each, as

* ``embed-i``: ``/v1/embed``, the default (interactive) priority: the express thread;
* ``embed-b``: the same requests with ``"priority": "batch"``: they join the batch lane;
* ``tokenize``: TEI's ``/tokenize``: HTTP and tokenization, no model.

Phases rotate within each round and every phase sends sentences of its own (no cache hits).
Per phase: the batch clients' tokens/s, and from the server's /metrics its model calls
(batches, of which one-sentence ones) and its CPU time. A real server, default settings
(``SERVER_SETTINGS='{"batch_nice": 0}'`` to change one)::

    .venv/bin/python bench/bench_lane_cost.py [--rounds 3] [--seconds 8] [--kinds none,embed-i]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import fair  # noqa: E402
from bench.bench_lanes import interactive_client  # noqa: E402
from bench.bench_serve import Server, load_phase, make_sentences  # noqa: E402

MODEL = REPO / "models" / "default"
MIX = {"output": "mix", "encoding": "base64"}
RATE = 20.0
# what the paced client posts: (path, the body of one sentence)
KINDS = {
    "none": None,
    "embed-i": ("/v1/embed", lambda s: {"sentences": [s], **MIX}),
    "embed-b": ("/v1/embed", lambda s: {"sentences": [s], **MIX, "priority": "batch"}),
    "tokenize": ("/tokenize", lambda s: {"inputs": " ".join(s)}),
}
METRICS = re.compile(
    r"(elmo_batch_duration_seconds_count|elmo_batch_sentences_bucket\{le=\"1.0\"\}) ([0-9.e+]+)"
)


def calls(port: int) -> tuple[float, float]:
    """The server's model calls so far, and how many of them held one sentence."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        found = dict(METRICS.findall(r.read().decode()))
    return float(found.get("elmo_batch_duration_seconds_count", 0)), float(
        found.get('elmo_batch_sentences_bucket{le="1.0"}', 0)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"of {', '.join(KINDS)}")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    if "none" not in kinds or not set(kinds) <= set(KINDS):
        ap.error(f"--kinds: 'none' and any of {', '.join(KINDS)}")
    overrides = json.loads(os.environ.get("SERVER_SETTINGS", "{}"))
    print(f"CPU: {fair.cpu_model()}; ISA: {fair.isa()}; cores: {os.cpu_count()}")
    print(f"load at start: {os.getloadavg()}; server settings: defaults + {overrides}")
    srv = Server(MODEL, None, Path(tempfile.mkdtemp()), **overrides)
    batch = {**MIX, "priority": "batch"}
    seeds = iter(range(500, 10**6))
    tput: dict[str, list[float]] = {k: [] for k in kinds}
    lat: dict[str, list[float]] = {k: [] for k in kinds}
    try:
        srv.wait_ready()
        # the first batch-lane load compiles and fills the kernel caches: not a phase
        asyncio.run(
            load_phase(srv.port, 12, 4.0, make_sentences(20_000, next(seeds)), 4, batch, True)
        )
        for r in range(args.rounds):
            for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
                many, out = make_sentences(50_000, seed=next(seeds)), {}

                def flood(many=many, out=out) -> None:
                    out["b"] = asyncio.run(
                        load_phase(srv.port, 12, args.seconds, many, 4, batch, True)
                    )

                (n0, ones0), cpu0 = calls(srv.port), fair.cpu_seconds(srv.proc.pid)
                t = threading.Thread(target=flood)
                t.start()
                if KINDS[kind] is not None:
                    stop = time.perf_counter() + args.seconds
                    few = make_sentences(2_000, seed=next(seeds))
                    path, body = KINDS[kind]
                    got, _ = asyncio.run(interactive_client(srv.port, stop, few, RATE, path, body))
                    lat[kind] += got
                t.join()
                tput[kind].append(out["b"]["tokens_per_s"])
                (n1, ones1), cpu1 = calls(srv.port), fair.cpu_seconds(srv.proc.pid)
                print(
                    f"  round {r} {kind:9s} batch clients {tput[kind][-1]:7.0f} tokens/s; model "
                    f"calls {n1 - n0:.0f} ({ones1 - ones0:.0f} of one sentence); server CPU "
                    f"{cpu1 - cpu0:.1f} s",
                    flush=True,
                )
    finally:
        srv.stop()
    alone = statistics.median(tput["none"])
    for kind in kinds:
        p99 = 1e3 * statistics.quantiles(lat[kind], n=100)[98] if len(lat[kind]) > 1 else None
        print(
            f"{kind:9s} batch tokens/s median {statistics.median(tput[kind]):7.0f} = "
            f"{statistics.median(tput[kind]) / alone:.3f} of alone"
            + (f"; paced client p99 {p99:.1f} ms" if p99 else "")
        )
    print(f"load at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
