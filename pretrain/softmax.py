"""Output layers of the language model: full, sampled and adaptive softmax.

All map hidden states ``h [N, P]`` and targets ``[N]`` to per-position losses
``[N]`` (training) and give exact log-probabilities ``[N, V]`` or exact
target NLLs (evaluation). One softmax is shared by the forward and the
backward LM, as in bilm-tf.

Sampled softmax (Jean et al. 2015, TF's ``sampled_softmax_loss``): one set of
``n`` distinct negatives per batch, drawn from the log-uniform (Zipf)
distribution ``p(k) = log((k+2)/(k+1)) / log(V+1)`` over frequency-sorted
ids. Logits are corrected by ``log Q(k)``, the probability that k is in the
sample; targets that were also drawn as negatives are masked. Negatives are
drawn without replacement with Gumbel-top-k, for which Q(k) is taken as
``1 - (1 - p(k))^m`` with m chosen so that sum_k Q(k) = n (TF's
approximation). With ``n >= V`` every id is a candidate, Q = 1 and the loss is
the full softmax loss exactly.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def log_uniform_probs(v: int) -> Tensor:
    k = torch.arange(v, dtype=torch.float64)
    return (torch.log(k + 2) - torch.log(k + 1)) / math.log(v + 1)


def inclusion_log_q(p: Tensor, n: int) -> Tensor:
    """log Q(k) for a sample of ``n`` distinct ids: Q = 1 - (1-p)^m, sum Q = n."""
    lo, hi = float(n), float(n)
    while (-torch.expm1(hi * torch.log1p(-p))).sum() < n:
        hi *= 2
    for _ in range(100):  # bisection on m
        mid = (lo + hi) / 2
        if (-torch.expm1(mid * torch.log1p(-p))).sum() < n:
            lo = mid
        else:
            hi = mid
    return torch.log(-torch.expm1(hi * torch.log1p(-p)))


class LinearSoftmax(nn.Module):
    """Full softmax ``h W^T + b``; with ``n_samples < V`` it trains sampled."""

    def __init__(self, dim: int, vocab: int, n_samples: int | None = None) -> None:
        super().__init__()
        self.vocab = vocab
        self.weight = nn.Parameter(torch.randn(vocab, dim) / math.sqrt(dim))  # bilm-tf init
        self.bias = nn.Parameter(torch.zeros(vocab))
        self.sampled = n_samples is not None and n_samples < vocab
        self.n_samples = n_samples if self.sampled else vocab
        if self.sampled:
            p = log_uniform_probs(vocab)
            self.register_buffer("log_p", p.log().float(), persistent=False)
            self.register_buffer(
                "log_q", inclusion_log_q(p, self.n_samples).float(), persistent=False
            )

    def sample(self) -> Tensor | None:
        """``[n]`` distinct negative ids (Gumbel-top-k on the global torch RNG), or None."""
        if not self.sampled or not self.training:
            return None
        gumbel = -torch.empty_like(self.log_p).exponential_().log()
        return torch.topk(self.log_p + gumbel, self.n_samples, sorted=False).indices

    def loss(self, h: Tensor, targets: Tensor, cand: Tensor | None = None) -> Tensor:
        """Per-position loss ``[N]`` (float32). ``cand`` from :meth:`sample` or None (full)."""
        if cand is None:
            logits = F.linear(h, self.weight, self.bias).float()
            return F.cross_entropy(logits, targets, reduction="none")
        true = (
            (h * self.weight[targets].to(h.dtype)).sum(-1).float()
            + self.bias[targets]
            - self.log_q[targets]
        )
        neg = F.linear(h, self.weight[cand], self.bias[cand]).float() - self.log_q[cand]
        neg = neg.masked_fill(
            cand.unsqueeze(0) == targets.unsqueeze(1), float("-inf")
        )  # accidental hits
        logits = torch.cat([true.unsqueeze(1), neg], dim=1)
        return torch.logsumexp(logits, dim=1) - true

    def log_probs(self, h: Tensor) -> Tensor:
        return F.log_softmax(F.linear(h, self.weight, self.bias).float(), dim=-1)

    def nll(self, h: Tensor, targets: Tensor) -> Tensor:
        """Exact ``-log p(target)`` ``[N]``."""
        return -self.log_probs(h).gather(1, targets.unsqueeze(1)).squeeze(1)


class AdaptiveSoftmax(nn.Module):
    """``nn.AdaptiveLogSoftmaxWithLoss`` (Grave et al. 2017) over frequency-sorted ids."""

    def __init__(self, dim: int, vocab: int, cutoffs: tuple[int, ...], div_value: float) -> None:
        super().__init__()
        cutoffs = [c for c in cutoffs if 0 < c < vocab - 1]
        self.vocab = vocab
        self.n_samples = vocab
        self.asm = nn.AdaptiveLogSoftmaxWithLoss(
            dim, vocab, cutoffs or [max(1, vocab // 2)], div_value=div_value
        )

    def sample(self) -> None:
        return None

    # fp32 inside, autocast or not: under bf16 autocast the module's clusters
    # return bf16 log-probs that it index_copy_s into a float32 output (an error).
    def loss(self, h: Tensor, targets: Tensor, cand: Tensor | None = None) -> Tensor:
        with torch.autocast(h.device.type, enabled=False):
            return -self.asm(h.float(), targets).output

    def log_probs(self, h: Tensor) -> Tensor:
        with torch.autocast(h.device.type, enabled=False):
            return self.asm.log_prob(h.float())

    def nll(self, h: Tensor, targets: Tensor) -> Tensor:
        return self.loss(h, targets)


def make_softmax(
    kind: str, dim: int, vocab: int, n_samples: int, cutoffs: tuple[int, ...], div_value: float
) -> nn.Module:
    if kind == "full":
        return LinearSoftmax(dim, vocab)
    if kind == "sampled":
        return LinearSoftmax(dim, vocab, n_samples)
    return AdaptiveSoftmax(dim, vocab, cutoffs, div_value)
