"""The task networks: one shape per task kind, the same for every arm.

* ``baseline``: context-free token representations ``x_k`` only: a trainable
  word embedding (lower-cased training words) concatenated with a character CNN
  (width-3 filters, max-pooled) trained on the task;
* ``elmo+baseline``: ``[x_k; ELMo_k]`` with ``ELMo_k = γ Σ_j softmax(s)_j h_kj``
  over the frozen biLM's layers, ``s`` and ``γ`` learned with the network
  (Peters et al. 2018, §3.3); ``elmo_at="output"`` puts ELMo at the biLSTM's
  output instead (``[h_k; ELMo_k]``), ``"both"`` at both, each with its own mix;
* ``probe``: the linear probe, for comparison: ELMo mix → linear (tokens), or
  mean-pooled mix → linear (sentences).

Tagging: biLSTM → linear → tags, or a CRF over those scores. Classification:
biLSTM → max- and mean-pooling over the words → linear.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from elmo_pretrain.finetune.crf import CRF
from elmo_pretrain.finetune.data import PAD, Batch
from elmo_pretrain.finetune.options import FinetuneConfig
from elmo_service.scalar_mix import ScalarMix

ARMS = ("baseline", "elmo+baseline", "probe")


class CharCNN(nn.Module):
    """``[B, T, C]`` character ids → ``[B, T, filters]``: width-3 convolution, max over characters."""

    def __init__(self, n_chars: int, dim: int, filters: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(n_chars, dim, padding_idx=PAD)
        self.conv = nn.Conv1d(dim, filters, kernel_size=3, padding=1)

    def forward(self, chars: Tensor) -> Tensor:
        b, t, c = chars.shape
        x = self.embed(chars.view(b * t, c)).transpose(1, 2)  # [BT, dim, C]
        h = torch.relu(self.conv(x)).amax(dim=2)
        return h.view(b, t, -1)


class TokenRepresentation(nn.Module):
    """The baseline's context-free ``x_k``: word embedding ⊕ character CNN."""

    def __init__(self, n_words: int, n_chars: int, cfg: FinetuneConfig) -> None:
        super().__init__()
        self.words = nn.Embedding(n_words, cfg.word_dim, padding_idx=PAD)
        self.chars = CharCNN(n_chars, cfg.char_dim, cfg.char_filters)
        self.dim = cfg.word_dim + cfg.char_filters

    def forward(self, batch: Batch) -> Tensor:
        if batch.char_features is not None:  # evaluation: the CNN ran once per spelling
            chars = batch.char_features[batch.spellings]
        else:
            chars = self.chars(batch.chars)
        return torch.cat([self.words(batch.words), chars], dim=-1)


class TaskNetwork(nn.Module):
    """One arm's network. ``forward`` gives tag scores ``[B, T, K]`` or class scores ``[B, K]``."""

    def __init__(
        self,
        arm: str,
        tokens: bool,
        n_classes: int,
        n_words: int,
        n_chars: int,
        n_layers: int,
        elmo_dim: int,
        cfg: FinetuneConfig,
        crf: bool = False,
    ) -> None:
        super().__init__()
        if arm not in ARMS:
            raise ValueError(f"arm must be one of {ARMS}, not {arm!r}")
        self.arm, self.tokens = arm, tokens
        self.drop = nn.Dropout(cfg.dropout)
        self.tokens_in = self.mix_in = self.mix_out = self.lstm = self.crf = None
        elmo_in = arm == "probe" or (arm == "elmo+baseline" and cfg.elmo_at != "output")
        elmo_out = arm == "elmo+baseline" and cfg.elmo_at != "input"
        if elmo_in:
            self.mix_in = ScalarMix(n_layers, per_direction=cfg.per_direction)
        if elmo_out:
            self.mix_out = ScalarMix(n_layers, per_direction=cfg.per_direction)
        if arm == "probe":
            self.out = nn.Linear(elmo_dim, n_classes)
            return
        self.tokens_in = TokenRepresentation(n_words, n_chars, cfg)
        d_in = self.tokens_in.dim + (elmo_dim if elmo_in else 0)
        self.lstm = nn.LSTM(d_in, cfg.hidden, batch_first=True, bidirectional=True)
        d_out = 2 * cfg.hidden + (elmo_dim if elmo_out else 0)
        self.out = nn.Linear(d_out if tokens else 2 * d_out, n_classes)
        if crf:
            self.crf = CRF(n_classes)

    @property
    def stored_mix(self) -> ScalarMix:
        """The mix to store as the task: the input one, else the output one."""
        return self.mix_in if self.mix_in is not None else self.mix_out

    def elmo_input(self, batch: Batch) -> Tensor:
        """``ELMo_k`` as the network consumes it (before dropout): ``[B, T, D]``."""
        return self.stored_mix(batch.elmo, batch.mask)

    def forward(self, batch: Batch) -> Tensor:
        mask = batch.mask
        if self.arm == "probe":
            h = self.drop(self.mix_in(batch.elmo, mask))
            if not self.tokens:
                h = _mean(h, mask)
            return self.out(h)
        x = self.tokens_in(batch)
        if self.mix_in is not None:
            x = torch.cat([x, self.mix_in(batch.elmo, mask)], dim=-1)
        lengths = mask.sum(1).cpu()
        packed = pack_padded_sequence(self.drop(x), lengths, batch_first=True, enforce_sorted=False)
        h, _ = pad_packed_sequence(self.lstm(packed)[0], batch_first=True, total_length=x.shape[1])
        if self.mix_out is not None:
            h = torch.cat([h, self.mix_out(batch.elmo, mask)], dim=-1)
        h = self.drop(h)
        if not self.tokens:
            h = torch.cat([_max(h, mask), _mean(h, mask)], dim=-1)
        return self.out(h)

    def loss(self, scores: Tensor, batch: Batch) -> Tensor:
        if not self.tokens:
            return nn.functional.cross_entropy(scores, batch.labels)
        if self.crf is not None:
            return self.crf.nll(scores, batch.labels, batch.mask).mean()
        return nn.functional.cross_entropy(scores[batch.mask], batch.labels[batch.mask])

    @torch.no_grad()
    def predict(self, batch: Batch) -> list[list[int]] | list[int]:
        """Per sentence: its tag ids, or its class id."""
        scores = self(batch)
        if not self.tokens:
            return scores.argmax(-1).tolist()
        if self.crf is not None:
            return self.crf.decode(scores, batch.mask)
        best = scores.argmax(-1)
        return [best[b, :n].tolist() for b, n in enumerate(batch.mask.sum(1).tolist())]


def _mean(h: Tensor, mask: Tensor) -> Tensor:
    m = mask.unsqueeze(-1).to(h.dtype)
    return (h * m).sum(1) / m.sum(1).clamp_min(1.0)


def _max(h: Tensor, mask: Tensor) -> Tensor:
    return h.masked_fill(~mask.unsqueeze(-1), float("-inf")).amax(1)
