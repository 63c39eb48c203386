"""``embed-bulk`` on Ray Data against in-process ``embed-file``, in one run (docs/bulk.md).

    PYTHONPATH=$PWD .venv/bin/python bench/bench_bulk.py            # ~4 min on 2 cores
    PYTHONPATH=$PWD .venv/bin/python bench/bench_bulk.py --sentences 200 --model DIR

Tokens/s (model tokens, sentence markers not counted) for the same sentences, all layers
per token, one thread per worker:

* ``embed-file``: the command run in this process (``--all --threads 1``, HDF5 written),
  ``steady`` without its model load (timed on its own just before); run before and after
  the Ray rows, both reported, their mean is the base of the ratios;
* ``embed-bulk's shards, no Ray``: the actors' per-shard work (read, tokenize, embed,
  Parquet, sha256, manifest) in this process, load excluded: what Ray adds is the gap to
  the 1-actor row;
* ``embed-bulk, N actors``: a local Ray cluster of 2 CPUs, ``run_bulk`` into a fresh
  folder; ``steady`` counts from the first shard's start to the last shard's write
  (actor start-up and model load excluded; tokenization and the Parquet writes included),
  ``wall`` the whole call (scan, actor start-up, writes).

``per core`` divides by the actors (in-process uses one core). The machine may be shared:
compare the ratios within one run, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning collapses on shared cores

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elmo_service.artifact import BUNDLED_MODELS_DIR  # noqa: E402
from elmo_service.bulk import BulkOptions, run_bulk  # noqa: E402


def sentences(n: int) -> list[str]:
    """English prose from Python's own help topics (shipped with CPython): ~5-40 words."""
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics))
    out = []
    for s in re.split(r"(?<=[.!?])\s+", re.sub(r"\s+", " ", text)):
        if 5 <= len(s.split()) <= 40 and not re.search(r"[{}\[\]=<>]|\.\.\.", s):
            out.append(s)
        if len(out) == n:
            break
    return out


def in_process(model: Path, corpus: Path, out: Path) -> tuple[float, float, int]:
    """``elmo-service embed-file --all --threads 1`` run in this process: (seconds without
    the model load, whole seconds, model tokens). The load is timed on its own first."""
    from elmo_service.cli import main as cli
    from elmo_service.embedder import Embedder

    t0 = time.perf_counter()
    emb = Embedder.load(model, threads=1, device="cpu")
    load = time.perf_counter() - t0
    tokens = sum(len(t) for t in emb.tokenize(corpus.read_text().splitlines()))
    del emb
    argv = [
        "embed-file",
        str(corpus),
        str(out),
        "--model",
        str(model),
        "--threads",
        "1",
        "--device",
        "cpu",
        "--quiet",
    ]
    t0 = time.perf_counter()
    assert cli(argv) == 0
    whole = time.perf_counter() - t0
    out.unlink()
    return whole - load, whole, tokens


def shards_in_process(model: Path, corpus: Path, out: Path, shard_rows: int) -> tuple[float, int]:
    """embed-bulk's per-shard work without Ray: (seconds, tokens), the model load excluded."""
    from elmo_service.bulk import MANIFESTS, embed_shard, scan_inputs
    from elmo_service.embedder import Embedder

    emb = Embedder.load(model, threads=1, device="cpu")
    (out / MANIFESTS).mkdir(parents=True)
    opts = BulkOptions(shard_rows=shard_rows)
    t0 = time.perf_counter()
    tokens = sum(
        embed_shard(emb, s, opts, out, None, False).tokens
        for s in scan_inputs([corpus], shard_rows).shards
    )
    return time.perf_counter() - t0, tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=BUNDLED_MODELS_DIR / "default")
    p.add_argument("--sentences", type=int, default=1600)
    p.add_argument("--shard-rows", type=int, default=100)
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = p.parse_args()

    import ray

    lines = sentences(args.sentences)
    work = Path(tempfile.mkdtemp(prefix="bench_bulk_"))
    corpus = work / "corpus.txt"
    corpus.write_text("\n".join(lines) + "\n")
    rows = []
    try:
        sec, whole, tokens = in_process(args.model, corpus, work / "out.hdf5")
        rows.append(
            {
                "what": "embed-file (before)",
                "workers": 1,
                "tokens": tokens,
                "steady_s": sec,
                "wall_s": whole,
            }
        )
        sec, tokens = shards_in_process(args.model, corpus, work / "plain", args.shard_rows)
        rows.append(
            {
                "what": "embed-bulk's shards, no Ray",
                "workers": 1,
                "tokens": tokens,
                "steady_s": sec,
                "wall_s": sec,
            }
        )
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
        for actors in (1, 2):
            t0 = time.perf_counter()
            s = run_bulk(
                [corpus],
                work / f"out{actors}",
                args.model,
                BulkOptions(shard_rows=args.shard_rows),
                actors=actors,
                progress=False,
                log=lambda _: None,
            )
            t_first = min(r.started for r in s.results)
            spans: dict[str, list] = {}  # worker -> [first start, last end, shards]
            for r in s.results:
                w = spans.setdefault(r.worker, [r.started, r.finished, 0])
                w[0], w[1], w[2] = min(w[0], r.started), max(w[1], r.finished), w[2] + 1
            print(
                f"{actors} actor(s): "
                + "; ".join(
                    f"{k}: {n} shards, {a - t_first:.1f}-{b - t_first:.1f} s"
                    for k, (a, b, n) in spans.items()
                )
            )
            rows.append(
                {
                    "what": f"embed-bulk, {actors} actor{'s' * (actors > 1)}",
                    "workers": actors,
                    "tokens": s.tokens,
                    "steady_s": s.embed_seconds,
                    "wall_s": time.perf_counter() - t0,
                }
            )
        ray.shutdown()
        sec, whole, tokens = in_process(args.model, corpus, work / "out.hdf5")
        rows.append(
            {
                "what": "embed-file (after)",
                "workers": 1,
                "tokens": tokens,
                "steady_s": sec,
                "wall_s": whole,
            }
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)

    base = sum(r["tokens"] / r["steady_s"] for r in rows if r["what"].startswith("embed-file")) / 2
    load = os.getloadavg()
    print(
        f"model {args.model}, {len(lines)} sentences, {rows[0]['tokens']} tokens, "
        f"shards of {args.shard_rows}; load average {load[0]:.1f} {load[1]:.1f}"
    )
    print("| what | tokens/s steady | tokens/s wall | per core vs in-process |")
    print("|---|---:|---:|---:|")
    for r in rows:
        steady = r["tokens"] / r["steady_s"]
        r["per_core_ratio"] = steady / r["workers"] / base
        print(
            f"| {r['what']} | {steady:,.0f} | {r['tokens'] / r['wall_s']:,.0f} "
            f"| {r['per_core_ratio']:.2f}x |"
        )
    if args.json:
        args.json.write_text(json.dumps({"load": load, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
