"""Cutting sentences into model batches: the one planner, and its budget.

A batch costs its padded tokens, ``n_sentences * longest`` (the biLSTM runs
every row to the longest row's length). Sorting by length first keeps that
padding small. The library path (``Embedder.embed_tokens``) and the server's
batcher (``api/batcher.py``) both plan with :func:`plan_batches`; the server
then hands each planned batch to ``Embedder.run_batch``, which runs it as
one model call and never re-plans.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from elmo_service.errors import ConfigError

# the defaults of the library and of the server (api/settings.py reads these)
DEFAULT_BATCH_TOKENS = 4096
DEFAULT_MAX_BATCH_SENTENCES = 256

T = TypeVar("T")


@dataclass(frozen=True)
class BatchBudget:
    """Upper bounds of one model batch: padded tokens (with the <S>/</S> markers) and rows."""

    tokens: int = DEFAULT_BATCH_TOKENS
    sentences: int = DEFAULT_MAX_BATCH_SENTENCES

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ConfigError("batch_tokens must be >= 1", field="batch_tokens")
        if self.sentences < 1:
            raise ConfigError("max_batch_sentences must be >= 1", field="max_batch_sentences")


def plan_batches(costs: Sequence[int], budget: BatchBudget) -> list[list[int]]:
    """Indices of ``costs`` (padded length of each sentence, markers included), longest first,
    cut so that each batch has ``len(batch) * max cost <= budget.tokens`` and at most
    ``budget.sentences`` rows. Ties keep their input order (a stable sort), so the same
    input always gives the same batches. A sentence longer than the budget is a batch alone.
    """
    order = sorted(range(len(costs)), key=lambda i: -costs[i])
    batches: list[list[int]] = []
    batch: list[int] = []
    for i in order:
        width = costs[batch[0]] if batch else costs[i]
        if batch and ((len(batch) + 1) * width > budget.tokens or len(batch) >= budget.sentences):
            batches.append(batch)
            batch = []
        batch.append(i)
    if batch:
        batches.append(batch)
    return batches


__all__ = ["DEFAULT_BATCH_TOKENS", "DEFAULT_MAX_BATCH_SENTENCES", "BatchBudget", "plan_batches"]


def chunks(items: Iterable[T], n: int) -> Iterator[list[T]]:
    """Lists of ``n`` items (the last one shorter), reading ``items`` only as far as needed."""
    chunk: list[T] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
