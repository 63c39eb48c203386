"""The accuracy certificate of a fast path: how far its vectors are from fp32's, measured
on the model it runs.

    certify(path, run_fast, run_fp32, tokenize) -> Certificate

A fast path (``weights="int8"`` / ``"bf16"``, ``kernels/native_rounded.py``) rounds the
model's weights; its error depends on the weights, so it is measured on the model
served, not quoted from another: the fixed sentences :data:`SENTENCES` (short and long,
common and rare words) run through the path and through exact fp32, each sentence alone
(the compact single-sentence loop) and all of them as one batch (the batched matmuls on
the rounded weights). The certificate's figure is the largest ``|fast - fp32|`` over
every layer, position and sentence, divided by the largest ``|fp32|`` of the set: a
relative bound on any single value. Held-out perplexity needs held-out text and the
language model's softmax, which artifacts do not ship: the certificate says so
(``heldout: None``) rather than quoting a figure from elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np

# fixed: a certificate is comparable across runs and machines only on the same text
SENTENCES: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello world.",
    "In 1923, the committee met in Reykjavik to discuss the fisheries' quotas again.",
    "She said that the results, although preliminary, were far better than anyone "
    "had expected after the first two trials had failed so badly last spring.",
    "Buy 3 apples, 2 pears and a loaf of bread on your way home, please!",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Why?",
    "The stock market fell sharply on Tuesday as investors worried about rising "
    "interest rates, weak earnings and the prospect of a long slowdown in China, "
    "Europe and the United States.",
    "Colorless green ideas sleep furiously.",
    "He plays the cello in an orchestra that tours Japan every other year.",
    "Zwei Bier, bitte, und eine Brezel.",
    "The defendant's attorney objected, and the judge sustained the objection.",
)


@dataclass(frozen=True)
class Certificate:
    """What a fast path was measured to give against fp32 on this model."""

    path: str  # the kernel, e.g. "cpu-native int8"
    weights: str  # the mode: "int8" | "bf16"
    max_rel_diff: float  # max |fast - fp32| / max |fp32| over the set (alone and batched)
    sentences: int
    tokens: int
    heldout: dict | None  # {"fp32": ppl, "path": ppl, "ratio": ...}; None: no held-out text

    def to_dict(self) -> dict:
        return asdict(self)


def certify(
    path: str,
    weights: str,
    run_fast: Callable[[Sequence[Sequence[str]]], list[np.ndarray]],
    run_fp32: Callable[[Sequence[Sequence[str]]], list[np.ndarray]],
    token_texts: Sequence[Sequence[str]],
) -> Certificate:
    """The certificate of ``run_fast`` against ``run_fp32`` (each: token texts ->
    ``[L+1, T, D]`` per sentence) on ``token_texts`` (the tokenized :data:`SENTENCES`)."""
    sents = [list(s) for s in token_texts if len(s) > 0]
    ref = run_fp32(sents)
    scale = max(float(np.abs(r).max()) for r in ref)
    worst = 0.0
    batched = run_fast(sents)
    alone = [run_fast([s])[0] for s in sents]
    for got in (batched, alone):
        for g, r in zip(got, ref, strict=True):
            worst = max(worst, float(np.abs(g - r).max()))
    rel = worst / scale if scale > 0 else 0.0
    if not np.isfinite(rel):
        rel = float("inf")
    return Certificate(
        path=path,
        weights=weights,
        max_rel_diff=rel,
        sentences=len(sents),
        tokens=sum(len(s) for s in sents),
        heldout=None,
    )
