"""Priority lanes and where a request's time went: the batcher's bookkeeping.

Two lanes, named by a request's ``priority``: ``interactive`` (the default) and
``batch``. The batcher (:mod:`elmo_api.batcher`) serves interactive work first and
gives the batch lane a bounded share of the model (:class:`LaneShare`);
:class:`RequestTiming` collects one request's tokenization, queue and inference
time for the ``X-*-Time`` headers and the per-lane histograms.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

Lane = Literal["interactive", "batch"]
INTERACTIVE: Lane = "interactive"
BATCH: Lane = "batch"
LANES: tuple[Lane, ...] = (INTERACTIVE, BATCH)

# the ASGI scope key under which a request's RequestTiming is left (elmo_api.middleware)
TIMING_KEY = "elmo.timing"


class LaneShare:
    """The batch lane's share of the model, over recent batches, in tokens.

    Why a bounded share and not an age rule: an age rule (batch work older than X goes
    first) hands the whole model to batch work whenever a backlog of it has aged, which
    under a sustained batch flood is always: interactive latency is then unbounded again.
    A share bounds both sides at once: while both lanes have work waiting, the batch lane
    gets at least ``batch_share`` of the model and interactive work the rest, whatever
    either side sends. Tokens (with sentence markers) stand for model time: to first order
    a batch's time is proportional to them, and a count keeps the rule deterministic (the
    tests rely on it). Each batch decays the past by ``decay``: the share is over roughly
    the last ``1 / (1 - decay)`` batches.
    """

    def __init__(self, batch_share: float = 0.2, decay: float = 0.9, floor: float = 0.0) -> None:
        if not 0.0 <= batch_share <= 1.0:
            raise ValueError("batch_share must be in [0, 1]")
        self.batch_share = batch_share
        self.decay = decay
        # light interactive traffic never yields: below ``floor`` recent interactive tokens
        # (the batcher passes one batch budget) batch work already gets the idle model and
        # the room in interactive batches, and making a lone interactive request wait for
        # a batch slice would only add latency
        self.floor = floor
        self.tokens = {INTERACTIVE: 0.0, BATCH: 0.0}

    def ran(self, tokens: dict[Lane, int]) -> None:
        """One batch ran ``tokens`` per lane."""
        for lane in LANES:
            self.tokens[lane] = self.decay * self.tokens[lane] + tokens.get(lane, 0)

    def batch_due(self) -> bool:
        """With both lanes waiting: has the batch lane fallen below its share?"""
        if self.batch_share <= 0 or self.tokens[INTERACTIVE] < self.floor:
            return False
        total = self.tokens[INTERACTIVE] + self.tokens[BATCH]
        return self.tokens[BATCH] < self.batch_share * total


@dataclass(eq=False)
class RequestTiming:
    """One request's phases, in seconds (the route and the batcher fill it in).

    ``queue`` and ``inference`` cover the runner: ``inference`` sums the model calls that
    carried the request's sentences (several when they spread over batches), ``queue`` is
    the rest of its time in the runner (waiting, and between its batches). A request
    answered from the cache spends none. ``started`` is when the request arrived.
    """

    lane: Lane = INTERACTIVE
    started: float = field(default_factory=time.perf_counter)
    used: bool = False  # an embedding path ran (the route asked the model or the cache)
    tokenization: float = 0.0
    queue: float = 0.0
    inference: float = 0.0
    # the runner's part: set by the batcher's worker, read once the futures are done
    submitted: float = 0.0
    finished: float = 0.0
    batches: list[int] = field(default_factory=list)  # ids of the batches it was in

    def add_batch(self, batch_id: int, seconds: float, end: float) -> None:
        """Called by the worker thread for each batch holding the request's sentences."""
        if batch_id not in self.batches:
            self.batches.append(batch_id)
            self.inference += seconds
        self.finished = max(self.finished, end)

    def close_runner(self) -> None:
        """The request's futures are done: what was not inference was queueing."""
        if self.submitted and self.finished:
            self.queue = max(0.0, (self.finished - self.submitted) - self.inference)

    def total(self, now: float | None = None) -> float:
        """Seconds since the request arrived; never less than its parts."""
        total = max(0.0, (time.perf_counter() if now is None else now) - self.started)
        return max(total, self.tokenization + self.queue + self.inference)

    def headers(self, total: float) -> list[tuple[bytes, bytes]]:
        """The four ``X-*-Time`` headers, milliseconds."""
        return [
            (b"x-total-time", f"{total * 1e3:.3f}".encode()),
            (b"x-tokenization-time", f"{self.tokenization * 1e3:.3f}".encode()),
            (b"x-queue-time", f"{self.queue * 1e3:.3f}".encode()),
            (b"x-inference-time", f"{self.inference * 1e3:.3f}".encode()),
        ]

    def phases(self, total: float) -> dict[str, float]:
        return {
            "total": total,
            "tokenization": self.tokenization,
            "queue": self.queue,
            "inference": self.inference,
        }
