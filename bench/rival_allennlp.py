"""AllenNLP 2.10's ELMo as a bench side, in its own process (``bench/fair.py``): what
``pip install allennlp`` gives, run as its users run it. Imports torch, numpy and
AllenNLP only (through the shim for its import-time quirks): nothing of ours that could
set a thread or an OpenMP variable.

    Side("rival", "bench.rival_allennlp:AllenSide", threads, options=..., weights=...)
"""

from __future__ import annotations

import time

import numpy as np
import torch

from tests.support.allennlp_shim import import_allennlp_elmo


class AllenSide:
    """``batch_to_ids`` + ``_ElmoBiLm`` (states reset per request), the layers as numpy."""

    def __init__(self, options: str, weights: str) -> None:
        self.elmo = import_allennlp_elmo()
        self.bilm = self.elmo._ElmoBiLm(options, weights)
        self.bilm.eval()
        self.requests: list[list[list[str]]] = []

    def embed(self, batch: list[list[str]]) -> list[np.ndarray]:
        with torch.no_grad():
            self.bilm._elmo_lstm.reset_states()
            out = self.bilm(self.elmo.batch_to_ids(batch))
            return [a.numpy() for a in out["activations"]]

    def set_requests(self, requests: list[list[list[str]]]) -> int:
        self.requests = requests
        self.embed(requests[0])  # warm-up, untimed
        return sum(len(s) for r in requests for s in r)

    def run(self, k: int = 0) -> dict[str, float]:
        """Tokens/s over the requests set."""
        n = sum(len(s) for r in self.requests for s in r)
        t = time.perf_counter()
        for r in self.requests:
            self.embed(r)
        return {"allennlp": n / (time.perf_counter() - t)}

    def layers(self, batch: list[list[str]], path: str) -> str:
        """Each layer ``[B, T+2, D]`` of ``batch``, saved to ``path`` (npz)."""
        np.savez(path, *self.embed(batch))
        return path
