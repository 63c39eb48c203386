"""The serving kernel of the biLSTM: both directions of a layer in one step loop.

    x [2, T, B, P] (direction, time, rows sorted longest first) --> per layer [2, T, B, P]

The same function as ``LstmLayer``'s inference kernel (``elmo_service/lstm.py``)
run for each direction and layer, with fewer, larger operations per step:

* both directions advance together: one set of element-wise ops covers the
  ``[2, n, 4C]`` gates of both, so a step of a layer is ~12 torch calls
  instead of ~26;
* weights are packed once per weight version (:class:`PackedLinear`: oneDNN
  reordered for several rows, ``W^T`` for a single row, int8 when asked) and
  pre-scaled so that no step multiplies by a constant: the g-gate rows of
  ``W_ih``, ``b`` and ``W_hh`` are doubled, so one sigmoid gives
  ``sigmoid(2g)``, and ``tanh(g) = 2 sigmoid(2g) - 1``; the cell is kept
  doubled (``c2 = 2c``, exact in floating point), so ``tanh(c) =
  2 sigmoid(c2) - 1``; and ``W_proj`` is doubled so the projection reads
  ``o * (sigmoid(c2) - 1/2) = o * tanh(c) / 2``. Scaling by 2 is exact, so
  these are the same numbers as the textbook formulas up to summation order;
* torch's CPU ``tanh`` is ~4x slower than ``sigmoid``; none is used.

Layers run one after the other, each input matmul hoisted over all steps.
Running layer l+1 one step behind layer l in the same loop ("pipelining")
was measured and not kept: at batch 1 the step cost is the weight traffic,
which pipelining increases (layer l+1's input matmul moves into the loop).
"""

from __future__ import annotations

import torch
from torch import Tensor

from elmo_service.lstm import LstmLayer
from elmo_service.packed import PackedLinear


def _gate_scale(c: int, like: Tensor) -> Tensor:
    """``[4C]``: 1 for the i, f, o rows, 2 for the g rows."""
    s = like.new_ones(4 * c)
    s[3 * c :] = 2.0
    return s


class BiLstmKernel:
    """Kernel-layout weights of an L-layer biLSTM and its inference loop.

    ``layers``: per layer, the (forward, backward) :class:`LstmLayer` pair.
    ``weights``: "fp32", or "int8" for the recurrent and projection matmuls
    (their inputs have static ranges: the clipped state and ``|o * tanh(c)|
    / 2 < 1/2``); the input matmuls, run once per batch over all steps, stay
    fp32. Without a projection clip the recurrent matmul stays fp32.
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
        for pair in layers:
            scale = _gate_scale(c, pair[0].w_ih.weight)
            self.w_ih.append(
                [PackedLinear(m.w_ih.weight * scale[:, None], m.w_ih.bias * scale) for m in pair]
            )
            h_range = self.proj_clip if int8 else 0.0
            self.w_hh.append(
                [PackedLinear(m.w_hh.weight * scale[:, None], int8_range=h_range) for m in pair]
            )
            self.w_proj.append(
                [PackedLinear(2.0 * m.w_proj.weight, int8_range=0.5 if int8 else 0.0) for m in pair]
            )

    def __call__(self, x: Tensor, active: list[int]) -> list[Tensor]:
        """``x [2, T, B, P]`` (time-major; row b of direction 1 is sentence b reversed
        within its length) -> each layer's output ``[2, T, B, P]``, zero past each
        row's length. ``active[t]``: rows still inside their sentence at step t."""
        outs = []
        for layer in range(len(self.w_ih)):
            y = self._layer(layer, x, active)
            if self.residual and layer > 0:
                y.add_(x)
            outs.append(y)
            x = y
        return outs

    def _layer(self, layer: int, x: Tensor, active: list[int]) -> Tensor:
        _, t, b, p = x.shape
        c = self.cell_dim
        w_hh, w_proj = self.w_hh[layer], self.w_proj[layer]
        # input matmuls for all steps at once, per direction [T, B, 4C]
        xg = [w(x[d].reshape(t * b, p)).view(t, b, 4 * c) for d, w in enumerate(self.w_ih[layer])]
        out = x.new_zeros(2, t, b, p)
        h = x.new_zeros(2, b, p)
        c2 = x.new_zeros(2, b, c)  # 2 * cell state
        cc2, pc = 2.0 * self.cell_clip, self.proj_clip
        for s in range(t):
            n = active[s]
            if n == 0:
                break
            if n < h.shape[1]:  # rows sorted longest first: finished rows drop off the end
                h, c2 = h[:, :n], c2[:, :n]
            gates = torch.stack([w_hh[d](h[d], add=xg[d][s, :n]) for d in (0, 1)])
            gates.sigmoid_()  # i, f, o, sigmoid(2g)
            i, f, o, g = gates.split(c, dim=2)
            # 2c' = f * 2c + 2i * tanh(g) = f * c2 + 4 i sigmoid(2g) - 2 i
            c2.mul_(f).addcmul_(i, g, value=4.0).sub_(i, alpha=2.0)
            if cc2:
                c2.clamp_(-cc2, cc2)
            m = torch.sigmoid(c2).sub_(0.5).mul_(o)  # o * tanh(c) / 2
            h = torch.stack([w_proj[d](m[d]) for d in (0, 1)])  # [2, n, P]
            if pc:
                h.clamp_(-pc, pc)
            out[:, s, :n] = h
        return out
