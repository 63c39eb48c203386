"""``embed-bulk`` against in-process ``embed-file`` on the same cores, in one run (docs/bulk.md).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/bench_bulk.py          # 1,600 + 20,000
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/bench_bulk.py --large 0  # 1,600 only

The same sentences (English prose from Python's help topics, repeated past its ~2,400),
the bundled model, for two outputs: all layers per token (``embed-file --all``,
``embed-bulk --output layers``) and a mix (``embed-file --average`` per token;
``embed-bulk --output mix --pooling mean``, the average mix pooled per sentence).
Every pair uses the same cores: ``embed-file --threads W`` against ``embed-bulk`` with
N actors x T threads, N x T = W (a local Ray cluster of W CPUs, started once by this
script: its start-up is outside every row; the default ``--shard-rows``).

* ``steady``: ``embed-file`` without its model load (timed alone first); ``embed-bulk``
  from the first shard's start to the last shard's write (the actors' model loads
  excluded; tokenization and Parquet writes included).
* ``wall``: the whole command (``embed-bulk``: the scan, the actors' start and loads,
  the writes; ``embed-file``: its model load and the HDF5 file).
* ``CPU``: CPU seconds of everything the command ran: this process's (``getrusage``)
  plus, for ``embed-bulk``, every Ray process under it (``/proc``, sampled every 0.2 s).
  ``tokens / CPU-s`` is the fairer figure on a shared machine: it does not count the
  time another tenant held the core. ``steady CPU``: ``embed-file``'s without its model
  load; ``embed-bulk``'s actors' over their shards (each shard reports its process's).

The ratios are ``embed-bulk / embed-file`` of the pair: ``per core`` (steady tokens/s of
the same W cores), ``wall``, ``CPU`` (tokens per CPU-second, whole command) and
``steady CPU`` (tokens per CPU-second, steady: the per-core cost of the work itself).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning collapses on shared cores

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import fair  # noqa: E402
from elmo_bulk import BulkOptions, run_bulk  # noqa: E402
from elmo_service.artifact import BUNDLED_MODELS_DIR  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def sentences(n: int) -> list[str]:
    """English prose from Python's own help topics (shipped with CPython): ~5-40 words,
    repeated in order past the ~2,400 there are."""
    from pydoc_data.topics import topics

    text = " ".join(topics[k] for k in sorted(topics))
    found = [
        s
        for s in re.split(r"(?<=[.!?])\s+", re.sub(r"\s+", " ", text))
        if 5 <= len(s.split()) <= 40 and not re.search(r"[{}\[\]=<>]|\.\.\.", s)
    ]
    return list(itertools.islice(itertools.cycle(found), n))


def own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class TreeCPU:
    """CPU seconds of this process's descendants (the Ray processes) over a window."""

    def __init__(self) -> None:
        self.first: dict[tuple[int, str], float] = {}
        self.last: dict[tuple[int, str], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self, first: bool) -> None:
        kids: dict[int, list[tuple[int, str, float]]] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                f = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            cpu = (int(f[11]) + int(f[12])) / TICK
            kids.setdefault(int(f[1]), []).append((int(name), f[19], cpu))
        todo = [os.getpid()]
        while todo:
            for pid, start, cpu in kids.get(todo.pop(), []):
                todo.append(pid)
                key = (pid, start)
                if first:
                    self.first[key] = cpu
                self.first.setdefault(key, 0.0)  # born in the window: all of it counts
                self.last[key] = cpu

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            self._sample(False)

    def __enter__(self) -> TreeCPU:
        self._sample(True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample(False)

    @property
    def seconds(self) -> float:
        return sum(self.last[k] - self.first[k] for k in self.last)


def embed_file(model: Path, corpus: Path, out: Path, threads: int, what: str) -> dict:
    """``elmo-service embed-file`` in this process; its model load timed alone first."""
    from elmo_cli.core import main as cli
    from elmo_service.embedder import Embedder

    c0, t0 = own_cpu(), time.perf_counter()
    emb = Embedder.load(model, threads=threads, device="cpu")
    load, load_cpu = time.perf_counter() - t0, own_cpu() - c0
    tokens = sum(len(t) for t in emb.tokenize(corpus.read_text().splitlines()))
    del emb
    argv = ["embed-file", str(corpus), str(out), "--model", str(model), "--quiet"]
    argv += [
        "--threads",
        str(threads),
        "--device",
        "cpu",
        "--all" if what == "layers" else "--average",
    ]
    c0, t0 = own_cpu(), time.perf_counter()
    assert cli(argv) == 0
    wall = time.perf_counter() - t0
    out.unlink()
    cpu = own_cpu() - c0
    return {
        "tokens": tokens,
        "steady_s": wall - load,
        "wall_s": wall,
        "cpu_s": cpu,
        "steady_cpu_s": cpu - load_cpu,
    }


def embed_bulk(model: Path, corpus: Path, out: Path, actors: int, threads: int, what: str) -> dict:
    opts = BulkOptions(output=what, pooling="mean" if what == "mix" else "none")
    c0, t0 = own_cpu(), time.perf_counter()
    with TreeCPU() as tree:
        s = run_bulk(
            [corpus],
            out,
            model,
            opts,
            actors=actors,
            threads=threads,
            progress=False,
            log=lambda _: None,
        )
    wall = time.perf_counter() - t0
    shutil.rmtree(out)
    per_actor: dict[str, int] = {}
    for r in s.results:
        per_actor[r.worker] = per_actor.get(r.worker, 0) + 1
    return {
        "tokens": s.tokens,
        "steady_s": s.embed_seconds,
        "wall_s": wall,
        "cpu_s": own_cpu() - c0 + tree.seconds,
        # the actors' CPU over their shards (all their threads; none before the shard code
        # reported it)
        "steady_cpu_s": sum(getattr(r, "cpu_s", float("nan")) for r in s.results),
        "shards": s.shards,
        "shards_per_actor": sorted(per_actor.values(), reverse=True),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=BUNDLED_MODELS_DIR / "default")
    p.add_argument("--small", type=int, default=1600, help="sentences of the small one (0: none)")
    p.add_argument("--large", type=int, default=20000, help="sentences of the large one (0: none)")
    p.add_argument("--cores", type=int, default=2, help="W: the cores each pair uses")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    args = p.parse_args()
    print("\n".join(fair.header(int(os.environ.get("OMP_NUM_THREADS", 1)))))

    import ray

    w = args.cores
    ray.init(num_cpus=w, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    work = Path(tempfile.mkdtemp(prefix="bench_bulk_"))
    rows = []
    load = [os.getloadavg()[0]]
    try:
        small = [[(1, (1, 1)), (w, (w, 1)), (w, (1, w))]] if args.small else []
        plans = [(args.small, what, pairs) for what in ("mix", "layers") for pairs in small]
        if args.large:
            plans += [(args.large, what, [(w, (w, 1))]) for what in ("mix", "layers")]
        for n, what, pairs in plans:
            corpus = work / f"corpus{n}.txt"
            if not corpus.exists():
                corpus.write_text("\n".join(sentences(n)) + "\n")
            for cores, (actors, threads) in pairs:
                base = embed_file(args.model, corpus, work / "out.hdf5", cores, what)
                bulk = embed_bulk(args.model, corpus, work / "out", actors, threads, what)
                load.append(os.getloadavg()[0])
                rows.append(
                    {
                        "sentences": n,
                        "output": what,
                        "cores": cores,
                        "actors": actors,
                        "threads": threads,
                        "embed_file": base,
                        "embed_bulk": bulk,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    print(
        f"\nmodel {args.model}; load average (1 min) {min(load):.1f}-{max(load):.1f} during the "
        f"run, {os.cpu_count()} cores"
    )
    print(
        "| sentences | output | cores | embed-bulk | embed-file tok/s steady | "
        "embed-bulk tok/s steady | per core | wall | tok/CPU-s file | tok/CPU-s bulk | CPU "
        "| steady CPU |"
    )
    print("|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        f, b = r["embed_file"], r["embed_bulk"]
        r["ratio_per_core"] = (b["tokens"] / b["steady_s"]) / (f["tokens"] / f["steady_s"])
        r["ratio_wall"] = (b["tokens"] / b["wall_s"]) / (f["tokens"] / f["wall_s"])
        r["ratio_cpu"] = (b["tokens"] / b["cpu_s"]) / (f["tokens"] / f["cpu_s"])
        r["ratio_steady_cpu"] = (b["tokens"] / b["steady_cpu_s"]) / (
            f["tokens"] / f["steady_cpu_s"]
        )
        print(
            f"| {r['sentences']:,} | {r['output']} | {r['cores']} | {r['actors']} x {r['threads']} "
            f"({b['shards']} shards: {'/'.join(map(str, b['shards_per_actor']))}) "
            f"| {f['tokens'] / f['steady_s']:,.0f} | {b['tokens'] / b['steady_s']:,.0f} "
            f"| {r['ratio_per_core']:.2f}x | {r['ratio_wall']:.2f}x "
            f"| {f['tokens'] / f['cpu_s']:,.0f} | {b['tokens'] / b['cpu_s']:,.0f} "
            f"| {r['ratio_cpu']:.2f}x | {r['ratio_steady_cpu']:.2f}x |"
        )
    if args.json:
        args.json.write_text(json.dumps({"load": load, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
