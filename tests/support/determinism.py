"""The determinism bound the service states (docs/reliability.md), in one place for the tests.

The same sentence alone, in any batch, cached or not, gives vectors that differ by at
most ``REL`` times the sentence's largest magnitude (at least 1): the single-sentence
and the batched kernels do the same float32 arithmetic in another order.
``bench/bench_determinism.py`` measures it on hard inputs.
"""

from __future__ import annotations

import numpy as np

REL = 1e-5


def bound(reference: np.ndarray) -> float:
    """The largest difference allowed from ``reference`` (one sentence's vectors)."""
    return REL * max(1.0, float(np.abs(reference).max(initial=0.0)))


def same_vectors(got: np.ndarray, reference: np.ndarray) -> bool:
    got, reference = np.asarray(got), np.asarray(reference)
    return (
        got.shape == reference.shape
        and bool(np.isfinite(got).all())
        and float(np.abs(got - reference).max(initial=0.0)) <= bound(reference)
    )
