"""ELMoForManyLangs' ``Embedder``, on a converted artifact: ``sents2elmo`` as its users call it.

    from elmo_service.manylangs import ManyLangsEmbedder     # was: from elmoformanylangs import Embedder
    e = ManyLangsEmbedder("models/zh-elmo")                   # an artifact from `elmo-service convert --manylangs`
    e.sents2elmo([["今天", "天气", "很", "好"]])              # [3, T, 2P] per sentence with output_layer=-2

``output_layer``: -1 the average of the layers (its default), -2 all of them ``[L+1, T, 2P]``,
``k`` layer k. The vectors equal ELMoForManyLangs' from a fresh ``Embedder``
(``tests/elmo_service/test_efml_parity.py``).

State: ELMoForManyLangs' encoder is stateful: each batch starts from the state the
previous batch left in the same row, so a sentence's vectors depend on what came before
(and, past ``batch_size`` sentences, on its random batch order). Here ``stateful=False``
(the default) starts every sentence from zero, like the rest of this service;
``stateful=True`` carries the state row by row as ``Elmo(stateful=True)`` carries
AllenNLP's (rows are the sentences sorted longest first within each batch of
``batch_size``, its order; batches in that sorted order, not shuffled), and
:meth:`reset_states` zeroes it. One call of at most ``batch_size`` sentences after a
stateful one equals ELMoForManyLangs' second call exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from elmo_service.artifact import Artifact, load_artifact
from elmo_service.bilm.model import BiLM, BiLMState, carried_keep, carried_rows
from elmo_service.embedder import Embedder
from elmo_service.errors import InputError


class ManyLangsEmbedder:
    """``elmoformanylangs.Embedder``'s interface over an artifact (any artifact: a model of
    this project reads the words with its own tokenizer)."""

    def __init__(
        self, model: str | Path | Artifact, batch_size: int = 64, *, stateful: bool = False
    ) -> None:
        if batch_size < 1:
            raise InputError("batch_size must be >= 1", field="batch_size")
        art = model if isinstance(model, Artifact) else load_artifact(model)
        self.embedder = Embedder(art)
        self.batch_size = batch_size
        self.stateful = stateful
        self._states: tuple[torch.Tensor, torch.Tensor] | None = None  # [2, L, rows, P|C]

    def reset_states(self) -> None:
        self._states = None

    def sents2elmo(
        self, sents: Sequence[Sequence[str]], output_layer: int = -1
    ) -> list[np.ndarray]:
        n_layers = self.embedder.cfg.n_output_layers
        if output_layer not in (-1, -2) and not 0 <= output_layer < n_layers:
            raise InputError(
                f"output_layer must be -1, -2 or 0..{n_layers - 1}, got {output_layer}",
                field="output_layer",
            )
        for i, s in enumerate(sents):
            if isinstance(s, str):
                raise InputError(
                    f"sents[{i}] must be a list of words, not a string", field=f"sents[{i}]"
                )
        if self.stateful:
            layers = self._stateful(sents)
        else:
            layers = [e.layers for e in self.embedder.embed([list(s) for s in sents])]
        if output_layer == -1:
            return [x.mean(axis=0, dtype=np.float64).astype(np.float32) for x in layers]
        return layers if output_layer == -2 else [x[output_layer] for x in layers]

    # ------------------------------------------------------------------ carried state
    def _stateful(self, sents: Sequence[Sequence[str]]) -> list[np.ndarray]:
        emb = self.embedder
        bilm: BiLM = emb.model
        toks = emb.tokenize([list(s) for s in sents])
        texts = [[t.piece for t in ts] for ts in toks]
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))  # its stable sort
        out: list[np.ndarray | None] = [None] * len(texts)
        for lo in range(0, len(order), self.batch_size):
            rows = order[lo : lo + self.batch_size]
            vectors = [self._token_vectors(texts[i]) for i in rows]
            lengths = torch.tensor([len(v) for v in vectors])
            tokens = torch.nn.utils.rnn.pad_sequence(vectors, batch_first=True)
            with torch.inference_mode():
                layers, final = bilm.contextualize_from(tokens, lengths, self._initial(len(rows)))
            self._keep(final)
            for r, i in enumerate(rows):
                out[i] = layers[:, r, 1 : int(lengths[r]) - 1].float().numpy().copy()
        return out  # type: ignore[return-value]

    def _token_vectors(self, words: list[str]) -> torch.Tensor:
        """``[<bos>] + words + [<eos>]`` -> ``[T + 2, P]`` (the embedder's CNN and cache)."""
        emb = self.embedder
        with emb._lock, torch.inference_mode():
            markers = emb._marker_vectors()
            inner = emb._token_vectors(words) if words else markers[:0]
            return torch.cat([markers[:1], inner, markers[1:]]).float().cpu()

    def _initial(self, batch: int) -> BiLMState | None:
        """The carried state of the first ``batch`` rows; rows never seen start from zero."""
        if self._states is None:
            return None
        self._states, state = carried_rows(self._states, batch)
        return state

    def _keep(self, final: BiLMState) -> None:
        """This batch's rows take their final state; rows past it keep theirs."""
        h, c = carried_keep(self._states, final)
        self._states = (h.float(), c.float())


__all__ = ["ManyLangsEmbedder"]
