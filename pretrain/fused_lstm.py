"""One LSTM-with-projection layer as a single autograd node, for training.

    x_gates [B, T, 4C] (= x W_ih + b, all steps at once), W_hh^T [P, 4C], W_proj^T [C, P]
      -> h [B, T, P]

Autograd through a Python time loop records ~15 nodes a step and computes
each step's weight gradients as its own small ``[P, B] x [B, 4C]`` matmul.
Here the forward loop saves only what the backward needs (gate activations,
cell states, clip masks), the backward loop does backpropagation through time
for the per-step quantities, and the weight gradients are then two big
matmuls over all ``B * T`` rows, as cuDNN does. The per-step bodies
(``step_forward``, ``step_backward``) are plain functions without autograd,
so ``torch.compile`` turns each into one small fused kernel set, compiled once
for every sequence length.

Math and gate order (i, f, o, g) are those of ``elmo_service.model.LstmLayer``:
``c = clip(f * c + i * g)``, ``h = clip((o * tanh(c)) W_proj)``. Matmuls run in
the dtype of ``x_gates`` (bf16 under autocast); the cell state and the
element-wise backward are float32. ``tests/test_pretrain_train.py`` checks
the gradients against autograd through ``lstm_step``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def step_forward(
    x_gates: Tensor,
    h: Tensor,
    c: Tensor,
    w_hh_t: Tensor,
    w_proj_t: Tensor,
    cell_clip: float,
    proj_clip: float,
):
    """One step; returns (h, c, acts [B, 4C], c_mask [B, C], h_mask [B, P])."""
    n = c.shape[1]
    gates = torch.addmm(x_gates, h, w_hh_t)
    acts = torch.cat([torch.sigmoid(gates[:, : 3 * n]), torch.tanh(gates[:, 3 * n :])], dim=1)
    a = acts.float()
    c_raw = a[:, n : 2 * n] * c + a[:, :n] * a[:, 3 * n :]
    if cell_clip > 0:
        c_mask = c_raw.abs() <= cell_clip
        c = c_raw.clamp(-cell_clip, cell_clip)
    else:
        c_mask = torch.ones_like(c_raw, dtype=torch.bool)
        c = c_raw
    pre = (a[:, 2 * n : 3 * n] * torch.tanh(c)).to(w_proj_t.dtype) @ w_proj_t
    if proj_clip > 0:
        h_mask = pre.abs() <= proj_clip
        h = pre.clamp(-proj_clip, proj_clip)
    else:
        h_mask = torch.ones_like(pre, dtype=torch.bool)
        h = pre
    return h, c, acts, c_mask, h_mask


def step_backward(
    dh: Tensor,
    dc_next: Tensor,
    acts: Tensor,
    c: Tensor,
    c_prev: Tensor,
    c_mask: Tensor,
    h_mask: Tensor,
    w_hh_t: Tensor,
    w_proj_t: Tensor,
):
    """Backward of one step given dL/dh_t (output + recurrent) and dL/dc_t from step t+1.

    Returns (d_gates [B, 4C], d_pre [B, P], dL/dh_{t-1}, dL/dc_{t-1}); all float32.
    """
    n = c.shape[1]
    a = acts.float()
    i, f, o, g = a[:, :n], a[:, n : 2 * n], a[:, 2 * n : 3 * n], a[:, 3 * n :]
    d_pre = dh * h_mask
    dm = (d_pre.to(w_proj_t.dtype) @ w_proj_t.t()).float()
    tc = torch.tanh(c)
    dc = (dm * o * (1 - tc * tc) + dc_next) * c_mask
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


class LstmpFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_gates, w_hh_t, w_proj_t, cell_clip, proj_clip, fwd, bwd):
        b, t, g4 = x_gates.shape
        n, p = g4 // 4, w_proj_t.shape[1]
        dt = x_gates.dtype
        w_hh_t, w_proj_t = w_hh_t.to(dt), w_proj_t.to(dt)
        h = x_gates.new_zeros(b, p)
        c = x_gates.new_zeros(b, n, dtype=torch.float32)
        hs = x_gates.new_empty(b, t, p)
        acts = x_gates.new_empty(b, t, g4)
        cs = x_gates.new_empty(b, t, n, dtype=torch.float32)
        c_masks = torch.empty(b, t, n, dtype=torch.bool, device=x_gates.device)
        h_masks = torch.empty(b, t, p, dtype=torch.bool, device=x_gates.device)
        for s in range(t):
            h, c, acts[:, s], c_masks[:, s], h_masks[:, s] = fwd(
                x_gates[:, s], h, c, w_hh_t, w_proj_t, cell_clip, proj_clip
            )
            hs[:, s], cs[:, s] = h, c
        ctx.save_for_backward(w_hh_t, w_proj_t, hs, acts, cs, c_masks, h_masks)
        ctx.bwd = bwd
        return hs

    @staticmethod
    def backward(ctx, d_hs):
        w_hh_t, w_proj_t, hs, acts, cs, c_masks, h_masks = ctx.saved_tensors
        b, t, p = hs.shape
        n = cs.shape[2]
        d_hs = d_hs.float()
        d_gates = torch.empty(b, t, 4 * n, dtype=torch.float32, device=hs.device)
        d_pres = torch.empty(b, t, p, dtype=torch.float32, device=hs.device)
        dh = torch.zeros(b, p, dtype=torch.float32, device=hs.device)
        dc = torch.zeros(b, n, dtype=torch.float32, device=hs.device)
        zeros_c = torch.zeros(b, n, dtype=torch.float32, device=hs.device)
        for s in range(t - 1, -1, -1):
            c_prev = cs[:, s - 1] if s > 0 else zeros_c
            d_gates[:, s], d_pres[:, s], dh, dc = ctx.bwd(
                d_hs[:, s] + dh,
                dc,
                acts[:, s],
                cs[:, s],
                c_prev,
                c_masks[:, s],
                h_masks[:, s],
                w_hh_t,
                w_proj_t,
            )
        # weight gradients: one matmul each over all B*T rows
        dt = w_hh_t.dtype
        h_prev = torch.cat([hs.new_zeros(b, 1, p), hs[:, :-1]], dim=1).reshape(-1, p)
        m = (acts[:, :, 2 * n : 3 * n].float() * torch.tanh(cs)).reshape(-1, n)
        d_w_hh_t = (h_prev.to(dt).t() @ d_gates.reshape(-1, 4 * n).to(dt)).float()
        d_w_proj_t = (m.to(dt).t() @ d_pres.reshape(-1, p).to(dt)).float()
        return d_gates.to(dt), d_w_hh_t, d_w_proj_t, None, None, None, None


def lstmp_layer(
    x_gates: Tensor,
    w_hh_t: Tensor,
    w_proj_t: Tensor,
    cell_clip: float,
    proj_clip: float,
    fwd=step_forward,
    bwd=step_backward,
) -> Tensor:
    """``[B, T, 4C]`` gate inputs -> ``[B, T, P]`` outputs, from a zero state."""
    return LstmpFunction.apply(x_gates, w_hh_t, w_proj_t, cell_clip, proj_clip, fwd, bwd)
