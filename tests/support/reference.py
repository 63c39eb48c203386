"""The one textbook biLM every test and bench compares against.

Written for reading, not speed, from the model's weights (``BiLM``), one
sentence at a time, with nothing shared with the code under test:

* the character CNN: every window of every filter as its own dot product,
  max over positions, activation; highway layers (:func:`highway`); projection;
* the LSTMP cell with named gates (:func:`lstmp_step`, AllenNLP's
  ``LstmCellWithProjection`` order of operations), the input matmul inside the
  step loop (:func:`lstmp_cell`);
* both directions, residual connections from layer 2 on.

The cell and the highway take rows ``[..., D]``, so the benches' naive
baselines (``bench/bench_embedder.py``, ``bench/bench_train.py``) run them
batched, and ``tests/elmo_service/test_lstm.py`` differentiates through them.

``dtype=torch.float64`` runs it all in double precision (the oracle the
parity tests use to tell a kernel's float32 error from a wrong formula).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from elmo_service.bilm.char_ids import sentence_ids
from elmo_service.bilm.model import BiLM


def char_cnn(model: BiLM, ids: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Character ids ``[N, W]`` -> token vectors ``[N, P]``."""
    enc, cfg = model.token_encoder, model.cfg
    emb = enc.char_embed.weight.to(dtype)[ids]  # [N, W, D]
    act = torch.tanh if cfg.activation == "tanh" else F.relu
    feats = []
    for (width, _), conv in zip(cfg.filters, enc.convs, strict=True):
        w, b = conv.weight.to(dtype), conv.bias.to(dtype)
        windows = [
            torch.einsum("nkd,fdk->nf", emb[:, p : p + width], w) + b
            for p in range(ids.shape[1] - width + 1)
        ]
        feats.append(act(torch.stack(windows, dim=1).max(dim=1).values))
    x = torch.cat(feats, dim=-1)
    for hw in enc.highways:
        x = highway(x, hw, dtype)
    return F.linear(x, enc.projection.weight.to(dtype), enc.projection.bias.to(dtype))


def highway(x: Tensor, hw: torch.nn.Linear, dtype: torch.dtype = torch.float32) -> Tensor:
    """One highway layer ``[..., F] -> [..., F]``: ``g * relu(t) + (1 - g) * x``, with the
    transform ``t`` and the carry gate's input in one matmul's rows ``[t ; g]``."""
    transform, carry = F.linear(x, hw.weight.to(dtype), hw.bias.to(dtype)).chunk(2, dim=-1)
    gate = torch.sigmoid(carry)
    return gate * F.relu(transform) + (1 - gate) * x


def lstmp_step(
    x_gates: Tensor,
    h: Tensor,
    c: Tensor,
    w_hh: Tensor,
    w_proj: Tensor,
    cell_clip: float | None,
    proj_clip: float | None,
) -> tuple[Tensor, Tensor]:
    """One step of an LSTM with projection, gates (i, f, o, g).

    ``x_gates [..., 4C]``: the input's part of the gates (``x W_ih^T + b``);
    ``h [..., P]``, ``c [..., C]``; ``w_hh [4C, P]``, ``w_proj [P, C]``. A clip of
    None (or 0) is off. Returns the new ``(h, c)``.
    """
    n = c.shape[-1]
    gates = x_gates + h @ w_hh.t()
    input_gate = torch.sigmoid(gates[..., :n])
    forget_gate = torch.sigmoid(gates[..., n : 2 * n])
    output_gate = torch.sigmoid(gates[..., 2 * n : 3 * n])
    memory_input = torch.tanh(gates[..., 3 * n :])
    c = input_gate * memory_input + forget_gate * c
    if cell_clip:
        c = c.clamp(-cell_clip, cell_clip)
    h = (output_gate * torch.tanh(c)) @ w_proj.t()
    if proj_clip:
        h = h.clamp(-proj_clip, proj_clip)
    return h, c


def lstmp_cell(
    x: Tensor, h: Tensor, c: Tensor, layer, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """:func:`lstmp_step` of an ``LstmLayer``, the input matmul included: ``x [..., in]``."""
    x_gates = F.linear(x, layer.w_ih.weight.to(dtype), layer.w_ih.bias.to(dtype))
    w_hh, w_proj = layer.w_hh.weight.to(dtype), layer.w_proj.weight.to(dtype)
    return lstmp_step(x_gates, h, c, w_hh, w_proj, layer.cell_clip, layer.proj_clip)


def lstm_direction(layer, xs: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """One direction of one layer over one sentence ``[T, in]`` from a zero state -> ``[T, P]``."""
    h = torch.zeros(layer.proj_dim, dtype=dtype)
    c = torch.zeros(layer.cell_dim, dtype=dtype)
    outs = []
    for x in xs:
        h, c = lstmp_cell(x, h, c, layer, dtype)
        outs.append(h)
    return torch.stack(outs) if outs else xs.new_zeros(0, layer.proj_dim)


def bilstm(model: BiLM, e: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Token vectors of one sentence ``[T, P]`` -> layers ``[L+1, T, 2P]``."""
    e = e.to(dtype)
    layers = [torch.cat([e, e], dim=-1)]
    fwd_in, bwd_in = e, e.flip(0)
    for i, (fwd, bwd) in enumerate(zip(model.forward_layers, model.backward_layers, strict=True)):
        f, r = lstm_direction(fwd, fwd_in, dtype), lstm_direction(bwd, bwd_in, dtype)
        if model.cfg.residual and i > 0:
            f, r = f + fwd_in, r + bwd_in
        fwd_in, bwd_in = f, r
        layers.append(torch.cat([f, r.flip(0)], dim=-1))
    return torch.stack(layers)


@torch.no_grad()
def reference_bilm(model: BiLM, tokens: list[str], dtype: torch.dtype = torch.float32) -> Tensor:
    """One sentence (markers included) -> ``[L+1, T+2, 2P]``."""
    ids = torch.from_numpy(sentence_ids(tokens, model.cfg.max_chars_per_token))
    return bilstm(model, char_cnn(model, ids, dtype), dtype)
