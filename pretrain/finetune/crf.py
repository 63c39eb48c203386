"""A linear-chain CRF over a tagger's emission scores (Lafferty et al. 2001).

``score(y) = start[y_0] + Σ_t emit[t, y_t] + Σ_t trans[y_{t-1}, y_t] + end[y_last]``;
training minimises ``log Z - score(gold)`` with ``log Z`` from the forward
algorithm, decoding is Viterbi. Sequences are left-aligned: ``mask[b, t]`` is
True for the first ``length_b`` positions, and every sequence has at least one.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class CRF(nn.Module):
    def __init__(self, n_tags: int) -> None:
        super().__init__()
        self.n_tags = n_tags
        self.start = nn.Parameter(torch.zeros(n_tags))
        self.end = nn.Parameter(torch.zeros(n_tags))
        self.trans = nn.Parameter(torch.zeros(n_tags, n_tags))  # [from, to]

    def log_partition(self, emissions: Tensor, mask: Tensor) -> Tensor:
        """``emissions [B, T, K]``, ``mask [B, T]`` → ``log Z [B]`` (forward algorithm)."""
        alpha = self.start + emissions[:, 0]  # [B, K]
        for t in range(1, emissions.shape[1]):
            step = alpha.unsqueeze(2) + self.trans + emissions[:, t].unsqueeze(1)  # [B, K, K]
            alpha = torch.where(mask[:, t, None], torch.logsumexp(step, dim=1), alpha)
        return torch.logsumexp(alpha + self.end, dim=1)

    def path_score(self, emissions: Tensor, tags: Tensor, mask: Tensor) -> Tensor:
        """Score of the tag sequences ``tags [B, T]`` (padding ignored) → ``[B]``."""
        m = mask.to(emissions.dtype)
        emit = emissions.gather(2, tags.unsqueeze(2)).squeeze(2)  # [B, T]
        score = self.start[tags[:, 0]] + (emit * m).sum(1)
        score = score + (self.trans[tags[:, :-1], tags[:, 1:]] * m[:, 1:]).sum(1)
        last = tags.gather(1, (mask.sum(1, keepdim=True) - 1).clamp_min(0)).squeeze(1)
        return score + self.end[last]

    def nll(self, emissions: Tensor, tags: Tensor, mask: Tensor) -> Tensor:
        """Negative log-likelihood per sequence, ``[B]``."""
        return self.log_partition(emissions, mask) - self.path_score(emissions, tags, mask)

    @torch.no_grad()
    def decode(self, emissions: Tensor, mask: Tensor) -> list[list[int]]:
        """The best tag sequence of each sentence (Viterbi), each as long as its mask."""
        score = self.start + emissions[:, 0]  # [B, K]
        back = []
        for t in range(1, emissions.shape[1]):
            step = score.unsqueeze(2) + self.trans  # [B, K_from, K_to]
            best, idx = step.max(dim=1)
            back.append(idx)
            score = torch.where(mask[:, t, None], best + emissions[:, t], score)
        score = score + self.end
        lengths = mask.sum(1).tolist()
        out = []
        for b, n in enumerate(lengths):
            tag = int(score[b].argmax())
            path = [tag]
            for t in range(n - 1, 0, -1):
                tag = int(back[t - 1][b, tag])
                path.append(tag)
            out.append(path[::-1])
        return out
