"""The training-time language model: ``elmo_service.bilm.model.BiLM`` + a softmax.

    batch.uniq [U] --char table--> chars [U, W] --BiLM.token_encoder--> vecs [U, P]
    vecs[batch.inverse] -> tokens [B, T, P]               (CNN once per DISTINCT token)
    tokens --BiLM.run_direction("forward")--> h_f [B, T, P]   h_f[:, t] predicts the next token
    reversed --BiLM.run_direction("backward")--> h_b          h_b[:, t] predicts the previous one
    loss = (sum NLL_f + sum NLL_b) / (2 n)                (forward only: sum NLL_f / n)

The LSTM math is the BiLM's own (``elmo_service/bilm/lstm.py``): this module never
touches gates or weights; it picks the top layer, applies the output dropout
(bilm-tf's, before the softmax) and scores it. Indexing ``vecs[inverse]``
routes the gradient of every occurrence back to its token's single CNN
evaluation, so gradients are those of running the CNN on every position.

Two training regimes (``data.mode``):

* **sentences**: each row is ``<S> w1 .. wn </S>`` from a zero state; both
  markers are targets (``</S>`` forward, ``<S>`` backward), n + 1 predictions
  per direction, as the stateless embedder computes at inference.
* **stream** (bilm-tf, Kim et al. 2016): rows are windows of a token stream;
  the final LSTM state of each window is the (detached) initial state of the
  row's next window. Each direction reads its own rows (the backward LM reads
  them reversed); ``keep`` masks reset the state at some sentence starts. The
  transition from one sentence's end marker to the next one's start marker
  is not a prediction, so the count is again n + 1 per sentence.

Training-only changes: a forward-only mode that skips the backward LSTMs
(their parameters are frozen so DDP does not wait for their gradients).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from elmo_pretrain.softmax import make_softmax
from elmo_service.bilm.config import BiLMConfig
from elmo_service.bilm.lstm import LstmState
from elmo_service.bilm.model import BiLM, length_mask, reverse_padded

# carried stream state: per direction, per layer (h [B, P], c [B, C])
StreamState = dict[str, list[LstmState]]


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
        # "mean": the loss is the mean NLL per prediction; "sum_over_time": summed over each
        # row's steps, averaged over rows (Zaremba et al. 2014, Kim et al. 2016, whose SGD lr 1
        # assumes it: the gradient is ~T times the mean's). Set by the trainer from optim.
        self.loss_reduction = "mean"
        # the trainer may swap these for compiled versions
        self.encode_fn = self.bilm.token_encoder.forward  # a function: not a registered submodule
        self.loss_fn = self.softmax.loss

    @property
    def direction_names(self) -> tuple[str, ...]:
        return ("forward",) if self.directions == "forward" else ("forward", "backward")

    def set_char_table(self, table: Tensor) -> None:
        self.char_table = table.to(self.char_table.device)

    def token_vectors(self, uniq: Tensor) -> Tensor:
        """``[U]`` token ids -> ``[U, P]``: the character CNN on each distinct token."""
        chars = self.char_table.index_select(0, uniq).long()
        return self.encode_fn(chars)

    def _top(self, direction: str, x: Tensor, state=None, keep=None) -> tuple[Tensor, list]:
        """The top layer of one direction, output dropout applied: ``[B, T, P]``, final states."""
        outs, states = self.bilm.run_direction(direction, x, state, keep=keep)
        return self.bilm.dropout(outs[-1]), states

    # ------------------------------------------------------------ sentence mode

    def hidden(self, tokens: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor | None]:
        """``tokens [B, T, P]`` -> top-layer states ``h_f``, ``h_b`` ``[B, T, P]``, position-aligned."""
        mask = length_mask(lengths, tokens.shape[1]).unsqueeze(-1).to(tokens.dtype)
        tokens = tokens * mask
        h_f, _ = self._top("forward", tokens)
        if self.directions == "forward":
            return h_f, None
        h_b, _ = self._top("backward", reverse_padded(tokens, lengths))
        return h_f, reverse_padded(h_b, lengths)

    def core(
        self, tokens: Tensor, lengths: Tensor, targets: Tensor, cand: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Training losses: (loss, sum NLL_f, sum NLL_b) over real predictions (float32)."""
        h_f, h_b = self.hidden(tokens, lengths)
        b, t, p = h_f.shape
        # position t (0..T-2) makes a prediction iff t+1 < length, in both directions
        m = length_mask(lengths, t)[:, 1:].reshape(-1).float()
        n = m.sum().clamp_min(1.0)
        if self.loss_reduction == "sum_over_time":
            n = (lengths > 1).sum().clamp_min(1).float()  # rows holding a sentence
        nll_f = (
            self.loss_fn(h_f[:, :-1].reshape(-1, p), targets[:, 1:].reshape(-1), cand) * m
        ).sum()
        if h_b is None:
            return nll_f / n, nll_f.detach(), torch.zeros_like(nll_f)
        nll_b = (
            self.loss_fn(h_b[:, 1:].reshape(-1, p), targets[:, :-1].reshape(-1), cand) * m
        ).sum()
        return (nll_f + nll_b) / (2 * n), nll_f.detach(), nll_b.detach()

    def forward(self, batch, state: StreamState | None = None, stream: bool = False):
        """Training losses of a ``Batch`` (sentence mode: loss, NLL_f, NLL_b) or, with
        ``stream``, of a ``StreamBatch`` from ``state`` (see :meth:`stream_forward`).
        One entry point, so that DDP wraps both regimes."""
        if stream:
            return self.stream_forward(batch, state)
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

    # ------------------------------------------------------------ stream mode

    def stream_forward(
        self, batch, state: StreamState | None
    ) -> tuple[Tensor, Tensor, Tensor, StreamState]:
        """One window per row and direction, from the carried ``state``.

        Returns (loss: the mean of the directions' mean NLLs, sum NLL_f, sum
        NLL_b, the new detached state).
        """
        vecs = self.token_vectors(batch.uniq)
        cand = self.softmax.sample()
        nll, mean, new_state = {}, {}, {}
        for d in self.direction_names:
            win = batch.windows[d]
            h, states = self._top(
                d, vecs[win.inverse], None if state is None else state[d], win.keep
            )
            p = h.shape[-1]
            losses = self.loss_fn(h.reshape(-1, p), win.targets.reshape(-1), cand)
            nll[d] = (losses * win.mask.reshape(-1)).sum()
            denom = win.ids.shape[0] if self.loss_reduction == "sum_over_time" else win.n_pred
            mean[d] = nll[d] / max(denom, 1)
            new_state[d] = [(hh.detach(), cc.detach()) for hh, cc in states]
        loss = sum(mean.values()) / len(mean)
        nll_b = nll.get("backward", torch.zeros_like(nll["forward"]))
        return loss, nll["forward"].detach(), nll_b.detach(), new_state

    @torch.no_grad()
    def stream_nll(self, batch, state: StreamState | None) -> tuple[float, float, int, StreamState]:
        """Exact summed NLL of one stream window per direction, and the carried state."""
        vecs = self.bilm.token_encoder(self.char_table.index_select(0, batch.uniq).long())
        nll, new_state = {"forward": 0.0, "backward": 0.0}, {}
        for d in self.direction_names:
            win = batch.windows[d]
            h, new_state[d] = self._top(
                d, vecs[win.inverse], None if state is None else state[d], win.keep
            )
            m = win.mask.reshape(-1)
            hm = h.reshape(-1, h.shape[-1])[m].float()
            nll[d] = self.softmax.nll(hm, win.targets.reshape(-1)[m]).double().sum().item()
        return nll["forward"], nll["backward"], batch.windows["forward"].n_pred, new_state
