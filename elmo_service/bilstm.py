"""The serving kernel of the biLSTM: both directions of a layer in one step loop.

    x [2, T, B, P] (direction, time, rows sorted longest first) --> per layer [2, T, B, P]

The same function as ``LstmLayer``'s inference kernel (``elmo_service/lstm.py``)
run for each direction and layer, with fewer, larger operations per step:

* a step is the recurrent matmul (the input gates added in the same call), the
  element-wise cell in one native call (``native_step.lstm_cell``, numba: ~8
  torch ops before, ~27 % of a 32-row step), and the projection matmul;
* weights are packed once per weight version (:class:`PackedLinear`: oneDNN
  reordered for several rows, ``W^T`` for a single row, int8 when asked) and
  pre-scaled so that no step multiplies by a constant: the g-gate rows of
  ``W_ih``, ``b`` and ``W_hh`` are doubled, so one sigmoid gives
  ``sigmoid(2g)``, and ``tanh(g) = 2 sigmoid(2g) - 1``; the cell is kept
  doubled (``c2 = 2c``, exact in floating point), so ``tanh(c) =
  2 sigmoid(c2) - 1``; and ``W_proj`` is doubled so the projection reads
  ``o * (sigmoid(c2) - 1/2) = o * tanh(c) / 2``. Scaling by 2 is exact, so
  these are the same numbers as the textbook formulas up to summation order
  and the sigmoid's last bit;
* the first layer's input matmul, hoisted over all steps, runs once per
  distinct token when the caller passes its token table (a batch of natural
  sentences repeats words and boundary tokens: 659 rows -> 257 at 32 sentences).

With two (or three) torch threads and two or more rows, the two directions run
on two worker threads, each with one thread and its direction's whole stack
of layers (the directions never meet before the output, so nothing
synchronises per step): each core runs its own matmuls without OpenMP's fork
and join around every op (``bench/bench_step_loop.py --batch``: 1.1-1.3x at
4-32 rows). A single sentence runs each direction's step loop in native code
(``elmo_service/native_step.py``, numba, GIL released), on the two workers
when there are (else one direction after the other): ~2x faster than a loop
of torch ops on the small shape.

Layers run one after the other, each input matmul hoisted over all steps
and computed for real rows only. Running layer l+1 one step behind layer l
in the same loop ("pipelining") is not done: at batch 1 the two recurrent
matmuls are most of a step (the weights stream from cache or memory), and
pipelining would move layer l+1's input matmul into the loop, adding its
weights to every step's traffic.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from elmo_service.lstm import LstmLayer
from elmo_service.native_step import lstm_cell, lstmp_row
from elmo_service.packed import PackedLinear


def _gate_scale(c: int, like: Tensor) -> Tensor:
    """``[4C]``: 1 for the i, f, o rows, 2 for the g rows."""
    s = like.new_ones(4 * c)
    s[3 * c :] = 2.0
    return s


class BiLstmKernel:
    """Kernel-layout weights of an L-layer biLSTM and its inference loop.

    ``layers``: per layer, the (forward, backward) :class:`LstmLayer` pair.
    ``weights``: "fp32", or "int8" for the matrices big enough to gain
    (:data:`~elmo_service.packed.INT8_MIN_ELEMENTS`; see :class:`PackedLinear`).
    """

    def __init__(
        self, layers: list[tuple[LstmLayer, LstmLayer]], residual: bool, weights: str = "fp32"
    ) -> None:
        first = layers[0][0]
        self.cell_dim, self.proj_dim = first.cell_dim, first.proj_dim
        self.cell_clip = float(first.cell_clip or 0.0)
        self.proj_clip = float(first.proj_clip or 0.0)
        self.residual = residual
        int8 = weights == "int8"
        c = self.cell_dim
        self.w_ih, self.w_hh, self.w_proj = [], [], []
        # both directions' recurrent weights, W_hh^T [2, P, 4C] and 2 W_proj^T [2, C, P],
        # as numpy views for the single-sentence native loop (W_hh^T is shared with
        # the per-direction kernels)
        self.single: list[tuple[np.ndarray, np.ndarray] | None] = []
        for pair in layers:
            scale = _gate_scale(c, pair[0].w_ih.weight)
            # the input matmuls always have several rows (all steps): oneDNN only
            self.w_ih.append(
                [
                    PackedLinear(
                        m.w_ih.weight * scale[:, None], m.w_ih.bias * scale, int8=int8
                    ).pack_now()
                    for m in pair
                ]
            )
            w_hh = torch.stack([m.w_hh.weight * scale[:, None] for m in pair])  # [2, 4C, P]
            w_proj = torch.stack([2.0 * m.w_proj.weight for m in pair])
            hh = [PackedLinear(w, int8=int8) for w in w_hh]
            w_hh_t = None
            if not hh[0].is_int8:
                w_hh_t = w_hh.transpose(1, 2).contiguous()
                for d, lin in enumerate(hh):
                    lin.use_transposed(w_hh_t[d])
                    lin.pack_now()  # W^T for one row, oneDNN for several
            proj = [PackedLinear(w, int8=int8) for w in w_proj]
            self.w_hh.append(hh)
            self.w_proj.append(proj)
            # the single-sentence loop is fp32 only: a sentence gets the same numbers alone
            single = None
            if w_hh_t is not None and not proj[0].is_int8:
                single = (
                    w_hh_t.detach().numpy(),
                    w_proj.transpose(1, 2).contiguous().detach().numpy(),
                )
            self.single.append(single)

    def __call__(
        self, x: Tensor, active: list[int], distinct: tuple[Tensor, Tensor] | None = None
    ) -> list[Tensor]:
        """``x [2, T, B, P]`` (time-major; row b of direction 1 is sentence b reversed
        within its length) -> each layer's output ``[2, T, B, P]``, zero past each
        row's length. ``active[t]``: rows still inside their sentence at step t.

        ``distinct``: optionally ``(table [U, P], index [2, T, B])`` with ``x ==
        table[index]`` at the real rows. Where that saves enough rows, the first
        layer's input matmul runs on the table and its gates are gathered (a batch
        of natural sentences repeats its frequent words and its boundary tokens).
        """
        t, b = x.shape[1], x.shape[2]
        if b == 1 and self.single[0] is not None:
            return self._single(x, active.count(1))
        # the input matmuls read only real rows: step s's rows are packed at
        # offset[s] (time-major, longest first, as a PackedSequence)
        offset = [0]
        for n in active:
            offset.append(offset[-1] + n)
        rows = None
        if offset[-1] < t * b:
            steps = torch.tensor(active, device=x.device)
            valid = torch.arange(b, device=x.device).unsqueeze(0) < steps.unsqueeze(1)  # [T, B]
            rows = valid.flatten().nonzero().squeeze(1)
        gather = None  # per direction, the real rows' index into the table
        if distinct is not None and distinct[0].shape[0] <= DISTINCT_AT_MOST * offset[-1]:
            table, index = distinct
            flat = index.reshape(2, -1)
            gather = (table, flat if rows is None else flat[:, rows])
        pool = direction_pool() if b >= SPLIT_MIN_ROWS else None
        outs = [x.new_zeros(2, t, b, x.shape[3]) for _ in self.w_ih]
        on_both_workers(
            pool, lambda d: self._direction_stack(d, x[d], active, offset, rows, outs, gather)
        )
        return outs

    def _single(self, x: Tensor, length: int) -> list[Tensor]:
        """One sentence, ``x [2, T, 1, P]`` with ``length`` real steps -> per layer
        ``[2, T, 1, P]``: each direction's layers in the native loop, the two
        directions on the two worker threads when there are (else one after the other)."""
        outs = [x.new_zeros(x.shape) for _ in self.w_ih]
        if length > 0:
            on_both_workers(
                direction_pool(), lambda d: self._native_stack(d, x[d, :length, 0], outs)
            )
        return outs

    def _native_stack(self, d: int, x: Tensor, outs: list[Tensor]) -> None:
        """Direction ``d``'s layers for one sentence, ``x [L, P]`` -> ``outs[l][d, :L, 0]``."""
        n = x.shape[0]
        cc2, pc = 2.0 * self.cell_clip, self.proj_clip
        for layer, out in enumerate(outs):
            y = out[d, :n, 0]  # [L, P], contiguous
            xg = self.w_ih[layer][d](x)  # the input gates of all steps, one matmul
            w_hh_t, w_proj_t = self.single[layer]
            lstmp_row(xg.numpy(), w_hh_t[d], w_proj_t[d], cc2, pc, y.numpy())
            if self.residual and layer > 0:
                y.add_(x)
            x = y

    def _direction_stack(
        self,
        d: int,
        x: Tensor,
        active: list[int],
        offset: list[int],
        rows: Tensor | None,
        outs: list[Tensor],
        gather: tuple[Tensor, Tensor] | None = None,
    ) -> None:
        """Direction ``d``'s layers (on a worker thread, or the caller's): ``x [T, B, P]``
        -> ``outs[l][d]``."""
        for layer, out in enumerate(outs):
            self._direction(layer, d, x, active, offset, rows, out[d], gather)
            if self.residual and layer > 0:
                out[d].add_(x)
            x = out[d]

    def _direction(
        self,
        layer: int,
        d: int,
        x: Tensor,
        active: list[int],
        offset: list[int],
        rows: Tensor | None,
        out: Tensor,
        gather: tuple[Tensor, Tensor] | None = None,
    ) -> None:
        """One direction of one layer: ``x [T, B, P]`` -> ``out [T, B, P]`` (zeros past
        each row's length, as allocated)."""
        t, b, p = x.shape
        c = self.cell_dim
        w_hh, w_proj = self.w_hh[layer][d], self.w_proj[layer][d]
        xg = self._input_gates(layer, d, x, rows, gather)
        h = x.new_zeros(b, p)
        c2 = x.new_zeros(b, c)  # 2 * cell state
        cc2, pc = 2.0 * self.cell_clip, self.proj_clip
        for s in range(t):
            n = active[s]
            if n == 0:
                break
            if n < h.shape[0]:  # rows sorted longest first: finished rows drop off the end
                h, c2 = h[:n], c2[:n]
            m = _cell(w_hh(h, add=xg.step(offset[s], n)), c2, cc2)
            h = w_proj(m)
            if pc:
                h.clamp_(-pc, pc)
            out[s, :n] = h

    def _input_gates(
        self,
        layer: int,
        d: int,
        x: Tensor,
        rows: Tensor | None,
        gather: tuple[Tensor, Tensor] | None = None,
    ) -> _Gates:
        """Direction ``d``'s input matmul, hoisted over all steps: ``x [T, B, P]`` -> the
        gates of the real rows (time-major, as ``rows`` packs them). ``gather``: (table,
        ``[2, R]`` index of the real rows): the first layer's matmul runs on the table."""
        if layer == 0 and gather is not None:
            table, index = gather
            return _Gates(self.w_ih[0][d](table), index[d])
        xd = x.reshape(-1, x.shape[-1])
        return _Gates(self.w_ih[layer][d](xd if rows is None else xd.index_select(0, rows)))


class _Gates(NamedTuple):
    """The input gates of one direction's real rows, ``[R, 4C]``; or, with ``index [R]``,
    those of a table of distinct inputs ``[U, 4C]`` and each real row's entry in it."""

    gates: Tensor
    index: Tensor | None = None

    def step(self, start: int, n: int) -> Tensor:
        """``[n, 4C]``: the gates of rows ``start .. start + n`` (one step's rows). A gather
        per step reads the table from cache and writes one step's rows; gathering all
        rows at once would write and re-read ``[R, 4C]`` through memory."""
        if self.index is None:
            return self.gates[start : start + n]
        return self.gates.index_select(0, self.index[start : start + n])


# at this many rows and more, the directions run on two threads (see the module docstring)
SPLIT_MIN_ROWS = 2
# the first layer's input matmul runs on the distinct tokens when they are at most this
# share of the real rows (below, the gather costs less than the rows it saves)
DISTINCT_AT_MOST = 0.75

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def direction_pool() -> ThreadPoolExecutor | None:
    """Two worker threads with one torch thread each, for a caller with 2 or 3; else None.

    With more, each worker would start an OpenMP team of its own beside the
    caller's, and once a process holds more OpenMP threads than cores libgomp
    stops spin-waiting (see ``elmo_service.runtime.in_transient_thread``); only
    2 cores were measured. A worker's count is its own (OpenMP and MKL keep it
    per thread); torch also records the last count set as the default for
    threads started later, so the caller's count is set again afterwards.
    """
    global _pool
    n = torch.get_num_threads()
    if n // 2 != 1:
        return None
    if _pool is not None:  # every batch asks: no lock once it exists
        return _pool
    with _pool_lock:
        if _pool is None:
            pool = ThreadPoolExecutor(2, thread_name_prefix="elmo-bilstm")
            both = threading.Barrier(2, timeout=60)  # two tasks held at once: two threads

            def pin() -> None:
                # torch sets a thread's count from its default on the thread's first
                # parallel op; take that first, or it would undo the count set here
                torch.get_num_threads()
                torch.set_num_threads(1)
                both.wait()

            for f in [pool.submit(pin) for _ in range(2)]:
                f.result()
            torch.set_num_threads(n)
            _pool = pool
    return _pool


def on_both_workers(pool: ThreadPoolExecutor | None, task: Callable[[int], None]) -> None:
    """``task(0)`` and ``task(1)`` (the two directions, or two halves of some work): on
    the two workers of ``pool`` at once, under the caller's inference mode and no-grad
    (both thread-local), or one after the other here."""
    if pool is None:
        for d in (0, 1):
            task(d)
        return
    inference = torch.is_inference_mode_enabled()

    def run(d: int) -> None:
        with torch.inference_mode(inference), torch.no_grad():
            task(d)

    for f in [pool.submit(run, d) for d in (0, 1)]:
        f.result()


def _forget_pool() -> None:  # a forked child has the object but not the threads
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _cell(gates: Tensor, c2: Tensor, cc2: float) -> Tensor:
    """Gates ``[n, 4C]`` (pre-activation, g rows doubled), doubled cell ``c2 [n, C]``
    updated in place -> ``o * tanh(c) / 2 [n, C]``, by
    :func:`~elmo_service.native_step.lstm_cell`: one native call instead of ~8 torch
    ops over the whole step (the element-wise part was ~27 % of a 32-row step)."""
    m = gates.new_empty(c2.shape)
    lstm_cell(gates.numpy(), c2.numpy(), cc2, m.numpy())
    return m
