"""The serving kernel of the biLSTM: both directions of a layer in one step loop.

    x [2, T, B, P] (direction, time, rows sorted longest first) --> per layer [2, T, B, P]

The same function as ``LstmLayer`` (``elmo_service/bilm/lstm.py``) run for each
direction and layer, with fewer, larger operations per step:

* a step is the recurrent matmul (the input gates added in the same call), the
  element-wise cell in one native call (``native_step.lstm_cell``, numba), and
  the projection matmul;
* weights are packed once (:class:`PackedLinear`: oneDNN reordered for several
  rows, ``W^T`` for a single row; int8 / bf16 weights rounded once when asked) and pre-scaled
  (:class:`ScaledLayer`) so that no step multiplies by a constant: the g-gate rows of
  ``W_ih``, ``b`` and ``W_hh`` are doubled, so one sigmoid gives
  ``sigmoid(2g)``, and ``tanh(g) = 2 sigmoid(2g) - 1``; the cell is kept
  doubled (``c2 = 2c``, exact in floating point), so ``tanh(c) =
  2 sigmoid(c2) - 1``; and ``W_proj`` is doubled so the projection reads
  ``o * (sigmoid(c2) - 1/2) = o * tanh(c) / 2``. Scaling by 2 is exact, so
  these are the same numbers as the textbook formulas up to summation order
  and the sigmoid's last bit;
* the first layer's input matmul, hoisted over all steps, runs once per
  distinct token when the caller passes its token table (a batch of natural
  sentences repeats words and boundary tokens).

With two (or three) torch threads and two or more rows, the two directions run
on two worker threads, each with one thread and its direction's whole stack
of layers (the directions never meet before the output, so nothing
synchronises per step): each core runs its own matmuls without OpenMP's fork
and join around every op. A single sentence runs each direction's step loop
in native code (``kernels/native_step.py``, numba, GIL released), on the two
workers when there are (else one direction after the other). Speed-ups are
measured in ``docs/bench-embedder.md``.

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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from elmo_service.bilm.kernels import tuning
from elmo_service.bilm.kernels.native_rounded import round_weight
from elmo_service.bilm.kernels.native_step import lstm_cell, lstmp_row, lstmp_row_from
from elmo_service.bilm.kernels.packed import PackedLinear
from elmo_service.bilm.lstm import ChunkLayers, Chunks, LstmLayer, LstmState, Meanwhile

# input-gate rows computed at once by a stream (bounds its buffer, not the speed)
STREAM_GATE_ROWS = 128


class ScaledLayer:
    """One direction of one LSTMP layer in the kernels' pre-scaled layout.

    Built from an :class:`~elmo_service.bilm.lstm.LstmLayer` by its one constructor;
    the native loops (``kernels/native_step.py``) are called only through its
    methods, so they never see plain weights. The scaling (exact: powers of 2):

    * the g-gate rows of ``W_ih``, ``b`` and ``W_hh`` are doubled, so one sigmoid
      of the gates gives ``sigmoid(2g)`` and ``tanh(g) = 2 sigmoid(2g) - 1``;
    * the cell is kept doubled (``c2 = 2c``), so ``tanh(c) = 2 sigmoid(c2) - 1``
      and the cell clip is doubled;
    * ``W_proj`` is doubled, so the projection reads ``o * tanh(c) / 2``.

    NOTE: ``native_step._cell_row`` reads exactly this layout; change the two together.

    # Parameters

    layer : `LstmLayer`
        The layer whose weights are copied (later changes to it are not seen).
    weights : `str`, optional (default = `"fp32"`)
        ``"int8"`` or ``"bf16"``: every matrix rounded once (``native_rounded.round_weight``);
        the batched steps run fp32 matmuls on the rounded weights, a sentence alone
        streams their compact form (``native_rounded``): the same numbers either way,
        up to summation order, so a sentence's vectors do not depend on its batch.
    """

    def __init__(self, layer: LstmLayer, *, weights: str = "fp32") -> None:
        c = layer.cell_dim
        scale = layer.w_ih.weight.new_ones(4 * c)
        scale[3 * c :] = 2.0
        self.cell_clip2 = 2.0 * float(layer.cell_clip or 0.0)  # 0: no clip
        self.proj_clip = float(layer.proj_clip or 0.0)
        w_ih = layer.w_ih.weight * scale[:, None]
        w_hh = layer.w_hh.weight * scale[:, None]  # [4C, P]
        w_proj = 2.0 * layer.w_proj.weight
        # the single-sentence loop's weights (W_hh^T, its scales, 2 W_proj^T, its scales): fp32,
        # or the compact int8 / bf16 forms (native_step.lstmp_row: one loop, per format)
        none = np.zeros(0, np.float32)
        compact = None
        if weights != "fp32":  # the scaling by powers of 2 commutes with the rounding
            w_ih = round_weight(w_ih, weights)[0]
            w_hh, hh_q, hh_s = round_weight(w_hh, weights)
            w_proj, proj_q, proj_s = round_weight(w_proj, weights)
            compact = (hh_q, hh_s, proj_q, proj_s)
        # the input matmul always has several rows (all steps): oneDNN only
        self.w_ih = PackedLinear(w_ih, layer.w_ih.bias * scale).pack_now()
        self.w_hh = PackedLinear(w_hh)
        self.w_proj = PackedLinear(w_proj)
        # W^T for one row (a batch's last steps), and for several where the route says so;
        # else oneDNN's pack, built on its first use
        w_hh_t = w_hh.t().contiguous()
        self.w_hh.use_transposed(w_hh_t)
        self.w_hh.pack_now()
        self.row: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] = compact or (
            w_hh_t.detach().numpy(),
            none,
            w_proj.t().contiguous().detach().numpy(),
            none,
        )

    def run_row(self, x_gates: Tensor, out: Tensor) -> None:
        """One sentence's whole step loop in native code: the input gates ``[T, 4C]``
        (from :attr:`w_ih`) -> ``out [T, P]``, written in place."""
        lstmp_row(x_gates.numpy(), *self.row, self.cell_clip2, self.proj_clip, out.numpy())

    def run_row_from(self, x_gates: Tensor, out: Tensor, h: Tensor, c2: Tensor) -> None:
        """:meth:`run_row` from the state ``h [P]``, ``c2 [C]`` (the doubled cell, this
        layout's), updated in place to the state after the last step (document mode)."""
        xg, hn, cn, y = x_gates.numpy(), h.numpy(), c2.numpy(), out.numpy()
        lstmp_row_from(xg, *self.row, self.cell_clip2, self.proj_clip, hn, cn, y)

    def run_steps(
        self,
        gates_of: Callable[[int, int], Tensor],
        h: Tensor,
        c2: Tensor,
        out: Tensor,
        active: Sequence[int],
    ) -> None:
        """Batched steps ``s = 0, 1, ...`` while ``active[s]`` rows (sorted longest first:
        finished rows drop off the end) are left: ``gates_of(s, n)`` gives a step's input
        gates ``[n, 4C]``; ``h [>= n, P]`` is the state before the first step and the
        doubled cell ``c2 [>= n, C]`` is updated in place. Step ``s``'s ``h`` is written to
        ``out[s, :n]`` (``out [S, B, P]``, time-major) and the next step reads it there.

        A step is the recurrent matmul (the input gates added in the same call), the native
        element-wise cell and the projection, into buffers made once: the per-step Python
        and allocations were a fifth of a step at 8 rows (docs/bench-embedder.md)."""
        gates_buf = out.new_empty(out.shape[1], self.w_hh.n)
        m_buf = out.new_empty(out.shape[1], self.w_proj.k)
        width = -1
        for s, n in enumerate(active):
            if n <= 0:
                break
            if n != width:  # the views change only when rows finish
                width, h = n, h[:n]
                gates, m, c = gates_buf[:n], m_buf[:n], c2[:n]
                gates_np, m_np, c_np = gates.numpy(), m.numpy(), c.numpy()
            self.w_hh(h, add=gates_of(s, n), out=gates)
            lstm_cell(gates_np, c_np, self.cell_clip2, m_np)  # o * tanh(c) / 2 into m
            h = self.w_proj(m, out=out[s, :n])
            if self.proj_clip:
                h.clamp_(-self.proj_clip, self.proj_clip)


class BiLstmKernel:
    """Kernel-layout weights of an L-layer biLSTM and its inference loop.

    # Parameters

    layers : `list[tuple[LstmLayer, LstmLayer]]`
        Per layer, the (forward, backward) pair.
    residual : `bool`
        Residual connections from the second layer on (``BiLMConfig.residual``).
    weights : `str`, optional (default = `"fp32"`)
        ``"int8"`` or ``"bf16"``: the weights rounded (see :class:`ScaledLayer`).
    """

    def __init__(
        self, layers: list[tuple[LstmLayer, LstmLayer]], residual: bool, weights: str = "fp32"
    ) -> None:
        self.residual = residual
        self.layers = [tuple(ScaledLayer(m, weights=weights) for m in pair) for pair in layers]
        # one sentence runs in the native loop (fp32, or the compact rounded weights)
        self.has_row_loop = True

    def recurrent_on_transposed(self, rows: int) -> None:
        """Batched steps of fewer than ``rows`` rows multiply by ``W_hh^T`` (MKL), more by
        oneDNN's pack: the faster of the two on this CPU (``kernels/calibrate.py``)."""
        for pair in self.layers:
            for sl in pair:
                sl.w_hh.transposed_below = rows

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
        if b == 1 and self.has_row_loop:
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
        if distinct is not None and distinct[0].shape[0] <= tuning.DISTINCT_AT_MOST * offset[-1]:
            table, index = distinct
            flat = index.reshape(2, -1)
            gather = (table, flat if rows is None else flat[:, rows])
        pool = direction_pool() if b >= tuning.SPLIT_MIN_ROWS else None
        outs = [x.new_zeros(2, t, b, x.shape[3]) for _ in self.layers]
        on_both_workers(
            pool, lambda d: self._direction_stack(d, x[d], active, offset, rows, outs, gather)
        )
        return outs

    # -- streams: rows with a state carried from call to call (documents) ----------
    def stream_state(self) -> list[list[tuple[Tensor, Tensor]]]:
        """A row's zero state: per direction, per layer ``(h [1, P], c2 [1, C])`` (the
        doubled cell of this layout)."""
        return [
            [(torch.zeros(1, sl.w_proj.n), torch.zeros(1, sl.w_proj.k)) for sl in pair_d]
            for pair_d in zip(*self.layers, strict=True)
        ]

    def stream(
        self, inputs: Chunks, states: list[list[list[LstmState]]], meanwhile: Meanwhile = None
    ) -> ChunkLayers:
        """Rows of their own length, each from its carried state (updated in place to
        the state after its last real step): ``inputs[r] = (forward x [n, P], backward
        x [m, P])``, each in its direction's reading order -> per row, per direction,
        each layer's ``[n, P]``. The directions run on the two workers when there are;
        ``meanwhile`` runs on this thread as they do."""
        outs: list[list] = [[None, None] for _ in inputs]
        inference = torch.is_inference_mode_enabled()

        def run(d: int) -> None:
            with torch.inference_mode(inference), torch.no_grad():  # thread-local
                ys = self._stream_direction(d, [x[d] for x in inputs], [s[d] for s in states])
                for r, y in enumerate(ys):
                    outs[r][d] = y

        pool = direction_pool()
        if pool is None:
            run(0)
            run(1)
            if meanwhile is not None:
                meanwhile()
        else:
            futures = [pool.submit(run, d) for d in (0, 1)]
            try:
                if meanwhile is not None:
                    meanwhile()
            finally:
                for f in futures:
                    f.result()
        return [(o[0], o[1]) for o in outs]

    def _stream_direction(
        self, d: int, xs: list[Tensor], states: list[list[tuple[Tensor, Tensor]]]
    ) -> list[list[Tensor]]:
        layers = [pair[d] for pair in self.layers]
        if len(xs) == 1:  # the native loop, any weight format
            return [self._stream_row(layers, xs[0], states[0])]
        return self._stream_batch(layers, xs, states)

    def _stream_row(
        self, layers: list[ScaledLayer], x: Tensor, state: list[tuple[Tensor, Tensor]]
    ) -> list[Tensor]:
        """One row in the native loop from its state: as fast as a sentence alone."""
        outs = []
        for i, sl in enumerate(layers):
            y = x.new_empty(x.shape[0], sl.w_proj.n)
            h, c2 = state[i]
            # the input gates a block of steps at a time: [STREAM_GATE_ROWS, 4C] whatever the
            # chunk; a chunk's [n, 4C] at once was kept by the allocator and grew the RSS
            for lo in range(0, x.shape[0], STREAM_GATE_ROWS):
                hi = min(lo + STREAM_GATE_ROWS, x.shape[0])
                sl.run_row_from(sl.w_ih(x[lo:hi]), y[lo:hi], h[0], c2[0])
            if self.residual and i > 0:
                y.add_(x)
            outs.append(y)
            x = y
        return outs

    def _stream_batch(
        self, layers: list[ScaledLayer], xs: list[Tensor], states: list[list[tuple[Tensor, Tensor]]]
    ) -> list[list[Tensor]]:
        """Rows of different lengths in batched steps: sorted longest first, a row drops
        off after its last real step, so its carried state is that step's."""
        order = sorted(range(len(xs)), key=lambda r: -xs[r].shape[0])
        lens = [xs[r].shape[0] for r in order]
        b, t = len(xs), lens[0]
        active = [sum(1 for n in lens if n > s) for s in range(t)]
        x = xs[0].new_zeros(t, b, xs[0].shape[1])  # time-major: a step's rows are contiguous
        for j, r in enumerate(order):
            x[: lens[j], j] = xs[r]
        block = max(1, STREAM_GATE_ROWS // b)  # steps whose input gates are computed at once
        outs: list[list[Tensor]] = [[] for _ in xs]
        for i, sl in enumerate(layers):
            h = torch.cat([states[r][i][0] for r in order])
            c2 = torch.cat([states[r][i][1] for r in order])
            y = x.new_zeros(t, b, sl.w_proj.n)
            for lo in range(0, t, block):
                xg = sl.w_ih(x[lo : lo + block].reshape(-1, x.shape[2]))
                sl.run_steps(
                    lambda s, n, xg=xg: xg[s * b : s * b + n],
                    h if lo == 0 else y[lo - 1],
                    c2,  # rows :n updated in place: a finished row keeps its last state
                    y[lo : lo + block],
                    active[lo : lo + block],
                )
            for j, r in enumerate(order):
                last = y[lens[j] - 1, j : j + 1] if lens[j] else h[j : j + 1]
                states[r][i] = (last.clone(), c2[j : j + 1].clone())
            if self.residual and i > 0:
                y.add_(x)
            for j, r in enumerate(order):
                outs[r].append(y[: lens[j], j])
            x = y
        return outs

    def _single(self, x: Tensor, length: int) -> list[Tensor]:
        """One sentence, ``x [2, T, 1, P]`` with ``length`` real steps -> per layer
        ``[2, T, 1, P]``: each direction's layers in the native loop, the two
        directions on the two worker threads when there are (else one after the other)."""
        outs = [x.new_zeros(x.shape) for _ in self.layers]
        if length > 0:
            on_both_workers(
                direction_pool(), lambda d: self._native_stack(d, x[d, :length, 0], outs)
            )
        return outs

    def _native_stack(self, d: int, x: Tensor, outs: list[Tensor]) -> None:
        """Direction ``d``'s layers for one sentence, ``x [L, P]`` -> ``outs[l][d, :L, 0]``."""
        n = x.shape[0]
        for layer, (pair, out) in enumerate(zip(self.layers, outs, strict=True)):
            y = out[d, :n, 0]  # [L, P], contiguous
            pair[d].run_row(pair[d].w_ih(x), y)  # the input gates of all steps: one matmul
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
        _, b, p = x.shape
        scaled = self.layers[layer][d]
        xg = self._input_gates(layer, d, x, rows, gather)
        h0, c2 = x.new_zeros(b, p), x.new_zeros(b, scaled.w_proj.k)  # c2: 2 * cell state
        scaled.run_steps(lambda s, n: xg.step(offset[s], n), h0, c2, out, active)

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
            return _Gates(self.layers[0][d].w_ih(table), index[d])
        xd = x.reshape(-1, x.shape[-1])
        w_ih = self.layers[layer][d].w_ih
        return _Gates(w_ih(xd if rows is None else xd.index_select(0, rows)))


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
