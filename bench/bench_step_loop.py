"""Is the biLSTM loop worth splitting across the cores by direction?

    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_step_loop.py                   # ~2 min
    OMP_NUM_THREADS=2 .venv/bin/python bench/bench_step_loop.py --shape original --batch

The two directions are independent for every layer, so each core can run
one direction's whole stack with no synchronisation per step. Measured on the
AllenNLP-small shape (LSTM 1024/128, 2 layers; ``--shape original``: 4096/512),
22 steps (a 20-word sentence with its boundary tokens), side by side.

At batch 1 (one sentence), sides:

* ``torch, stacked``: the loop that served one sentence before the native
  one, kept here as the baseline: both directions in one loop of torch ops,
  one batched matmul per step over stacked weights;
* ``native, 1 thread``: ``elmo_service/native_step.py`` (numba, GIL
  released), the two directions one after the other on this thread;
* ``native, split``: ``BiLstmKernel`` as shipped: the native loop of each
  direction on its own worker thread (``direction_pool``), at once.

With several rows (``--batch``, default 2 8 32; sentences of equal length):
``caller``, both directions on the calling thread, one after the other, with all torch threads per
op, against ``split``, each direction on its own worker thread with half of
them (``BiLstmKernel`` as shipped; ``SPLIT_MIN_ROWS``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import elmo_service.kernels.tuning as tuning  # noqa: E402
from elmo_service.config import BiLMConfig  # noqa: E402
from elmo_service.kernels.bilstm import BiLstmKernel  # noqa: E402
from elmo_service.lstm import LstmLayer  # noqa: E402


def torch_stacked(kernel: BiLstmKernel, x: torch.Tensor) -> list[torch.Tensor]:
    """The torch loop that served one sentence before the native one: ``x [2, T, 1, P]``
    -> per layer ``[2, T, 1, P]``, both directions per op, stacked recurrent weights."""
    _, t, _, p = x.shape
    outs = []
    for layer, pair in enumerate(kernel.layers):
        w_hh_t, w_proj_t = (torch.stack([torch.from_numpy(d.row[i]) for d in pair]) for i in (0, 1))
        c = w_proj_t.shape[1]
        cc2, pc = pair[0].cell_clip2, pair[0].proj_clip
        xg = torch.stack([d.w_ih(x[k].reshape(t, p)) for k, d in enumerate(pair)])
        out = x.new_zeros(2, t, 1, p)
        h = x.new_zeros(2, 1, p)
        c2 = x.new_zeros(2, 1, c)
        for s in range(t):
            m = torch_cell(torch.baddbmm(xg[:, s : s + 1], h, w_hh_t), c2, c, cc2)
            h = torch.bmm(m, w_proj_t)
            if pc:
                h.clamp_(-pc, pc)
            out[:, s] = h
        if kernel.residual and layer > 0:
            out.add_(x)
        outs.append(out)
        x = out
    return outs


def torch_cell(gates: torch.Tensor, c2: torch.Tensor, c: int, cc2: float) -> torch.Tensor:
    """The element-wise part of that loop's step, as torch ops (the kernel's before it
    went native): gates ``[..., n, 4C]`` (g rows doubled), doubled cell ``c2`` updated
    in place -> ``o * tanh(c) / 2``."""
    gates.sigmoid_()  # i, f, o, sigmoid(2g)
    i, f, o, g = gates.unflatten(-1, (4, c)).unbind(-2)
    c2.mul_(f).sub_(i, alpha=2.0).addcmul_(i, g, value=4.0)
    if cc2:
        c2.clamp_(-cc2, cc2)
    return torch.sigmoid(c2).sub_(0.5).mul_(o)


def native_one_thread(kernel: BiLstmKernel, x: torch.Tensor) -> list[torch.Tensor]:
    """The native loop of both directions, one after the other, on this thread."""
    outs = [x.new_zeros(x.shape) for _ in kernel.layers]
    for d in (0, 1):
        kernel._native_stack(d, x[d, :, 0], outs)
    return outs


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
    ap.add_argument("--shape", choices=["small", "original"], default="small")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lstm, proj = (1024, 128) if args.shape == "small" else (4096, 512)
    cfg = BiLMConfig(lstm_dim=lstm, projection_dim=proj, n_layers=2, cell_clip=3.0, proj_clip=3.0)
    kernel = BiLstmKernel(
        [(LstmLayer(proj, cfg), LstmLayer(proj, cfg)) for _ in range(2)], residual=True
    )
    steps = 22
    x = torch.randn(2, steps, 1, proj)
    with torch.no_grad():
        sides = {
            "torch, stacked": lambda: torch_stacked(kernel, x),
            "native, 1 thread": lambda: native_one_thread(kernel, x),
            "native, split": lambda: kernel(x, [1] * steps),
        }
        ref = sides["torch, stacked"]()
        diff = {
            name: max((a - b).abs().max().item() for a, b in zip(ref, fn(), strict=True))
            for name, fn in sides.items()
        }
        calls = args.calls if args.shape == "small" else max(args.calls // 20, 5)
        ms = {name: timed(fn, calls, args.rounds) for name, fn in sides.items()}
    print(f"shape {args.shape}, torch threads {args.threads}; batch 1, {steps} steps")
    for name, t in ms.items():
        print(
            f"  {name:17s} {t:7.2f} ms  ({ms['torch, stacked'] / t:.2f}x faster than torch, "
            f"stacked; max diff {diff[name]:.1e})"
        )
    for rows in args.batch:
        caller_ms, split_ms, diff = caller_vs_split(kernel, rows, steps, calls, args.rounds)
        print(
            f"batch {rows:3d}: caller {caller_ms:7.2f} ms, split {split_ms:7.2f} ms "
            f"({caller_ms / split_ms:.2f}x faster); max |split - caller| {diff:.1e}"
        )


def caller_vs_split(
    kernel: BiLstmKernel, rows: int, steps: int, calls: int, rounds: int
) -> tuple[float, float, float]:
    """ms per call with the directions on the calling thread and on two workers, and the
    largest difference between their outputs."""
    x = torch.randn(2, steps, rows, kernel.layers[0][0].w_proj.n)
    active = [rows] * steps

    def split() -> list[torch.Tensor]:
        return kernel(x, active)

    def caller() -> list[torch.Tensor]:
        split_at = tuning.SPLIT_MIN_ROWS
        tuning.SPLIT_MIN_ROWS = 1 << 30
        try:
            return kernel(x, active)
        finally:
            tuning.SPLIT_MIN_ROWS = split_at

    with torch.no_grad():
        diff = max((a - b).abs().max().item() for a, b in zip(caller(), split(), strict=True))
        n = max(calls // rows, 10)
        return timed(caller, n, rounds), timed(split, n, rounds), diff


if __name__ == "__main__":
    main()
