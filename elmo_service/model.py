"""The ELMo biLM (Peters et al. 2018), readable in one file.

    char ids [B, T, W] --CharCNN--> tokens [B, T, P] --L x biLSTM--> layers [L+1, B, T, 2P]

* ``CharCNN``: embed each of the W byte ids of a token, one 1-D convolution
  per filter width over the W positions, max over positions, activation;
  ``n_highway`` highway layers; linear projection to P. Inference computes
  the same convolution by table lookup (see ``CharCNN.forward``).
* ``LstmLayer`` (``elmo_service/lstm.py``): one direction of one LSTM layer
  with a projection (``lstm_dim`` cells -> P), cell and projection clipping;
  its training kernel does backpropagation through time by hand.
* ``BiLM``: L LSTM layers per direction with separate weights, residual
  connections from layer 2 on. The backward direction reads each sentence
  from its own last real token. Every sentence starts from a zero state.
  ``run_direction`` is the one stack of layers that serving (``contextualize``)
  and the training language model (``pretrain/lm.py``) both run.

Layer 0 of the output is ``[e ; e]``; layer l is ``[h_fwd_l ; h_bwd_l]``,
both aligned to the token positions. Positions past a sentence's length
(batch padding) are zero in every layer.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from elmo_service.bilstm import BiLstmKernel, direction_pool, on_both_workers
from elmo_service.config import BiLMConfig
from elmo_service.errors import ConfigError
from elmo_service.lstm import LstmLayer, LstmState
from elmo_service.native_filters import char_filters
from elmo_service.packed import PackedLinear, check_weights_mode, kernel_cache, linear

N_CHAR_IDS = 262  # 256 bytes + 5 markers, shifted by one so that row 0 is "no token"
# from this many tokens the native filter lookup splits them over the two direction workers
NATIVE_SPLIT_MIN_TOKENS = 32


class CharCNN(nn.Module):
    """Token encoder: character ids ``[N, W]`` -> token vectors ``[N, P]``.

    Training runs the convolutions as ``Conv1d``. Without autograd the same
    numbers come from lookup tables: a window's value is a sum over its taps
    ``k`` of ``char_embed[id] @ conv.weight[:, :, k]``, and with only 262 ids
    those products are precomputed once per weight version. A window then
    costs ``width`` row additions (``embedding_bag``) instead of a
    ``width * char_dim`` dot product per filter, and windows that lie wholly
    in a token's padding tail, all equal, are computed once. For the released
    2048-filter CNN that removes ~17 of its ~35 MFLOP per token, leaving the
    highway matmul as the main cost.
    """

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
        self._tables: tuple[tuple, list[Tensor]] | None = None  # (weight versions, tables)
        # the same tables as one numpy buffer, widths, sizes, offsets (fp32 on the CPU)
        self._tables_flat: tuple[np.ndarray, ...] | None = None

    def forward(self, char_ids: Tensor, *, weights: str = "fp32") -> Tensor:
        """``[N, W]`` -> ``[N, P]``. Without autograd, in fp32 on the CPU, the highway and
        projection matmuls use pre-packed weights; ``weights="int8"`` quantizes the
        highway layers (each row of their input scaled by its own maximum)."""
        check_weights_mode(weights)
        packed: list[PackedLinear | None] = [None] * (len(self.highways) + 1)
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()):
            x = self._filters_conv(char_ids)
        else:
            x = self._filters_lookup(char_ids)
            if _fast_path_ok(x):
                packed = self._packed_linears(weights)
        if weights != "fp32" and packed[-1] is None:
            raise ConfigError(
                "weights='int8' needs fp32 inference on the CPU without autograd", field="weights"
            )
        for hw, pk in zip(self.highways, packed[:-1], strict=True):
            transform, carry = linear(x, pk, hw).chunk(2, dim=-1)
            # g * relu(t) + (1 - g) * x in one op (half the element-wise time); under
            # autocast the matmul is bf16 and x stays fp32, as type promotion kept it
            gate = torch.sigmoid(carry).to(x.dtype)
            x = torch.lerp(x, F.relu(transform).to(x.dtype), gate)
        return linear(x, packed[-1], self.projection)

    def _packed_linears(self, weights: str) -> list[PackedLinear]:
        """Highway layers and projection with pre-packed weights (inference)."""
        int8 = weights == "int8"
        params = [p for m in (*self.highways, self.projection) for p in (m.weight, m.bias)]

        def build() -> list[PackedLinear]:
            hw = [PackedLinear(m.weight, m.bias, int8=int8) for m in self.highways]
            return [*hw, PackedLinear(self.projection.weight, self.projection.bias)]

        return kernel_cache(self).get_or_build(("linears", weights), params, build)

    def _filters_conv(self, char_ids: Tensor) -> Tensor:
        """``[N, W]`` -> ``[N, F]``: convolve, max over positions, then the activation (bilm-tf order)."""
        x = self.char_embed(char_ids).transpose(1, 2)  # [N, char_dim, W]
        return torch.cat([self._act(conv(x).amax(dim=-1)) for conv in self.convs], dim=-1)

    def _filters_lookup(self, char_ids: Tensor) -> Tensor:
        """Same function as :meth:`_filters_conv`, by table lookup (inference only).

        fp32 on the CPU, the windows are summed and maxed in native code
        (``elmo_service/native_filters.py``, the same numbers to the bit), a batch's
        tokens split over the two direction workers when it has many.
        """
        n, w_max = char_ids.shape
        if n == 0:
            return self.projection.weight.new_zeros(0, self.cfg.n_filters)
        tables = self._lookup_tables()
        native = self._tables_flat is not None and char_ids.device.type == "cpu"
        if native and not torch.compiler.is_compiling():
            return self._filters_native(char_ids)
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
            feats.append(self._act(windows.view(n, n_pos, n_out).amax(dim=1) + conv.bias))
        return torch.cat(feats, dim=-1)

    def _filters_native(self, char_ids: Tensor) -> Tensor:
        """:meth:`_filters_lookup` in native code: ``[N, W]`` -> ``[N, F]``."""
        ids = char_ids.to(torch.int64).contiguous().numpy()
        flat, widths, n_out, offsets = self._tables_flat  # type: ignore[misc]
        maxima = np.empty((ids.shape[0], self.cfg.n_filters), dtype=np.float32)

        def rows(lo: int, hi: int) -> None:
            char_filters(ids[lo:hi], flat, widths, n_out, offsets, N_CHAR_IDS, maxima[lo:hi])

        pool = direction_pool() if len(ids) >= NATIVE_SPLIT_MIN_TOKENS else None
        if pool is None:
            rows(0, len(ids))
        else:  # each worker its own half of the rows: the same numbers as one call
            bounds = (0, len(ids) // 2, len(ids))
            on_both_workers(pool, lambda part: rows(bounds[part], bounds[part + 1]))
        bias = torch.cat([conv.bias for conv in self.convs])
        return self._act(torch.from_numpy(maxima).add_(bias))

    def _lookup_tables(self) -> list[Tensor]:
        """Per filter width ``[width * 262, n]``: row ``k * 262 + id`` = ``char_embed[id] @ weight[:, :, k].T``.

        Rebuilt when a weight changes (in-place edits bump ``_version``; ``.to()`` and
        loading move ``data_ptr``). Built in the autocast dtype when autocast is on.
        In fp32 on the CPU the tables are views of one buffer, which the native
        lookup reads (``_tables_flat``).
        """
        weights = [self.char_embed.weight, *(conv.weight for conv in self.convs)]
        dtype = self.char_embed.weight.dtype
        if torch.is_autocast_enabled(weights[0].device.type):
            dtype = torch.get_autocast_dtype(weights[0].device.type)
        key = (dtype, *((p.data_ptr(), p._version) for p in weights))
        if self._tables is None or self._tables[0] != key:
            with torch.no_grad(), torch.autocast(weights[0].device.type, enabled=False):
                emb = self.char_embed.weight.float()
                tables = [
                    torch.einsum("cd,ndk->kcn", emb, conv.weight.float()).reshape(-1, n).to(dtype)
                    for (_, n), conv in zip(self.cfg.filters, self.convs, strict=True)
                ]
                flat = torch.cat([t.reshape(-1) for t in tables])
                tables = list(flat.split([t.numel() for t in tables]))
                tables = [t.view(-1, n) for t, (_, n) in zip(tables, self.cfg.filters, strict=True)]
            self._tables = (key, tables)
            self._tables_flat = None
            if dtype == torch.float32 and flat.device.type == "cpu":
                sizes = [t.numel() for t in tables]
                self._tables_flat = (
                    flat.numpy(),
                    np.array([w for w, _ in self.cfg.filters], dtype=np.int64),
                    np.array([n for _, n in self.cfg.filters], dtype=np.int64),
                    np.cumsum([0, *sizes[:-1]], dtype=np.int64),
                )
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


def _fast_path_ok(x: Tensor) -> bool:
    """Whether the packed-weight inference kernels apply: fp32 on the CPU, no autocast,
    not being traced by ``torch.compile``."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and not torch.is_autocast_enabled("cpu")
        and not torch.compiler.is_compiling()
    )


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

    def forward(self, char_ids: Tensor, lengths: Tensor, *, weights: str = "fp32") -> Tensor:
        """``char_ids [B, T, W]``, ``lengths [B]`` -> layers ``[L+1, B, T, 2P]``."""
        b, t, w = char_ids.shape
        tokens = self.token_encoder(char_ids.reshape(b * t, w), weights=weights)
        return self.contextualize(tokens.reshape(b, t, -1), lengths, weights=weights)

    def contextualize(
        self,
        tokens: Tensor,
        lengths: Tensor,
        *,
        weights: str = "fp32",
        distinct: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """Token vectors ``[B, T, P]`` -> layers ``[L+1, B, T, 2P]``.

        The biLSTM half of :meth:`forward`, separate so that callers can supply
        cached token vectors and skip the character CNN. Without autograd, in
        fp32 on the CPU, it runs :class:`BiLstmKernel` (both directions per
        step, packed weights); ``weights="int8"`` (opt-in) quantizes its
        recurrent and projection matmuls. Otherwise each direction runs
        :meth:`run_direction`, the code training runs.

        ``distinct``: optionally ``(table [U, P], index [B, T])`` with ``tokens ==
        table[index]`` at the real positions (the embedder's distinct tokens): the
        kernel then computes layer 1's input matmul once per distinct token.
        """
        check_weights_mode(weights)
        no_grad = not torch.is_grad_enabled() or not (
            tokens.requires_grad or any(p.requires_grad for p in self.parameters())
        )
        if no_grad and _fast_path_ok(tokens):
            return self._contextualize_fast(tokens, lengths, weights, distinct)
        if weights != "fp32":
            raise ConfigError(
                "weights='int8' needs fp32 inference on the CPU without autograd", field="weights"
            )
        b, t, _ = tokens.shape
        lengths = lengths.to(tokens.device)
        # rows sorted longest first so that each step computes only the rows still
        # inside their sentence (padding costs nothing); undone at the end
        active = None
        if not torch.compiler.is_compiling():  # data-dependent; compiled graphs keep full rows
            lengths, order = lengths.sort(descending=True, stable=True)
            tokens = tokens[order]
            steps = torch.arange(t, device=tokens.device)
            active = (lengths.unsqueeze(0) > steps.unsqueeze(1)).sum(1).tolist()
        mask = length_mask(lengths, t).unsqueeze(-1).to(tokens.dtype)
        tokens = tokens * mask
        fwd, _ = self.run_direction("forward", tokens, active=active)
        bwd, _ = self.run_direction("backward", reverse_padded(tokens, lengths), active=active)
        layers = [torch.cat([tokens, tokens], dim=-1)]
        for f, r in zip(fwd, bwd, strict=True):
            layers.append(torch.cat([f, reverse_padded(r, lengths)], dim=-1) * mask)
        out = torch.stack(layers, dim=0)
        if active is not None:
            out = out[:, torch.argsort(order)]
        return out

    def lstm_kernel(self, weights: str = "fp32") -> BiLstmKernel:
        """The :class:`BiLstmKernel` for the current weights (rebuilt when any changes)."""
        pairs = list(zip(self.forward_layers, self.backward_layers, strict=True))
        params = [p for pair in pairs for m in pair for p in m.parameters()]
        return kernel_cache(self).get_or_build(
            ("bilstm", weights),
            params,
            lambda: BiLstmKernel(pairs, self.cfg.residual, weights),
        )

    def _contextualize_fast(
        self,
        tokens: Tensor,
        lengths: Tensor,
        weights: str,
        distinct: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        if tokens.shape[0] == 1 and int(lengths[0]) == tokens.shape[1]:
            return self._contextualize_one(tokens[0], weights)
        return self._contextualize_sorted(tokens, lengths, weights, distinct)

    def _contextualize_sorted(
        self,
        tokens: Tensor,
        lengths: Tensor,
        weights: str,
        distinct: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """Rows sorted longest first, so that the kernel drops finished rows; undone at the end."""
        t = tokens.shape[1]
        lengths, order = lengths.to(tokens.device).sort(descending=True, stable=True)
        tokens = tokens[order]
        steps = torch.arange(t, device=tokens.device)
        active = (lengths.unsqueeze(0) > steps.unsqueeze(1)).sum(1).tolist()
        mask = length_mask(lengths, t).unsqueeze(-1).to(tokens.dtype)
        tokens = tokens * mask
        # [2, T, B, P]: time-major, so a step's rows are contiguous
        x = torch.stack([tokens, reverse_padded(tokens, lengths)]).transpose(1, 2).contiguous()
        kernel_distinct = None
        if distinct is not None:  # the same reordering for the index: [2, T, B]
            table, index = distinct
            index = index[order].unsqueeze(-1)
            index = torch.stack([index, reverse_padded(index, lengths)]).squeeze(-1)
            kernel_distinct = (table, index.transpose(1, 2).contiguous())
        layers = [torch.cat([tokens, tokens], dim=-1)]
        for y in self.lstm_kernel(weights)(x, active, kernel_distinct):
            y = y.transpose(1, 2)  # [2, B, T, P]
            layers.append(torch.cat([y[0], reverse_padded(y[1], lengths)], dim=-1) * mask)
        return torch.stack(layers, dim=0)[:, torch.argsort(order)]

    def _contextualize_one(self, tokens: Tensor, weights: str) -> Tensor:
        """:meth:`_contextualize_fast` for one unpadded sentence ``[T, P]``: no sorting,
        masking or gathers (a single-sentence request pays ~25 small ops less)."""
        x = torch.stack([tokens, tokens.flip(0)]).unsqueeze(2)  # [2, T, 1, P]
        layers = [torch.cat([tokens, tokens], dim=-1)]
        for y in self.lstm_kernel(weights)(x, [1] * tokens.shape[0]):
            layers.append(torch.cat([y[0, :, 0], y[1, :, 0].flip(0)], dim=-1))
        return torch.stack(layers).unsqueeze(1)  # [L+1, 1, T, 2P]

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
