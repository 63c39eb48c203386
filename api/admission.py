"""Admission control: refuse at the door (429) what could not be answered in time.

:class:`QueueFull` when a lane's queue is full; :class:`Overloaded` (``Retry-After``) when
the tokens ahead x the measured seconds per token (:class:`WorkEstimate`), plus the
request's own, would not finish within 80 % of its timeout, or would push the oldest queued
request of the take it joins past its deadline (a take is sorted by length:
:meth:`elmo_api.lanes.LaneQueue.admit`). Admitted, it would fail with 503 later while taking
model time from requests that can still make it. Nothing ahead: always admitted.
"""

from __future__ import annotations

import math
from typing import Any

# the server's defaults (api/settings.py reads these; the budget's are elmo_service's)
DEFAULT_FILL_WAIT_MS = 10.0
DEFAULT_MAX_QUEUE = 4096


class QueueFull(Exception):
    """The batcher's queue cannot take the request; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Overloaded(QueueFull):
    """The work already queued would not let the request finish inside its timeout."""


class BatcherClosed(Exception):
    """The batcher was stopped (shutdown or model swap) before the work ran."""


class WorkEstimate:
    """Seconds per token, ``prior`` until measured, then decayed seconds / decayed tokens
    over the batcher's busy time (big batches weigh more than small ones, whose fixed
    overhead makes them look slow per token)."""

    def __init__(self, prior: float = 5e-3, decay: float = 0.8, headroom: float = 0.8) -> None:
        self.prior, self.decay = prior, decay
        # admit what finishes within this share of the timeout: the rate moves with the
        # machine's load, and the estimate follows it a few batches late
        self.headroom = headroom
        self._seconds = self._tokens = 0.0

    def observe(self, seconds: float, tokens: int) -> None:
        if tokens > 0 and seconds >= 0:
            self._seconds = self.decay * self._seconds + seconds
            self._tokens = self.decay * self._tokens + tokens

    def reset(self) -> None:
        """Back to the prior: forget what was measured so far."""
        self._seconds = self._tokens = 0.0

    @property
    def seconds_per_token(self) -> float:
        return self._seconds / self._tokens if self._tokens else self.prior

    def check(
        self, pending: int, cost: int, timeout: float | None, protect: float | None = None
    ) -> None:
        """Raise Overloaded unless ``pending`` tokens (queued or running) + ``cost`` finish
        within ``headroom`` x ``timeout`` and within ``protect`` seconds when given (what is
        left of the earliest deadline among the queued requests this one could delay)."""
        if timeout is None or pending <= 0:
            return
        spt = self.seconds_per_token
        ahead, total = pending * spt, (pending + cost) * spt
        budget = min(timeout * self.headroom, math.inf if protect is None else protect)
        if total <= budget:
            return
        why = (
            f"could not finish within its {timeout:g}s timeout"
            if budget >= timeout * self.headroom
            else "would delay queued requests past their timeout"
        )
        raise Overloaded(
            f"about {ahead:.1f}s of work is queued ({pending} tokens at {spt * 1e3:.3g} "
            f"ms/token); with this request's {cost} tokens it {why}",
            # when enough of the queue has drained (all of it, if this request alone is too big)
            retry_after=max(1, math.ceil(min(ahead, total - budget))),
        )


class Ticket:
    """An announced request (the batch fill waits for it); ``retire`` is idempotent."""

    __slots__ = ("live", "runner")

    def __init__(self, runner: Any) -> None:  # the batcher it was announced to, or None
        self.runner, self.live = runner, runner is not None

    def retire(self) -> None:
        if self.live and self.runner is not None:
            self.runner.retire(self)
