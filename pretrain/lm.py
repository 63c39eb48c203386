"""The training-time language model around ``elmo_service.model.BiLM``.

    batch.uniq [U] --char table--> chars [U, W] --CharCNN--> vecs [U, P]
    vecs[batch.inverse] -> tokens [B, T, P]          (CNN once per DISTINCT token)
    tokens --fwd LSTMs--> h_f [B, T, P]   h_f[:, t] predicts ids[:, t+1]
    tokens --bwd LSTMs--> h_b [B, T, P]   h_b[:, t] predicts ids[:, t-1]
    loss = (sum NLL_f + sum NLL_b) / (2 n)   (forward only: sum NLL_f / n)

Each sentence is ``<S> w1 .. wn </S>``: both markers are targets (``</S>``
for the forward LM, ``<S>`` for the backward one), n + 1 predictions per
direction, as in bilm-tf. Indexing ``vecs[inverse]`` routes the gradient of
every occurrence back to its token's single CNN evaluation, so gradients are
those of running the CNN on every position.

The recurrence uses the parameters of the BiLM's own ``LstmLayer`` modules
with the math of ``LstmLayer.forward`` (input matmul hoisted out of the time
loop). Training runs each layer as one autograd node
(``pretrain.fused_lstm``: backpropagation through time by hand, weight
gradients as one matmul over all steps); evaluation loops over ``lstm_step``.
The per-step bodies are small functions that the trainer ``torch.compile``s
once for every sequence length (compiling the unrolled loop instead takes
minutes per shape).
Training-only changes: a forward-only mode that skips the backward LSTMs
(their parameters are frozen so DDP does not wait for their gradients), and
dropout on the top layer's output before the softmax (bilm-tf's output dropout).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from elmo_service.config import BiLMConfig
from elmo_service.model import BiLM, length_mask, reverse_padded
from pretrain.fused_lstm import lstmp_layer, step_backward, step_forward
from pretrain.softmax import make_softmax


def lstm_step(
    x_gates: Tensor,
    h: Tensor,
    cell: Tensor,
    w_hh_t: Tensor,
    w_proj_t: Tensor,
    cell_clip: float,
    proj_clip: float,
) -> tuple[Tensor, Tensor]:
    """One LSTM-with-projection step, gates packed (i, f, o, g) as in ``LstmLayer``.

    ``x_gates [B, 4C]`` (input matmul + bias), ``h [B, P]``, ``cell [B, C]``; a clip of 0 disables it.
    """
    c = cell.shape[1]
    gates = torch.addmm(x_gates, h, w_hh_t)
    ifo = torch.sigmoid(gates[:, : 3 * c])
    g = torch.tanh(gates[:, 3 * c :])
    cell = ifo[:, c : 2 * c] * cell + ifo[:, :c] * g
    if cell_clip > 0:
        cell = cell.clamp(-cell_clip, cell_clip)
    h = (ifo[:, 2 * c :] * torch.tanh(cell)) @ w_proj_t
    if proj_clip > 0:
        h = h.clamp(-proj_clip, proj_clip)
    return h, cell


class LanguageModel(nn.Module):
    def __init__(
        self,
        model_cfg: BiLMConfig,
        softmax_cfg,
        softmax_size: int,
        char_table: Tensor,
        directions: str = "both",
    ) -> None:
        super().__init__()
        self.bilm = BiLM(model_cfg)
        self.softmax = make_softmax(
            softmax_cfg.kind,
            model_cfg.projection_dim,
            softmax_size,
            softmax_cfg.n_samples,
            tuple(softmax_cfg.cutoffs),
            softmax_cfg.div_value,
        )
        self.register_buffer("char_table", char_table, persistent=False)
        self.directions = directions
        if directions == "forward":
            self.bilm.backward_layers.requires_grad_(False)
        # the trainer may swap these for compiled versions
        self.encode_fn = self.bilm.token_encoder.forward  # a function: not a registered submodule
        self.step_fn = lstm_step  # inference (eval) steps
        self.step_fwd_fn, self.step_bwd_fn = step_forward, step_backward  # training: fused layer
        self.loss_fn = self.softmax.loss

    def set_char_table(self, table: Tensor) -> None:
        self.char_table = table.to(self.char_table.device)

    def token_vectors(self, uniq: Tensor) -> Tensor:
        """``[U]`` token ids -> ``[U, P]``: the character CNN on each distinct token."""
        chars = self.char_table.index_select(0, uniq).long()
        return self.encode_fn(chars)

    def _layer(self, layer, x: Tensor) -> Tensor:
        """``LstmLayer.forward``'s math: ``[B, T, in] -> [B, T, P]``; fused for training."""
        b, t, _ = x.shape
        x_gates = layer.w_ih(x)  # [B, T, 4C], all steps at once
        cc, pc = float(layer.cell_clip or 0.0), float(layer.proj_clip or 0.0)
        if torch.is_grad_enabled() and x_gates.requires_grad:
            w_hh_t, w_proj_t = layer.w_hh.weight.t(), layer.w_proj.weight.t()
            return lstmp_layer(
                x_gates, w_hh_t, w_proj_t, cc, pc, self.step_fwd_fn, self.step_bwd_fn
            )
        # cast once per layer, not per step (autocast does not cache non-leaf views)
        w_hh_t, w_proj_t = (
            layer.w_hh.weight.t().to(x_gates.dtype),
            layer.w_proj.weight.t().to(x_gates.dtype),
        )
        h = x_gates.new_zeros(b, layer.proj_dim)
        cell = x_gates.new_zeros(
            b, layer.cell_dim, dtype=torch.float32
        )  # the cell state stays fp32 under bf16
        outs = []
        for step in range(t):
            h, cell = self.step_fn(x_gates[:, step], h, cell, w_hh_t, w_proj_t, cc, pc)
            outs.append(h)
        return torch.stack(outs, dim=1)

    def _direction(self, layers: nn.ModuleList, x: Tensor) -> Tensor:
        drop = self.bilm.dropout
        for i, layer in enumerate(layers):
            y = self._layer(layer, drop(x))
            x = y + x if (self.bilm.cfg.residual and i > 0) else y
        return x

    def hidden(self, tokens: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor | None]:
        """``tokens [B, T, P]`` -> top-layer states ``h_f``, ``h_b`` ``[B, T, P]``, position-aligned."""
        mask = length_mask(lengths, tokens.shape[1]).unsqueeze(-1).to(tokens.dtype)
        tokens = tokens * mask
        h_f = self.bilm.dropout(self._direction(self.bilm.forward_layers, tokens))
        if self.directions == "forward":
            return h_f, None
        h_b = self._direction(self.bilm.backward_layers, reverse_padded(tokens, lengths))
        return h_f, self.bilm.dropout(reverse_padded(h_b, lengths))

    def core(
        self, tokens: Tensor, lengths: Tensor, targets: Tensor, cand: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Training losses: (loss, sum NLL_f, sum NLL_b) over real predictions (float32)."""
        h_f, h_b = self.hidden(tokens, lengths)
        b, t, p = h_f.shape
        # position t (0..T-2) makes a prediction iff t+1 < length, in both directions
        m = length_mask(lengths, t)[:, 1:].reshape(-1).float()
        n = m.sum().clamp_min(1.0)
        nll_f = (
            self.loss_fn(h_f[:, :-1].reshape(-1, p), targets[:, 1:].reshape(-1), cand) * m
        ).sum()
        if h_b is None:
            return nll_f / n, nll_f.detach(), torch.zeros_like(nll_f)
        nll_b = (
            self.loss_fn(h_b[:, 1:].reshape(-1, p), targets[:, :-1].reshape(-1), cand) * m
        ).sum()
        return (nll_f + nll_b) / (2 * n), nll_f.detach(), nll_b.detach()

    def forward(self, batch) -> tuple[Tensor, Tensor, Tensor]:
        vecs = self.token_vectors(batch.uniq)
        tokens = vecs[batch.inverse]
        return self.core(tokens, batch.lengths, batch.targets, self.softmax.sample())

    @torch.no_grad()
    def exact_nll(self, batch) -> tuple[float, float, int]:
        """Exact (full-softmax) summed NLL of both directions and the prediction count."""
        chars = self.char_table.index_select(0, batch.uniq).long()
        tokens = self.bilm.token_encoder(chars)[batch.inverse]  # eager: no compile for eval
        h_f, h_b = self.hidden(tokens, batch.lengths)
        p = h_f.shape[-1]
        m = length_mask(batch.lengths, h_f.shape[1])[:, 1:].reshape(-1)
        tf = batch.targets[:, 1:].reshape(-1)[m]
        nf = self.softmax.nll(h_f[:, :-1].reshape(-1, p)[m].float(), tf).double().sum().item()
        nb = 0.0
        if h_b is not None:
            tb = batch.targets[:, :-1].reshape(-1)[m]
            nb = self.softmax.nll(h_b[:, 1:].reshape(-1, p)[m].float(), tb).double().sum().item()
        return nf, nb, int(m.sum())
