"""One direction of one LSTM layer with a projection (LSTMP): serving and training.

    x [B, T, in] (+ state (h [B, P], c [B, C])) --> h [B, T, P], final state

Math, gate order (i, f, o, g), and bilm-tf's clipping::

    gates = x W_ih + b + h_{t-1} W_hh
    c_t = clip(f * c_{t-1} + i * g, cell_clip)
    h_t = clip((o * tanh(c_t)) W_proj, proj_clip)

The input matmul runs for all steps at once; only ``h W_hh`` is sequential.
Two loops run one cell (:func:`lstm_step`, with ``tanh(z) = 2 sigmoid(2z) - 1``
because torch's CPU tanh is several times slower than its sigmoid), chosen by
whether autograd is recording:

* **inference** (``_infer``): a plain step loop over the rows still inside
  their sentence (``active``: rows sorted longest first).
* **training** (``LstmpFunction``): the whole layer as one autograd node, on the
  same active rows. Autograd through a Python time loop records ~15 nodes a
  step and computes each step's weight gradients as its own small matmul; here
  the forward loop saves only what the backward needs (gate activations, cell
  states; the clip masks are recomputed from the clipped values), the backward
  loop does backpropagation through time by hand, and the weight gradients are
  two big matmuls over all real ``(row, step)`` pairs, as cuDNN does.
  ``tests/elmo_service/test_lstm.py`` keeps it equal to autograd.

The CPU serving kernels (``kernels/bilstm.py``) compute the same function in a
pre-scaled algebra of their own (``ScaledLayer``), fenced by ``tests/test_boundaries.py``.

Both take an initial state (stream training carries it from one window to
the next) and an optional ``keep [B, T]`` mask: a 0 at ``(b, t)`` resets row
b's state to zero before step t (a sentence boundary where the model is made
to start fresh, as serving always does). Matmuls run in the dtype of the
gate inputs (bf16 under autocast); the training kernel keeps the cell state
and the element-wise backward in float32.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor, nn

from elmo_service.bilm.config import BiLMConfig

LstmState = tuple[Tensor, Tensor]  # (h [B, P], c [B, C])
# a stream's chunks (``BiLMKernel.stream``): per row (forward [n, P], backward [m, P]), each in
# its reading order -> per row, per direction, each layer's output; ``Meanwhile``: run while
# the rows compute
Chunks = list[tuple[Tensor, Tensor]]
ChunkLayers = list[tuple[list[Tensor], list[Tensor]]]
Meanwhile = Callable[[], None] | None


def cell_dtype(dtype: torch.dtype) -> torch.dtype:
    """The cell state's dtype: float32 (bf16 / fp16 / fp32 models), float64 for a float64 one."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------- the one cell


def lstm_step(x_gates, h, c, w_hh_t, w_proj_t, cell_clip: float, proj_clip: float):
    """One step of the textbook cell, shared by the inference loop and the training kernel.

    ``x_gates [B, 4C]`` (``x W_ih^T + b``), ``h [B, P]``, ``c [B, C]`` (float32) ->
    ``(h, c, acts)``: the new state (clipped; a clip of 0 is off) and ``acts [B, 4C]``
    = ``(i, f, o, sigmoid(2 g))``, what the backward needs. ``tanh(z) = 2 sigmoid(2z) - 1``
    everywhere: torch's CPU tanh is several times slower than its sigmoid
    (``docs/bench-embedder.md``), and one sigmoid covers all four gates.
    """
    n = c.shape[1]
    gates = torch.addmm(x_gates, h, w_hh_t)
    gates[:, 3 * n :] *= 2
    acts = torch.sigmoid(gates)
    i, f, o, s = acts.to(cell_dtype(acts.dtype)).chunk(4, dim=1)
    c = torch.addcmul(f * c - i, i, s, value=2)  # f c + i (2 sigmoid(2g) - 1)
    if cell_clip:
        c = c.clamp(-cell_clip, cell_clip)
    m = torch.addcmul(-o, o, torch.sigmoid(2 * c), value=2)  # o tanh(c)
    h = m.to(w_proj_t.dtype) @ w_proj_t
    if proj_clip:
        h = h.clamp(-proj_clip, proj_clip)
    return h, c, acts


def _unclipped(x: Tensor, clip: float) -> Tensor:
    """Where a clip left ``x`` (the clipped value) alone: the clamp's gradient mask."""
    return x.abs() < clip if clip else torch.ones_like(x, dtype=torch.bool)


# ---------------------------------------------------------------- training kernel


def step_backward(dh, dc_next, acts, c, c_prev, cell_clip, proj_clip, h, w_hh_t, w_proj_t):
    """Backward of one :func:`lstm_step`, given dL/dh_t (output + recurrent) and dL/dc_t
    from step t+1; ``c``, ``h``: the step's clipped outputs (their clip masks are
    recomputed here rather than saved).

    Returns (d_gates [B, 4C], d_pre [B, P], dL/dh_{t-1}, dL/dc_{t-1}); all float32.
    """
    n = c.shape[1]
    a = acts.float()
    i, f, o = a[:, :n], a[:, n : 2 * n], a[:, 2 * n : 3 * n]
    g = 2 * a[:, 3 * n :] - 1  # tanh(g) from sigmoid(2g)
    d_pre = dh * _unclipped(h, proj_clip)
    dm = (d_pre.to(w_proj_t.dtype) @ w_proj_t.t()).float()
    tc = 2 * torch.sigmoid(2 * c) - 1
    dc = (dm * o * (1 - tc * tc) + dc_next) * _unclipped(c, cell_clip)
    d_gates = torch.cat(
        [
            dc * g * i * (1 - i),
            dc * c_prev * f * (1 - f),
            dm * tc * o * (1 - o),
            dc * i * (1 - g * g),
        ],
        dim=1,
    )
    dh_prev = (d_gates.to(w_hh_t.dtype) @ w_hh_t.t()).float()
    return d_gates, d_pre, dh_prev, dc * f


class StepFns(NamedTuple):
    """The per-step bodies a layer's loops run: eager, or compiled (:func:`compiled_steps`)."""

    forward: Callable = lstm_step
    backward: Callable = step_backward


EAGER_STEPS = StepFns()


@functools.cache
def compiled_steps() -> StepFns:
    """``torch.compile``'d step bodies: one small fused kernel set, compiled once for
    every T and shared by the layers that ask (``LstmLayer.use_compiled_steps``)."""
    return StepFns(torch.compile(lstm_step), torch.compile(step_backward))


class LstmpFunction(torch.autograd.Function):
    """``x_gates [B, T, 4C], W_hh^T [P, 4C], W_proj^T [C, P], h0 [B, P], c0 [B, C], keep [B, T] | None``
    -> ``(h [B, T, P], c [B, T, C])`` (the cell states: not differentiable); ``steps``: the
    step bodies to run. ``active[t]``: rows (sorted longest first) still inside their
    sequence at step t; only those are computed, and ``h`` and ``c`` are zero past each
    row's length. Without it every row runs all T steps."""

    @staticmethod
    def forward(
        ctx,
        x_gates,
        w_hh_t,
        w_proj_t,
        h0,
        c0,
        keep,
        cell_clip,
        proj_clip,
        steps=EAGER_STEPS,
        active=None,
    ):
        b, t, g4 = x_gates.shape
        n, p = g4 // 4, w_proj_t.shape[1]
        dt = x_gates.dtype
        fwd = steps.forward
        ctx.steps, ctx.clips, ctx.active = steps, (cell_clip, proj_clip), active
        w_hh_t, w_proj_t = w_hh_t.to(dt), w_proj_t.to(dt)
        h, c = h0.to(dt), c0.float()
        keep_f = None if keep is None else keep.to(torch.float32).unsqueeze(-1)  # [B, T, 1]
        hs = x_gates.new_empty(b, t, p)
        acts = x_gates.new_empty(b, t, g4)
        cs = x_gates.new_empty(b, t, n, dtype=torch.float32)
        for s in range(t):
            r = b if active is None else active[s]
            if r < b:  # past a row's length: zeros (the backward reads them), only there
                hs[r:, s], acts[r:, s], cs[r:, s] = 0, 0, 0
            if r < h.shape[0]:  # rows sorted longest first: finished rows drop off the end
                h, c = h[:r], c[:r]
            if keep_f is not None:
                h, c = h * keep_f[:r, s].to(dt), c * keep_f[:r, s]
            h, c, acts[:r, s] = fwd(x_gates[:r, s], h, c, w_hh_t, w_proj_t, cell_clip, proj_clip)
            hs[:r, s], cs[:r, s] = h, c
        ctx.h0_dtype = h0.dtype
        h0, c0 = h0.to(dt), c0.float()
        ctx.save_for_backward(w_hh_t, w_proj_t, h0, c0, hs, acts, cs, keep_f)
        ctx.mark_non_differentiable(cs)
        return hs, cs

    @staticmethod
    def backward(ctx, d_hs, _d_cs):
        w_hh_t, w_proj_t, h0, c0, hs, acts, cs, keep_f = ctx.saved_tensors
        bwd, active = ctx.steps.backward, ctx.active
        cell_clip, proj_clip = ctx.clips
        b, t, p = hs.shape
        n = cs.shape[2]
        f32 = {"dtype": torch.float32, "device": hs.device}
        # each step's input state: the previous output, reset where keep is 0 (as in forward)
        h_prev = torch.cat([h0.unsqueeze(1), hs[:, :-1]], dim=1)
        c_prev = torch.cat([c0.unsqueeze(1), cs[:, :-1]], dim=1)
        if keep_f is not None:
            h_prev, c_prev = h_prev * keep_f.to(h_prev.dtype), c_prev * keep_f
        d_hs = d_hs.float()
        d_gates = torch.empty(b, t, 4 * n, **f32)
        d_pres = torch.empty(b, t, p, **f32)
        dh, dc = torch.zeros(b, p, **f32), torch.zeros(b, n, **f32)
        for s in range(t - 1, -1, -1):
            r = b if active is None else active[s]
            if r < b:  # rows past their end: zero gradients, written only there
                d_gates[r:, s], d_pres[r:, s] = 0, 0
            d_gates[:r, s], d_pres[:r, s], dh[:r], dc[:r] = bwd(
                d_hs[:r, s] + dh[:r],
                dc[:r],
                acts[:r, s],
                cs[:r, s],
                c_prev[:r, s],
                cell_clip,
                proj_clip,
                hs[:r, s],
                w_hh_t,
                w_proj_t,
            )
            if keep_f is not None:  # a reset cut the path to the previous step
                dh[:r], dc[:r] = dh[:r] * keep_f[:r, s], dc[:r] * keep_f[:r, s]
        # weight gradients: one matmul each over all real (row, step) pairs, for the
        # weights that train (a plain LSTM's identity projection does not: model.lstm_projection)
        dt = w_hh_t.dtype
        real = _real_rows(active, b, t, hs.device)
        d_w_hh_t = d_w_proj_t = None
        if ctx.needs_input_grad[1]:
            d_w_hh_t = (_rows(h_prev, real).to(dt).t() @ _rows(d_gates, real).to(dt)).float()
        if ctx.needs_input_grad[2]:
            o = acts[:, :, 2 * n : 3 * n].float()
            m = o * (2 * torch.sigmoid(2 * cs) - 1)  # o tanh(c)
            d_w_proj_t = (_rows(m, real).to(dt).t() @ _rows(d_pres, real).to(dt)).float()
        return (
            d_gates.to(dt),
            d_w_hh_t,
            d_w_proj_t,
            dh.to(ctx.h0_dtype),
            dc,
            None,
            None,
            None,
            None,
            None,
        )


def _real_rows(active: list[int] | None, b: int, t: int, device) -> Tensor | None:
    """Flat indices of the ``[B, T]`` positions inside their row's length (None: all)."""
    if active is None or sum(active) == b * t:
        return None
    steps = torch.tensor(active, device=device)
    return (torch.arange(b, device=device).unsqueeze(1) < steps).flatten().nonzero().squeeze(1)


def _rows(x: Tensor, real: Tensor | None) -> Tensor:
    """``[B, T, D]`` -> ``[R, D]``: the real positions' rows (all of them without ``real``)."""
    x = x.reshape(-1, x.shape[-1])
    return x if real is None else x.index_select(0, real)


# ---------------------------------------------------------------- the layer


class LstmLayer(nn.Module):
    """One direction of one LSTM layer with projection and clipping.

    ``forward(x [B, T, in], state=None) -> (h [B, T, P], (h_T [B, P], c_T [B, C]))``,
    reading left to right; callers run the backward direction on reversed input.
    Parameters: ``w_ih`` (carries the gate bias), ``w_hh``, ``w_proj``; gates
    packed (i, f, o, g). With ``cfg.lstm_projection`` off, ``w_proj`` is a frozen
    identity: a plain LSTM run by the same kernels.
    """

    def __init__(self, in_dim: int, cfg: BiLMConfig) -> None:
        super().__init__()
        c, p = cfg.lstm_dim, cfg.projection_dim
        self.cell_dim, self.proj_dim = c, p
        self.cell_clip, self.proj_clip = cfg.cell_clip, cfg.proj_clip
        self.w_ih = nn.Linear(in_dim, 4 * c)
        self.w_hh = nn.Linear(p, 4 * c, bias=False)
        self.w_proj = nn.Linear(c, p, bias=False)
        self.projected = cfg.lstm_projection
        self.steps = EAGER_STEPS
        self.reset_parameters()

    def reset_parameters(self) -> None:
        c = self.cell_dim
        for w in (self.w_ih.weight, self.w_hh.weight):
            nn.init.uniform_(w, -1 / math.sqrt(c), 1 / math.sqrt(c))
        if self.projected:
            nn.init.xavier_uniform_(self.w_proj.weight)
        else:  # a plain LSTM: the projection is the identity, never trained
            with torch.no_grad():
                self.w_proj.weight.copy_(torch.eye(c))
            self.w_proj.weight.requires_grad_(False)
        with torch.no_grad():
            self.w_ih.bias.zero_()
            self.w_ih.bias[c : 2 * c] = 1.0  # forget gate starts open

    def use_compiled_steps(self) -> None:
        """Run this layer's step bodies compiled (:func:`compiled_steps`)."""
        self.steps = compiled_steps()

    def forward(
        self,
        x: Tensor,
        state: LstmState | None = None,
        *,
        active: list[int] | None = None,
        keep: Tensor | None = None,
    ) -> tuple[Tensor, LstmState]:
        """``x [B, T, in]`` -> ``(h [B, T, P], final state)``.

        ``state``: initial ``(h [B, P], c [B, C])``, zeros when None.
        ``keep [B, T]``: 0 resets a row's state before that step.
        ``active[t]``: rows (sorted longest first) still inside their sequence
        at step t; only those are computed, the output is zero past each row's
        length, and each row's final state is the one after its own last step.

        Under autograd (``x``'s gates require grad) the training kernel
        :class:`LstmpFunction` runs, whatever the padding; otherwise the inference loop.
        A float64 layer (``.double()``: gradcheck) runs the inference loop under autograd
        instead, all in float64 (the training kernel keeps float32 cell states).
        """
        b, t = x.shape[:2]
        training = torch.is_grad_enabled() and any(
            v.requires_grad for v in (x, self.w_ih.weight, self.w_ih.bias)
        )
        # all steps at once: [B, T, 4C]; under autograd on the real positions only, which
        # also spares the backward two matmuls' padding rows (inference keeps one plain
        # matmul: there a gather and a scatter cost about what the padding rows do)
        x_gates = self._input_gates(x, active) if training else self.w_ih(x)
        if state is None:
            h0 = x_gates.new_zeros(b, self.proj_dim)
            c0 = x_gates.new_zeros(b, self.cell_dim, dtype=cell_dtype(x_gates.dtype))
        else:
            h0, c0 = state
        cc, pc = float(self.cell_clip or 0.0), float(self.proj_clip or 0.0)
        if not training or x_gates.dtype == torch.float64:
            return self._infer(x_gates, h0, c0, active, keep, cc, pc)
        w_hh_t, w_proj_t = self.w_hh.weight.t(), self.w_proj.weight.t()
        hs, cs = LstmpFunction.apply(
            x_gates, w_hh_t, w_proj_t, h0, c0, keep, cc, pc, self.steps, active
        )
        if active is None:
            return hs, ((hs[:, -1], cs[:, -1]) if t else (h0, c0))
        steps = torch.tensor(active, device=x.device)
        lengths = (steps.unsqueeze(1) > torch.arange(b, device=x.device)).sum(0)  # [B]
        rows, last = torch.arange(b, device=x.device), (lengths - 1).clamp_min(0)
        ended = (lengths > 0).unsqueeze(1)
        h_last = torch.where(ended, hs[rows, last], h0.to(hs.dtype))
        c_last = torch.where(ended, cs[rows, last], c0.float())
        return hs, (h_last, c_last)

    def _input_gates(self, x: Tensor, active: list[int] | None) -> Tensor:
        """``x W_ih^T + b`` for all steps in one matmul, on the real positions only when
        ``active`` says where they are (zeros past each row's length: never read)."""
        real = _real_rows(active, x.shape[0], x.shape[1], x.device)
        if real is None:
            return self.w_ih(x)
        flat = x.reshape(-1, x.shape[-1])
        gates = self.w_ih(flat.index_select(0, real))
        out = gates.new_zeros(flat.shape[0], gates.shape[1]).index_copy(0, real, gates)
        return out.view(*x.shape[:2], -1)

    def _infer(
        self, x_gates, h, cell, active, keep, cell_clip, proj_clip
    ) -> tuple[Tensor, LstmState]:
        """:func:`lstm_step` without autograd, on the rows still active (``active``: a
        finished row's state is kept as its final state, and it drops off the end)."""
        b, t, _ = x_gates.shape
        # cast once per layer, not per step (autocast does not cache non-leaf views)
        w_hh_t = self.w_hh.weight.t().to(x_gates.dtype)
        w_proj_t = self.w_proj.weight.t().to(x_gates.dtype)
        h, cell = h.to(x_gates.dtype), cell.to(cell_dtype(x_gates.dtype))
        h_last, c_last = h.clone(), cell.clone()  # rows that end before step 0 keep theirs
        out = x_gates.new_zeros(b, t, self.proj_dim)
        for step in range(t):
            if active is not None and active[step] < h.shape[0]:
                n = active[step]
                h_last[n : h.shape[0]], c_last[n : h.shape[0]] = h[n:], cell[n:]
                h, cell = h[:n], cell[:n]
            n = h.shape[0]
            if keep is not None:
                k = keep[:n, step, None]
                h, cell = h * k.to(h.dtype), cell * k.to(cell.dtype)
            h, cell, _ = lstm_step(
                x_gates[:n, step], h, cell, w_hh_t, w_proj_t, cell_clip, proj_clip
            )
            out[:n, step] = h
        h_last[: h.shape[0]], c_last[: h.shape[0]] = h, cell
        return out, (h_last, c_last)
