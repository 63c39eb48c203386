"""Is the biLSTM loop worth splitting across the cores by direction?

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_step_loop.py     # ~2 min

The two directions are independent for every layer, so each core can run
one direction's whole stack with no synchronisation per step. Measured on the
AllenNLP-small shape (LSTM 1024/128, 2 layers, 22 steps: a 20-word sentence
with its boundary tokens), side by side.

With several rows (``--batch``, default 2 8 32; sentences of equal length):
``joint``, both directions on the calling thread with all torch threads per
op, against ``split``, each direction on its own worker thread with half of
them (``BiLstmKernel`` as shipped; ``SPLIT_MIN_ROWS``).

At batch 1 ``BiLstmKernel._layer_single`` runs both directions in one step
loop: one batched matmul per step over stacked weights, each op on both
directions' values. Sides:

* ``stacked``: the kernel as shipped;
* ``one direction``: one direction's stack alone, the same ops per step on
  one direction's weights; the best a two-core split could do with torch ops;
* ``threads``: that loop for each direction, one of them on a second Python
  thread (torch releases the GIL inside each op, not between them).

A split by direction gains only if ``threads`` beats ``stacked``; the gap
between ``one direction`` and ``stacked`` is its ceiling.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import elmo_service.bilstm as bilstm  # noqa: E402
from elmo_service.bilstm import BiLstmKernel  # noqa: E402
from elmo_service.config import BiLMConfig  # noqa: E402
from elmo_service.lstm import LstmLayer  # noqa: E402


def one_direction(kernel: BiLstmKernel, d: int, x: torch.Tensor) -> list[torch.Tensor]:
    """Direction ``d``'s layers for one sentence ``x [T, P]`` -> per layer ``[T, P]``:
    the kernel's per-direction loop (what a split runs on each worker) at one row."""
    t = x.shape[0]
    outs = [x.new_zeros(2, t, 1, x.shape[1]) for _ in kernel.w_ih]
    kernel._direction_stack(d, x[:, None], [1] * t, list(range(t + 1)), None, outs, False)
    return [out[d, :, 0] for out in outs]


def timed(fn, calls: int, rounds: int) -> float:
    """Median over ``rounds`` of the mean ms per call."""
    for _ in range(calls // 10 + 1):
        fn()
    per_round = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_round.append((time.perf_counter() - t0) / calls * 1e3)
    return statistics.median(per_round)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, nargs="*", default=[2, 8, 32], help="rows (besides 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = BiLMConfig(lstm_dim=1024, projection_dim=128, n_layers=2, cell_clip=3.0, proj_clip=3.0)
    kernel = BiLstmKernel(
        [(LstmLayer(128, cfg), LstmLayer(128, cfg)) for _ in range(2)], residual=True
    )
    steps = 22
    x = torch.randn(2, steps, 1, 128)
    pool = ThreadPoolExecutor(1)

    def threads() -> list[list[torch.Tensor]]:
        other = pool.submit(one_direction, kernel, 1, x[1, :, 0])
        return [one_direction(kernel, 0, x[0, :, 0]), other.result()]

    with torch.no_grad():
        ref = kernel(x, [1] * steps)
        split = threads()
        diff = max(
            (ref[layer][d, :, 0] - split[d][layer]).abs().max().item()
            for layer in range(2)
            for d in (0, 1)
        )
        sides = {
            "stacked": lambda: kernel(x, [1] * steps),
            "one direction": lambda: one_direction(kernel, 0, x[0, :, 0]),
            "threads": threads,
        }
        ms = {name: timed(fn, args.calls, args.rounds) for name, fn in sides.items()}
    print(f"torch threads {args.threads}; batch 1; max |threads - stacked| {diff:.1e}")
    for name, t in ms.items():
        print(f"  {name:14s} {t:6.2f} ms  ({t / ms['stacked']:.2f}x stacked)")
    for rows in args.batch:
        joint_ms, split_ms, diff = joint_vs_split(kernel, rows, steps, args.calls, args.rounds)
        print(
            f"batch {rows:3d}: joint {joint_ms:7.2f} ms, split {split_ms:7.2f} ms "
            f"({joint_ms / split_ms:.2f}x faster); max |split - joint| {diff:.1e}"
        )


def joint_vs_split(
    kernel: BiLstmKernel, rows: int, steps: int, calls: int, rounds: int
) -> tuple[float, float, float]:
    """ms per call with the directions on the calling thread and on two workers, and the
    largest difference between their outputs."""
    x = torch.randn(2, steps, rows, 128)
    active = [rows] * steps

    def split() -> list[torch.Tensor]:
        return kernel(x, active)

    def joint() -> list[torch.Tensor]:
        split_at = bilstm.SPLIT_MIN_ROWS
        bilstm.SPLIT_MIN_ROWS = 1 << 30
        try:
            return kernel(x, active)
        finally:
            bilstm.SPLIT_MIN_ROWS = split_at

    with torch.no_grad():
        diff = max((a - b).abs().max().item() for a, b in zip(joint(), split(), strict=True))
        n = max(calls // rows, 10)
        return timed(joint, n, rounds), timed(split, n, rounds), diff


if __name__ == "__main__":
    main()
