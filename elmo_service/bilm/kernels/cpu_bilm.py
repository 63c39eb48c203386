"""A whole BiLM's inference on the CPU in fp32 (or int8 / bf16 weights), through the native kernels.

    CpuBiLM(bilm, weights="fp32").encode(char ids [N, W])                 -> tokens [N, P]
    CpuBiLM(bilm, weights="fp32").contextualize(tokens [B, T, P], lengths) -> layers [L+1, B, T, 2P]

The same function as :class:`~elmo_service.bilm.model.BiLM` (``tests/elmo_service/
test_every_path.py`` holds every path to one reference), computed with:

* the character filters by table lookup in native code (``native_filters.py``,
  the same numbers as the model's torch lookup, to the bit), a big batch's
  tokens split over the two direction workers;
* the highway layers and the projection with packed weights (``packed.py``;
  int8 highways when asked), through the model's own ``highway_and_project``;
* the biLSTM's both directions per step (``bilstm.py``), one sentence in
  numba's step loop, the first layer's input matmul once per distinct token.

Kernel-layout weights are built on first use and rebuilt when a weight of the
model changes (an optimizer step, ``load_state_dict``: see :class:`KernelCache`).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch
from torch import Tensor

from elmo_service.bilm.kernels import native_filters, native_step, tuning
from elmo_service.bilm.kernels.bilstm import BiLstmKernel, direction_pool, on_both_workers
from elmo_service.bilm.kernels.native_rounded import round_weight
from elmo_service.bilm.kernels.packed import KernelCache, PackedLinear, check_weights_mode
from elmo_service.bilm.lstm import ChunkLayers, Chunks, Meanwhile
from elmo_service.bilm.model import N_CHAR_IDS, BiLM, SortedBatch
from elmo_service.errors import ConfigError

_compiled = False
_compile_lock = threading.Lock()


def compile_kernels() -> None:
    """Compile the native kernels now (or load them from numba's cache; a damaged cache
    file is recompiled with a warning), once per process: e.g. while building an image,
    or in a server's warm-up, rather than on the first request."""
    global _compiled
    if _compiled:  # every call asks: no lock once done
        return
    with _compile_lock:
        if not _compiled:
            native_step.compile_now()
            native_filters.compile_now()
            _compiled = True


class CpuBiLM:
    """A :class:`BiLM`'s inference on the CPU through the native kernels.

    # Parameters

    bilm : `BiLM`
        The model, fp32 on the CPU. Its weights are read, never changed; the
        kernels' copies follow when they change.
    weights : `str`, optional (default = `"fp32"`)
        ``"int8"`` / ``"bf16"``: the biLSTM's matrices rounded once (int8 per output
        row, or bf16), a sentence alone streaming them compact (``native_rounded``);
        the highway layers in int8 through fbgemm (each input row scaled by its own
        maximum) or rounded to bf16. A sentence's vectors never depend on its batch
        mates. The error against fp32: :mod:`~elmo_service.bilm.kernels.certificate`.
    """

    def __init__(self, bilm: BiLM, *, weights: str = "fp32") -> None:
        check_weights_mode(weights)
        params = bilm.named_parameters()
        bad = [n for n, p in params if p.device.type != "cpu" or p.dtype != torch.float32]
        if bad:
            raise ConfigError(
                f"CpuBiLM needs an fp32 model on the CPU ({bad[0]} is not)", field="device"
            )
        self.bilm = bilm
        self.weights = weights
        self.name = f"cpu-native {weights}"
        self._cache = KernelCache()
        # regime ("one", "batch") -> "torch" where the model's own code measured faster on
        # this machine, and "recurrent_rows" (kernels/calibrate.py; fp32 only: the rounded
        # paths have no torch twin); None until the warm-up or the first call decides it
        self.route: dict[str, Any] | None = None if weights == "fp32" else {}
        # batched steps below this many rows multiply on W_hh^T (MKL), not oneDNN's pack:
        # from the route (its "recurrent_rows"), where it measured faster on this machine
        self.recurrent_rows = 0

    def warm_up(self) -> None:
        """Compile the native kernels (see :func:`compile_kernels`), then, for fp32, route
        each regime to whichever of the native and torch biLSTM is faster here
        (``kernels/calibrate.py``: measured once per machine and shape, cached)."""
        compile_kernels()
        self._routed()

    def _routed(self) -> dict[str, str]:
        if self.route is None:
            from elmo_service.bilm.kernels.calibrate import calibrated_route

            self.route = calibrated_route(self)
            self.recurrent_rows = int(self.route.get("recurrent_rows", 0))
        return self.route

    # -- the character CNN ------------------------------------------------------
    @torch.no_grad()
    def encode(self, char_ids: Tensor) -> Tensor:
        """Character ids ``[N, W]`` -> token vectors ``[N, P]``."""
        compile_kernels()
        cnn = self.bilm.token_encoder
        if cnn.lexicon:  # ELMoForManyLangs' characters and word vectors: the model's torch code
            return cnn(char_ids)
        return cnn.highway_and_project(self._filters(char_ids), self._linears())

    def _filters(self, char_ids: Tensor) -> Tensor:
        """``[N, W]`` -> ``[N, F]``: the filters' maxima, bias and activation."""
        cnn = self.bilm.token_encoder
        if char_ids.shape[0] == 0:
            return cnn.projection.weight.new_zeros(0, cnn.cfg.n_filters)
        ids = char_ids.to(torch.int64).contiguous().numpy()
        flat, widths, n_out, offsets = self._tables()
        maxima = np.empty((ids.shape[0], cnn.cfg.n_filters), dtype=np.float32)

        def rows(lo: int, hi: int) -> None:
            native_filters.char_filters(
                ids[lo:hi], flat, widths, n_out, offsets, N_CHAR_IDS, maxima[lo:hi]
            )

        pool = direction_pool() if len(ids) >= tuning.NATIVE_SPLIT_MIN_TOKENS else None
        if pool is None:
            rows(0, len(ids))
        else:  # each worker its own half of the rows: the same numbers as one call
            bounds = (0, len(ids) // 2, len(ids))
            on_both_workers(pool, lambda part: rows(bounds[part], bounds[part + 1]))
        bias = torch.cat([conv.bias for conv in cnn.convs])
        return cnn.activation(torch.from_numpy(maxima).add_(bias))

    def _tables(self) -> tuple[np.ndarray, ...]:
        """The model's lookup tables as one flat fp32 buffer, with widths, sizes, offsets."""
        cnn = self.bilm.token_encoder
        params = [cnn.char_embed.weight, *(conv.weight for conv in cnn.convs)]

        def build() -> tuple[np.ndarray, ...]:
            tables = cnn.build_lookup_tables(torch.float32)
            sizes = [t.numel() for t in tables]
            return (
                torch.cat([t.reshape(-1) for t in tables]).numpy(),
                np.array([w for w, _ in cnn.cfg.filters], dtype=np.int64),
                np.array([n for _, n in cnn.cfg.filters], dtype=np.int64),
                np.cumsum([0, *sizes[:-1]], dtype=np.int64),
            )

        return self._cache.get_or_build("filters", params, build)

    def _linears(self) -> list[PackedLinear]:
        """The highway layers (int8 when asked) and the projection, packed."""
        cnn = self.bilm.token_encoder
        modules = [*cnn.highways, cnn.projection]
        params = [p for m in modules for p in (m.weight, m.bias)]

        def build() -> list[PackedLinear]:
            int8 = self.weights == "int8"
            if self.weights == "bf16":
                hw = [PackedLinear(round_weight(m.weight, "bf16")[0], m.bias) for m in cnn.highways]
            else:
                hw = [PackedLinear(m.weight, m.bias, int8=int8) for m in cnn.highways]
            return [*hw, PackedLinear(cnn.projection.weight, cnn.projection.bias)]

        return self._cache.get_or_build("linears", params, build)

    # -- the biLSTM -------------------------------------------------------------
    @torch.no_grad()
    def contextualize(
        self, tokens: Tensor, lengths: Tensor, distinct: tuple[Tensor, Tensor] | None = None
    ) -> Tensor:
        """Token vectors ``[B, T, P]`` -> layers ``[L+1, B, T, 2P]`` (``BiLM.contextualize``).

        ``distinct``: optionally ``(table [U, P], index [B, T])`` with ``tokens ==
        table[index]`` at the real positions (the embedder's distinct tokens): the
        first layer's input matmul then runs once per distinct token.
        """
        regime = "one" if tokens.shape[0] == 1 else "batch"
        if self._routed().get(regime) == "torch":
            return self.bilm.contextualize(tokens, lengths)
        return self.native_contextualize(tokens, lengths, distinct)

    def native_contextualize(
        self, tokens: Tensor, lengths: Tensor, distinct: tuple[Tensor, Tensor] | None = None
    ) -> Tensor:
        """:meth:`contextualize` in the native kernels, whatever the route."""
        compile_kernels()
        kernel = self.bilstm_kernel()
        b, t = tokens.shape[:2]
        if b == 1 and int(lengths[0]) == t:
            return self._one(kernel, tokens[0])
        batch = SortedBatch(tokens, lengths)
        # [2, T, B, P]: time-major, so a step's rows are contiguous
        x = torch.stack([batch.tokens, batch.reversed(batch.tokens)]).transpose(1, 2).contiguous()
        kernel_distinct = None
        if distinct is not None:  # the same reordering for the index: [2, T, B]
            table, index = distinct
            index = batch.sorted(index).unsqueeze(-1)
            index = torch.stack([index, batch.reversed(index)]).squeeze(-1)
            kernel_distinct = (table, index.transpose(1, 2).contiguous())
        ys = [y.transpose(1, 2) for y in kernel(x, batch.active, kernel_distinct)]  # [2, B, T, P]
        return batch.layers([y[0] for y in ys], [y[1] for y in ys])

    def stream_state(self) -> object:
        """A new row's zero state for :meth:`stream`."""
        compile_kernels()
        return self.bilstm_kernel().stream_state()

    @torch.no_grad()
    def stream(self, inputs: Chunks, states: list, meanwhile: Meanwhile = None) -> ChunkLayers:
        """Rows from their carried states (``BiLstmKernel.stream``): one row in the native
        loop, several in batched steps."""
        return self.bilstm_kernel().stream(inputs, states, meanwhile)

    def _one(self, kernel: BiLstmKernel, tokens: Tensor) -> Tensor:
        """One unpadded sentence ``[T, P]``: no sorting, masking or gathers (a
        single-sentence request pays ~25 small ops less)."""
        x = torch.stack([tokens, tokens.flip(0)]).unsqueeze(2)  # [2, T, 1, P]
        layers = [torch.cat([tokens, tokens], dim=-1)]
        for y in kernel(x, [1] * tokens.shape[0]):
            layers.append(torch.cat([y[0, :, 0], y[1, :, 0].flip(0)], dim=-1))
        return torch.stack(layers).unsqueeze(1)  # [L+1, 1, T, 2P]

    def bilstm_kernel(self) -> BiLstmKernel:
        """The :class:`BiLstmKernel` for the model's current weights."""
        pairs = list(zip(self.bilm.forward_layers, self.bilm.backward_layers, strict=True))
        params = [p for pair in pairs for m in pair for p in m.parameters()]
        kernel = self._cache.get_or_build(
            "bilstm", params, lambda: BiLstmKernel(pairs, self.bilm.cfg.residual, self.weights)
        )
        kernel.recurrent_on_transposed(self.recurrent_rows)
        return kernel
