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

Length: sentences of any length, as ELMoForManyLangs takes them (the model's own
``max_sentence_tokens``, which bounds the service's requests, is not applied here);
``max_sentence_tokens=N`` refuses longer sentences with a ``LimitError`` naming them.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from elmo_service.artifact import Artifact, load_artifact
from elmo_service.bilm.runner import CarriedState
from elmo_service.embedder import Embedder
from elmo_service.errors import InputError


class ManyLangsEmbedder:
    """``elmoformanylangs.Embedder``'s interface over an artifact (any artifact: a model of
    this project reads the words with its own tokenizer)."""

    def __init__(
        self,
        model: str | Path | Artifact,
        batch_size: int = 64,
        *,
        stateful: bool = False,
        max_sentence_tokens: int | None = None,
    ) -> None:
        if batch_size < 1:
            raise InputError("batch_size must be >= 1", field="batch_size")
        if max_sentence_tokens is not None and (
            isinstance(max_sentence_tokens, bool)
            or not isinstance(max_sentence_tokens, int)
            or max_sentence_tokens < 1
        ):
            raise InputError(
                f"max_sentence_tokens must be an int >= 1 or None, got {max_sentence_tokens!r}",
                field="max_sentence_tokens",
            )
        art = model if isinstance(model, Artifact) else load_artifact(model)
        # no limit unless the caller sets one: ELMoForManyLangs has none
        self.embedder = Embedder(art, max_sentence_tokens=max_sentence_tokens or sys.maxsize)
        self.batch_size = batch_size
        self.stateful = stateful
        self._carried = CarriedState()  # the rows' LSTM state (stateful=True)

    def reset_states(self) -> None:
        self._carried.reset()

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
        runner = emb.runner
        toks = emb.tokenize([list(s) for s in sents])
        texts = [[t.piece for t in ts] for ts in toks]
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))  # its stable sort
        out: list[np.ndarray | None] = [None] * len(texts)
        for lo in range(0, len(order), self.batch_size):
            rows = order[lo : lo + self.batch_size]
            with runner.session():  # ``[<bos>] + words + [<eos>]``: the CNN and its cache
                markers = runner.marker_vectors()
                vectors = [
                    torch.cat([markers[:1], runner.token_vectors(texts[i]), markers[1:]])
                    .float()
                    .cpu()
                    for i in rows
                ]
            lengths = torch.tensor([len(v) for v in vectors])
            tokens = torch.nn.utils.rnn.pad_sequence(vectors, batch_first=True)
            with torch.inference_mode():
                layers = runner.run_from(tokens, lengths, self._carried)
            for r, i in enumerate(rows):
                out[i] = layers[:, r, 1 : int(lengths[r]) - 1].float().numpy().copy()
        return out  # type: ignore[return-value]


__all__ = ["ManyLangsEmbedder"]
