"""``embed-bulk`` against ``embed-file`` as users run them: the two commands, end to end,
their defaults (all layers; ``embed-bulk`` starts its own local Ray cluster), interleaved
(the order alternates by round), and where ``embed-bulk``'s wall time goes (docs/bulk.md).

    PYTHONPATH=$PWD .venv/bin/python bench/bench_bulk_cli.py --sentences 20000 --rounds 2
    PYTHONPATH=$PWD .venv/bin/python bench/bench_bulk_cli.py --phases 4000   # the profile

Per command: wall, and CPU seconds of the command and every process under it (``/proc``,
sampled every 0.2 s: the Ray processes included); on a shared machine the CPU figure is the
fairer one (it does not count the time another tenant held the core). ``--phases N`` runs
``run_bulk`` in this process on N sentences and prints when Ray's start, each actor's first
shard and each shard's end came.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
USER_OMP_WAIT = os.environ.get("OMP_WAIT_POLICY")  # bench_bulk's import sets PASSIVE

from bench_bulk import TreeCPU, sentences  # noqa: E402


def machine() -> str:
    import torch

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    isa = [n for f, n in (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "AVX512_BF16"), ("amx_tile", "AMX")) if f" {f}" in flags]  # fmt: skip
    model = next((x.split(":", 1)[1].strip() for x in flags.splitlines() if x.startswith("model name")), platform.processor())  # fmt: skip
    return (
        f"{model}, {os.cpu_count()} CPUs, {'/'.join(isa) or 'no AVX2'}, torch {torch.__version__}, "
        f"load {os.getloadavg()[0]:.1f}"
    )


def run(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    t0 = time.perf_counter()
    with TreeCPU() as tree:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {p.stderr[-2000:]}")
    return wall, tree.seconds


def compare(n: int, rounds: int, work: Path) -> None:
    corpus = work / "in.txt"
    corpus.write_text("\n".join(sentences(n)) + "\n")
    cli = str(Path(sys.executable).parent / "elmo-service")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OMP_NUM_THREADS", None)  # each command sets its own, as for a user
    if USER_OMP_WAIT is None:  # nor does a user set OpenMP's spin: the commands choose it
        env.pop("OMP_WAIT_POLICY", None)
    sides = {
        "embed-file": [cli, "embed-file", str(corpus), str(work / "out.hdf5"), "--quiet"],
        "embed-bulk": [cli, "embed-bulk", str(corpus), "--out", str(work / "out"), "--quiet"],
    }
    got: dict[str, list[tuple[float, float]]] = {k: [] for k in sides}
    for r in range(rounds):
        for name in ["embed-bulk", "embed-file"][:: 1 if r % 2 == 0 else -1]:  # alternating
            shutil.rmtree(work / "out", ignore_errors=True)
            (work / "out.hdf5").unlink(missing_ok=True)
            load = os.getloadavg()[0]
            wall, cpu = run(sides[name], env)
            got[name].append((wall, cpu))
            print(f"round {r} {name}: wall {wall:.1f} s, CPU {cpu:.1f} s (load {load:.1f})", flush=True)  # fmt: skip
    for r in range(rounds):
        (fw, fc), (bw, bc) = got["embed-file"][r], got["embed-bulk"][r]
        print(f"round {r}: embed-bulk / embed-file  wall {fw / bw:.2f}x, CPU {fc / bc:.2f}x")


def phases(n: int, work: Path) -> None:
    import ray

    from elmo_bulk import BulkOptions, run_bulk

    corpus = work / "in.txt"
    corpus.write_text("\n".join(sentences(n)) + "\n")
    t0, marks = time.time(), []
    real_init = ray.init

    def init(*a, **k):
        marks.append(("ray.init starts", time.time() - t0))
        try:
            return real_init(*a, **k)
        finally:
            marks.append(("ray.init done", time.time() - t0))

    ray.init = init
    s = run_bulk(
        [corpus],
        work / "out",
        ROOT / "models" / "default",
        BulkOptions(),
        progress=False,
        log=lambda line: marks.append((line[:50], time.time() - t0)),
    )
    marks.append(("run_bulk returned", time.time() - t0))
    for r in s.results:
        marks.append((f"shard {r.shard}: first line ({r.worker})", r.started - t0))
        marks.append((f"shard {r.shard}: written ({r.tokens} tokens, {r.cpu_s:.1f} CPU-s)", r.finished - t0))  # fmt: skip
    for what, t in sorted(marks, key=lambda m: m[1]):
        print(f"{t:7.1f} s  {what}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sentences", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--phases", type=int, default=0, metavar="N", help="profile run_bulk on N sentences instead")  # fmt: skip
    args = p.parse_args()
    print(machine(), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-bulk-cli-") as tmp:
        if args.phases:
            phases(args.phases, Path(tmp))
        else:
            compare(args.sentences, args.rounds, Path(tmp))
    print(f"load at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
