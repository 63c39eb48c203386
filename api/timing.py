"""Where a request's time went: the ``X-*-Time`` headers and the per-lane histograms.

The middleware leaves a :class:`RequestTiming` in each ``POST /v1/...`` scope; the route
adds its tokenization, the batcher each batch that carried the request's sentences.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from elmo_api.lanes import INTERACTIVE, Lane

# the ASGI scope key under which a request's RequestTiming is left (elmo_api.middleware)
TIMING_KEY = "elmo.timing"


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
