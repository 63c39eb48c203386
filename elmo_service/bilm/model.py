"""The ELMo biLM (Peters et al. 2018), readable in one file: plain torch.

    char ids [B, T, W] --CharCNN--> tokens [B, T, P] --L x biLSTM--> layers [L+1, B, T, 2P]

* ``CharCNN``: embed each of the W byte ids of a token, one 1-D convolution
  per filter width over the W positions, max over positions, activation;
  ``n_highway`` highway layers; linear projection to P. Inference computes
  the same convolution by table lookup (see ``CharCNN.forward``). An imported
  ELMoForManyLangs model reads characters from its lexicon instead of bytes and
  may put a word vector before the features (``cfg.char_vocab_size``, ``word_dim``).
* ``LstmLayer`` (``elmo_service/bilm/lstm.py``): one direction of one LSTM layer
  with a projection (``lstm_dim`` cells -> P), cell and projection clipping;
  its training kernel does backpropagation through time by hand.
* ``BiLM``: L LSTM layers per direction with separate weights, residual
  connections from layer 2 on. The backward direction reads each sentence
  from its own last real token. Every sentence starts from a zero state
  (``contextualize_from`` takes another, for the stateful drop-in module).
  ``run_direction`` is the one stack of layers that ``contextualize`` and the
  training language model (``pretrain/lm.py``) both run.

Layer 0 of the output is ``[e ; e]``; layer l is ``[h_fwd_l ; h_bwd_l]``,
both aligned to the token positions. Positions past a sentence's length
(batch padding) are zero in every layer.

This file runs on any device and dtype. On the CPU in fp32 the embedder serves
the same function through the kernels of ``elmo_service/bilm/kernels/`` (``CpuBiLM``),
which read this model's weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from elmo_service.bilm.config import BiLMConfig
from elmo_service.bilm.lstm import LstmLayer, LstmState

# per direction (forward, backward), per layer: (h [B, P], c [B, C])
BiLMState = tuple[list[LstmState], list[LstmState]]
N_CHAR_IDS = 262  # 256 bytes + 5 markers, shifted by one so that row 0 is "no token"


class CharCNN(nn.Module):
    """Token encoder: character ids ``[N, W]`` -> token vectors ``[N, P]``.

    Training runs the convolutions as ``Conv1d``. Without autograd the same
    numbers come from lookup tables: a window's value is a sum over its taps
    ``k`` of ``char_embed[id] @ conv.weight[:, :, k]``, and with only 262 ids
    those products are precomputed once per weight version. A window then
    costs ``width`` row additions (``embedding_bag``) instead of a
    ``width * char_dim`` dot product per filter, and windows that lie wholly
    in a token's padding tail, all equal, are computed once.
    """

    def __init__(self, cfg: BiLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # a lexicon's characters (ELMoForManyLangs) have no "no token" row: every id is real
        self.lexicon = cfg.char_vocab_size is not None
        if self.lexicon:
            self.char_embed = nn.Embedding(cfg.char_vocab_size, cfg.char_dim)
        else:
            self.char_embed = nn.Embedding(N_CHAR_IDS, cfg.char_dim, padding_idx=0)
        self.convs = nn.ModuleList(nn.Conv1d(cfg.char_dim, n, w) for w, n in cfg.filters)
        n_filters = cfg.n_filters
        # each highway layer is one matmul: rows [transform ; carry]
        self.highways = nn.ModuleList(
            nn.Linear(n_filters, 2 * n_filters) for _ in range(cfg.n_highway)
        )
        # ELMoForManyLangs: [word vector ; character features] -> projection
        self.word_embed = nn.Embedding(cfg.word_vocab_size, cfg.word_dim) if cfg.word_dim else None
        self.projection = nn.Linear(cfg.word_dim + n_filters, cfg.projection_dim)
        self._tables: tuple[tuple, list[Tensor]] | None = None  # (weight versions, tables)

    def activation(self, x: Tensor) -> Tensor:
        return torch.tanh(x) if self.cfg.activation == "tanh" else F.relu(x)

    def forward(self, char_ids: Tensor) -> Tensor:
        """``[N, W]`` -> ``[N, P]``: convolutions under autograd, table lookups without.

        With a word embedding (``cfg.word_dim``) each row is ``[W + 1]``: the W
        character ids, then the word id (``elmo_service/bilm/lexicon.py`` writes them)."""
        words = None
        if self.word_embed is not None:
            char_ids, words = char_ids[:, :-1], self.word_embed(char_ids[:, -1])
        grad = torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())
        # a lexicon's tables (thousands of characters x every tap) would not pay: convolve
        conv = grad or self.lexicon
        x = self._filters_conv(char_ids) if conv else self._filters_lookup(char_ids)
        return self.highway_and_project(x, words=words)

    def highway_and_project(
        self,
        x: Tensor,
        linears: Sequence[Callable[[Tensor], Tensor]] | None = None,
        words: Tensor | None = None,
    ) -> Tensor:
        """Filter features ``[N, F]`` -> ``[N, P]``: the highway layers, then the projection
        (of ``[words ; x]`` when word vectors ``[N, word_dim]`` are given).

        ``linears``: stand-ins for ``[*highways, projection]`` computing the same
        affine maps (the CPU kernel's packed weights); the modules themselves when None.
        """
        linears = linears or [*self.highways, self.projection]
        for highway in linears[:-1]:
            transform, carry = highway(x).chunk(2, dim=-1)
            # g * relu(t) + (1 - g) * x in one op (half the element-wise time); under
            # autocast the matmul is bf16 and x stays fp32, as type promotion kept it
            gate = torch.sigmoid(carry).to(x.dtype)
            x = torch.lerp(x, F.relu(transform).to(x.dtype), gate)
        if words is not None:
            x = torch.cat([words.to(x.dtype), x], dim=-1)
        return linears[-1](x)

    def _filters_conv(self, char_ids: Tensor) -> Tensor:
        """``[N, W]`` -> ``[N, F]``: convolve, max over positions, then the activation (bilm-tf order)."""
        x = self.char_embed(char_ids).transpose(1, 2)  # [N, char_dim, W]
        return torch.cat([self.activation(conv(x).amax(dim=-1)) for conv in self.convs], dim=-1)

    def _filters_lookup(self, char_ids: Tensor) -> Tensor:
        """Same function as :meth:`_filters_conv`, by table lookup (inference only)."""
        n, w_max = char_ids.shape
        if n == 0:
            return self.projection.weight.new_zeros(0, self.cfg.n_filters)
        tables = self._lookup_tables()
        # positions from `tail` on hold one repeated id (padding), so every window
        # starting there has the same value: one of them stands for all
        tail = w_max
        if not torch.compiler.is_compiling():  # data-dependent shapes; compile keeps the full width
            pos = torch.arange(w_max, device=char_ids.device)
            tail = int(torch.where(char_ids != char_ids[:, -1:], pos, -1).amax()) + 1
        feats = []
        for (width, n_out), table, conv in zip(self.cfg.filters, tables, self.convs, strict=True):
            n_pos = min(tail + 1, w_max - width + 1)
            taps = torch.arange(width, device=char_ids.device) * N_CHAR_IDS
            idx = char_ids[:, : n_pos + width - 1].unfold(1, width, 1) + taps  # [N, n_pos, width]
            # each window: the sum of its `width` table rows -> [N * n_pos, n_out]
            windows = F.embedding_bag(idx.reshape(-1, width), table, mode="sum")
            # max(x + b) == max(x) + b, so the bias is added once per filter
            feats.append(self.activation(windows.view(n, n_pos, n_out).amax(dim=1) + conv.bias))
        return torch.cat(feats, dim=-1)

    def build_lookup_tables(self, dtype: torch.dtype = torch.float32) -> list[Tensor]:
        """Per filter width ``[width * 262, n]``: row ``k * 262 + id`` = ``char_embed[id] @ weight[:, :, k].T``."""
        work = torch.float64 if dtype == torch.float64 else torch.float32  # .double(): all float64
        with torch.no_grad(), torch.autocast(self.char_embed.weight.device.type, enabled=False):
            emb = self.char_embed.weight.to(work)
            return [
                torch.einsum("cd,ndk->kcn", emb, conv.weight.to(work)).reshape(-1, n).to(dtype)
                for (_, n), conv in zip(self.cfg.filters, self.convs, strict=True)
            ]

    def forget_tables(self) -> None:
        """Drop the lookup tables (rebuilt on the next call): after a weight write that the
        version counters do not see (``layer_cache.WeightsWatch`` tells)."""
        self._tables = None

    def _lookup_tables(self) -> list[Tensor]:
        """:meth:`build_lookup_tables`, rebuilt when a weight changes (in-place edits bump
        ``_version``; ``.to()`` and loading move ``data_ptr``), in the autocast dtype
        when autocast is on."""
        weights = [self.char_embed.weight, *(conv.weight for conv in self.convs)]
        device = weights[0].device.type
        dtype = self.char_embed.weight.dtype
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
        key = (dtype, *((p.data_ptr(), p._version) for p in weights))
        if self._tables is None or self._tables[0] != key:
            self._tables = (key, self.build_lookup_tables(dtype))
        return self._tables[1]


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


class SortedBatch:
    """A padded batch with its rows sorted longest first, and the way back.

    Sorted rows let a step loop compute only the rows still inside their sentence
    (``active[t]`` of them at step t; padding costs nothing). ``sort=False`` (a
    ``torch.compile`` trace: data-dependent shapes) keeps the order, with ``active``
    None. ``tokens`` is zero past each row's length.
    """

    def __init__(self, tokens: Tensor, lengths: Tensor, *, sort: bool = True) -> None:
        t = tokens.shape[1]
        lengths = lengths.to(tokens.device)
        self.order: Tensor | None = None
        self.active: list[int] | None = None
        if sort:
            lengths, self.order = lengths.sort(descending=True, stable=True)
            tokens = tokens[self.order]
            steps = torch.arange(t, device=tokens.device)
            self.active = (lengths.unsqueeze(0) > steps.unsqueeze(1)).sum(1).tolist()
        self.lengths = lengths
        self.mask = length_mask(lengths, t).unsqueeze(-1).to(tokens.dtype)  # [B, T, 1]
        self.tokens = tokens * self.mask

    def sorted(self, x: Tensor) -> Tensor:
        """Another ``[B, ...]`` tensor of the batch in the sorted order."""
        return x if self.order is None else x[self.order]

    def unsorted(self, x: Tensor) -> Tensor:
        """A ``[B, ...]`` tensor in the sorted order, back in the input's order."""
        return x if self.order is None else x[torch.argsort(self.order)]

    def reversed(self, x: Tensor) -> Tensor:
        """``[B, T, D]`` in the sorted order, each row reversed within its length."""
        return reverse_padded(x, self.lengths)

    def layers(self, forward: Sequence[Tensor], backward: Sequence[Tensor]) -> Tensor:
        """Each layer's forward output and backward output (both ``[B, T, P]``, sorted,
        the backward one reversed) -> ``[L+1, B, T, 2P]`` in the input's order."""
        layers = [torch.cat([self.tokens, self.tokens], dim=-1)]
        for f, r in zip(forward, backward, strict=True):
            layers.append(torch.cat([f, self.reversed(r)], dim=-1) * self.mask)
        out = torch.stack(layers, dim=0)
        return out if self.order is None else out[:, torch.argsort(self.order)]


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
        tokens = self.token_encoder(char_ids.reshape(b * t, w))
        return self.contextualize(tokens.reshape(b, t, -1), lengths)

    def contextualize(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        """Token vectors ``[B, T, P]`` -> layers ``[L+1, B, T, 2P]``.

        The biLSTM half of :meth:`forward`, separate so that callers can supply
        cached token vectors and skip the character CNN: rows sorted longest
        first, each direction's :meth:`run_direction`, the order restored.
        """
        return self.contextualize_from(tokens, lengths)[0]

    def contextualize_from(
        self, tokens: Tensor, lengths: Tensor, state: BiLMState | None = None
    ) -> tuple[Tensor, BiLMState]:
        """:meth:`contextualize` from an initial state, returning the final one too.

        ``state``: per direction (forward, backward), per layer, ``(h [B, P], c [B, C])``
        in the batch's order; zeros when None. The final state of a row is the one
        after its own last token (the backward direction's: after its first), so a
        stateful caller (``elmo_service/elmo.py``) continues row b from where row b ended.
        """
        batch = SortedBatch(tokens, lengths, sort=not torch.compiler.is_compiling())
        start = (
            [None, None]
            if state is None
            else [[(batch.sorted(h), batch.sorted(c)) for h, c in direction] for direction in state]
        )
        fwd, fs = self.run_direction("forward", batch.tokens, start[0], active=batch.active)
        bwd, bs = self.run_direction(
            "backward", batch.reversed(batch.tokens), start[1], active=batch.active
        )
        final = tuple(
            [(batch.unsorted(h), batch.unsorted(c)) for h, c in direction] for direction in (fs, bs)
        )
        return batch.layers(fwd, bwd), final

    def use_compiled_steps(self) -> None:
        """``torch.compile`` the LSTM layers' per-step bodies (training; this model only)."""
        for layer in (*self.forward_layers, *self.backward_layers):
            layer.use_compiled_steps()

    def run_direction(
        self,
        direction: str,
        x: Tensor,
        state: list[LstmState] | None = None,
        *,
        active: list[int] | None = None,
        keep: Tensor | None = None,
    ) -> tuple[list[Tensor], list[LstmState]]:
        """One direction's stack of layers, reading ``x [B, T, P]`` left to right.

        ``direction``: "forward" or "backward" (which weights; the caller
        reverses the input for the backward LM). Returns each layer's output
        ``[B, T, P]`` (L of them) and each layer's final state. ``state``,
        ``active`` and ``keep`` are passed to every :class:`LstmLayer`.
        Dropout (training only) is applied to each layer's input, the token
        vectors included unless ``cfg.dropout_tokens`` is off.
        """
        layers = self.forward_layers if direction == "forward" else self.backward_layers
        outs, states = [], []
        for i, layer in enumerate(layers):
            inp = self.dropout(x) if (i > 0 or self.cfg.dropout_tokens) else x
            y, st = layer(inp, None if state is None else state[i], active=active, keep=keep)
            if self.cfg.residual and i > 0:
                y = y + x
            outs.append(y)
            states.append(st)
            x = y
        return outs, states
