"""A fake model function for the batcher's tests: records its batches, can be held."""

from __future__ import annotations

import threading
import time

import numpy as np


def token_values(tokens) -> np.ndarray:
    """What :class:`FakeModel` answers for a sentence: ``[1, T, 1]``, a value per token."""
    return np.array([[[float(hash(t) % 1000)] for t in tokens]], dtype=np.float32)


class FakeModel:
    """Records every batch as a list of token tuples; with ``gate``, its calls wait for
    the gate (``started`` is set as the first one begins); ``delay`` seconds per call."""

    def __init__(self, gate: threading.Event | None = None, delay: float = 0.0) -> None:
        self.batches: list[list[tuple[str, ...]]] = []
        self.gate = gate
        self.delay = delay
        self.started = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, sentences):
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        if self.delay:
            time.sleep(self.delay)
        with self.lock:
            self.batches.append([tuple(s) for s in sentences])
        return [token_values(s) for s in sentences]
