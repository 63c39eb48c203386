"""The ELMo biLM (Peters et al. 2018), readable in one file.

    char ids [B, T, W] --CharCNN--> tokens [B, T, P] --L x biLSTM--> layers [L+1, B, T, 2P]

* ``CharCNN``: embed each of the W byte ids of a token, one 1-D convolution
  per filter width over the W positions, max over positions, activation;
  ``n_highway`` highway layers; linear projection to P.
* ``LstmLayer``: one direction of one LSTM layer with a projection
  (``lstm_dim`` cells -> P), cell and projection clipping.
* ``BiLM``: L LSTM layers per direction with separate weights, residual
  connections from layer 2 on. The backward direction reads each sentence
  from its own last real token. Every sentence starts from a zero state.

Layer 0 of the output is ``[e ; e]``; layer l is ``[h_fwd_l ; h_bwd_l]``,
both aligned to the token positions. Positions past a sentence's length
(batch padding) are zero in every layer.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from elmo_service.config import BiLMConfig

N_CHAR_IDS = 262  # 256 bytes + 5 markers, shifted by one so that row 0 is "no token"


class CharCNN(nn.Module):
    """Token encoder: character ids ``[N, W]`` -> token vectors ``[N, P]``."""

    def __init__(self, cfg: BiLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.char_embed = nn.Embedding(N_CHAR_IDS, cfg.char_dim, padding_idx=0)
        self.convs = nn.ModuleList(nn.Conv1d(cfg.char_dim, n, w) for w, n in cfg.filters)
        n_filters = cfg.n_filters
        # each highway layer is one matmul: rows [transform ; carry]
        self.highways = nn.ModuleList(
            nn.Linear(n_filters, 2 * n_filters) for _ in range(cfg.n_highway)
        )
        self.projection = nn.Linear(n_filters, cfg.projection_dim)
        self._act = torch.tanh if cfg.activation == "tanh" else F.relu

    def forward(self, char_ids: Tensor) -> Tensor:
        x = self.char_embed(char_ids).transpose(1, 2)  # [N, char_dim, W]
        # bilm-tf order: convolve, max over positions, then the activation
        feats = [self._act(conv(x).amax(dim=-1)) for conv in self.convs]
        x = torch.cat(feats, dim=-1)  # [N, F]
        for hw in self.highways:
            transform, carry = hw(x).chunk(2, dim=-1)
            gate = torch.sigmoid(carry)
            x = gate * F.relu(transform) + (1.0 - gate) * x
        return self.projection(x)


class LstmLayer(nn.Module):
    """One direction of one LSTM layer with projection and clipping.

    Input ``[B, T, in_dim]``, output ``[B, T, P]``; reads left to right from
    a zero state. Callers run the backward direction on reversed input.
    Gates are packed in the order (i, f, o, g) so one sigmoid covers three.
    """

    def __init__(self, in_dim: int, cfg: BiLMConfig) -> None:
        super().__init__()
        c, p = cfg.lstm_dim, cfg.projection_dim
        self.cell_dim, self.proj_dim = c, p
        self.cell_clip, self.proj_clip = cfg.cell_clip, cfg.proj_clip
        self.w_ih = nn.Linear(in_dim, 4 * c)  # carries the gate bias
        self.w_hh = nn.Linear(p, 4 * c, bias=False)
        self.w_proj = nn.Linear(c, p, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        c = self.cell_dim
        for w in (self.w_ih.weight, self.w_hh.weight):
            nn.init.uniform_(w, -1 / math.sqrt(c), 1 / math.sqrt(c))
        nn.init.xavier_uniform_(self.w_proj.weight)
        with torch.no_grad():
            self.w_ih.bias.zero_()
            self.w_ih.bias[c : 2 * c] = 1.0  # forget gate starts open

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        c = self.cell_dim
        # the input-to-gates matmul for all time steps at once; only h @ W_hh is sequential
        x_gates = self.w_ih(x)  # [B, T, 4C]
        w_hh_t = self.w_hh.weight.t()
        w_proj_t = self.w_proj.weight.t()
        h = x.new_zeros(b, self.proj_dim, dtype=x_gates.dtype)
        cell = x.new_zeros(b, c, dtype=x_gates.dtype)
        outs = []
        for step in range(t):
            gates = torch.addmm(x_gates[:, step], h, w_hh_t)
            ifo = torch.sigmoid(gates[:, : 3 * c])
            g = torch.tanh(gates[:, 3 * c :])
            cell = ifo[:, c : 2 * c] * cell + ifo[:, :c] * g
            if self.cell_clip is not None:
                cell = cell.clamp(-self.cell_clip, self.cell_clip)
            h = (ifo[:, 2 * c :] * torch.tanh(cell)) @ w_proj_t
            if self.proj_clip is not None:
                h = h.clamp(-self.proj_clip, self.proj_clip)
            outs.append(h)
        if not outs:
            return x.new_zeros(b, 0, self.proj_dim)
        return torch.stack(outs, dim=1)


def reverse_padded(x: Tensor, lengths: Tensor) -> Tensor:
    """Reverse each sequence within its own length; padding stays at the end.

    ``x``: ``[B, T, D]``, ``lengths``: ``[B]``. Applying it twice is the identity.
    """
    t = x.shape[1]
    pos = torch.arange(t, device=x.device).unsqueeze(0)  # [1, T]
    lens = lengths.to(x.device).unsqueeze(1)  # [B, 1]
    idx = torch.where(pos < lens, lens - 1 - pos, pos)  # [B, T]
    return x.gather(1, idx.unsqueeze(-1).expand_as(x))


def length_mask(lengths: Tensor, t: int) -> Tensor:
    """``[B, T]`` bool, True at real positions."""
    return torch.arange(t, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)


class BiLM(nn.Module):
    """Character CNN + L-layer biLSTM. See the module docstring for shapes."""

    def __init__(self, cfg: BiLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.token_encoder = CharCNN(cfg)
        p = cfg.projection_dim
        self.forward_layers = nn.ModuleList(LstmLayer(p, cfg) for _ in range(cfg.n_layers))
        self.backward_layers = nn.ModuleList(LstmLayer(p, cfg) for _ in range(cfg.n_layers))
        self.dropout = nn.Dropout(cfg.dropout)

    @property
    def n_output_layers(self) -> int:
        return self.cfg.n_layers + 1

    def forward(self, char_ids: Tensor, lengths: Tensor) -> Tensor:
        """``char_ids [B, T, W]``, ``lengths [B]`` -> layers ``[L+1, B, T, 2P]``."""
        b, t, w = char_ids.shape
        tokens = self.token_encoder(char_ids.reshape(b * t, w)).reshape(b, t, -1)
        return self.contextualize(tokens, lengths)

    def contextualize(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        """Token vectors ``[B, T, P]`` -> layers ``[L+1, B, T, 2P]``.

        The biLSTM half of :meth:`forward`, separate so that callers can supply
        cached token vectors and skip the character CNN.
        """
        mask = (
            length_mask(lengths.to(tokens.device), tokens.shape[1]).unsqueeze(-1).to(tokens.dtype)
        )
        tokens = tokens * mask
        fwd_in, bwd_in = tokens, reverse_padded(tokens, lengths)
        layers = [torch.cat([tokens, tokens], dim=-1)]
        for i, (fwd, bwd) in enumerate(zip(self.forward_layers, self.backward_layers, strict=True)):
            f = fwd(self.dropout(fwd_in))
            r = bwd(self.dropout(bwd_in))
            if self.cfg.residual and i > 0:
                f, r = f + fwd_in, r + bwd_in
            fwd_in, bwd_in = f, r
            layers.append(torch.cat([f, reverse_padded(r, lengths)], dim=-1) * mask)
        return torch.stack(layers, dim=0)
