"""The two kernels a BiLM runs in, and the choice between them (made once, by the embedder)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from elmo_service.bilm.lstm import ChunkLayers, Chunks, Meanwhile

if TYPE_CHECKING:
    from elmo_service.bilm.model import BiLM


class BiLMKernel(Protocol):
    """What the embedder runs: the model's two halves, and a warm-up."""

    name: str

    def encode(self, char_ids: Tensor) -> Tensor:
        """Character ids ``[N, W]`` -> token vectors ``[N, P]``."""

    def contextualize(
        self, tokens: Tensor, lengths: Tensor, distinct: tuple[Tensor, Tensor] | None = None
    ) -> Tensor:
        """Token vectors ``[B, T, P]`` -> layers ``[L+1, B, T, 2P]``."""

    def warm_up(self) -> None:
        """Compile whatever compiles ahead of time."""

    def stream_state(self) -> object:
        """A new row's zero state for :meth:`stream` (opaque to the caller)."""

    def stream(self, inputs: Chunks, states: list, meanwhile: Meanwhile = None) -> ChunkLayers:
        """A long sequence in chunks, both directions: ``inputs[r] = (forward x [n, P],
        backward x [m, P])`` of row ``r``, each in its direction's reading order, from
        ``states[r]`` (updated in place to the state after the row's last step) -> per
        row, per direction, each layer's ``[n, P]``. ``meanwhile`` runs on the calling
        thread while the rows compute (where they compute elsewhere)."""


class TorchBiLM:
    """The model's own torch code (``elmo_service/bilm/model.py``): any device and dtype.

    # Parameters

    bilm : `BiLM`
        The model.
    compile : `bool`, optional (default = `False`)
        ``torch.compile`` the biLSTM (the character CNN's inference path is table
        lookups with data-dependent shapes, which compile would slow down). The
        time loop unrolls, so each padded length compiles once; the batch
        dimension is dynamic.
    """

    def __init__(self, bilm: BiLM, *, compile: bool = False) -> None:
        self.bilm = bilm
        self.name = "torch (compiled)" if compile else "torch"
        self._contextualize = (
            torch.compile(bilm.contextualize, dynamic=False) if compile else bilm.contextualize
        )

    def encode(self, char_ids: Tensor) -> Tensor:
        return self.bilm.token_encoder(char_ids)

    def contextualize(
        self, tokens: Tensor, lengths: Tensor, distinct: tuple[Tensor, Tensor] | None = None
    ) -> Tensor:
        return self._contextualize(tokens, lengths)

    def warm_up(self) -> None:
        pass  # torch.compile compiles per shape, on the first batch of each

    def stream_state(self) -> list:
        return [None, None]  # per direction the model's LstmStates, none before the first chunk

    def stream(self, inputs: Chunks, states: list, meanwhile: Meanwhile = None) -> ChunkLayers:
        # row by row through the model's own layers (any device, dtype): rows of a batch
        # would need each one's state at its own last step, which LstmLayer does not keep
        outs = []
        for (xf, xb), state in zip(inputs, states, strict=True):
            row = []
            for d, (direction, x) in enumerate((("forward", xf), ("backward", xb))):
                ys, state[d] = self.bilm.run_direction(direction, x[None], state[d])
                row.append([y[0] for y in ys])
            outs.append((row[0], row[1]))
        if meanwhile is not None:
            meanwhile()
        return outs


def choose_kernel(
    bilm: BiLM, device: torch.device, precision: str, weights: str, compile: bool
) -> BiLMKernel:
    """The native kernels for fp32 on the CPU without compile; the model's torch code
    otherwise (``weights="int8"`` needs the former: the caller checks)."""
    if device.type == "cpu" and precision == "fp32" and not compile:
        from elmo_service.bilm.kernels.cpu_bilm import CpuBiLM

        return CpuBiLM(bilm, weights=weights)
    return TorchBiLM(bilm, compile=compile)
