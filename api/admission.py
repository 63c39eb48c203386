"""Admission control: the queue bound and the work estimate.

A request is refused at the door with a 429: :class:`QueueFull` when its lane's queue is
full, :class:`Overloaded` (with ``Retry-After``) when the work ahead of it -- queued and
running tokens x the measured seconds per token (:class:`WorkEstimate`, from a slow prior)
-- plus its own would not finish within 80 % of its timeout. Admitting it would only make
it fail with 503 later while taking model time from requests that can still make it. A take
is sorted by length, so a later request can run before an earlier one of its take: it is
also refused when it would push the oldest queued request of its take past that request's
deadline (:meth:`elmo_api.lanes.LaneQueue.admit`). A request with nothing ahead of it is
always admitted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


class QueueFull(Exception):
    """The batcher's queue cannot take the request; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Overloaded(QueueFull):
    """The work already queued would not let the request finish inside its timeout."""


class WorkEstimate:
    """Seconds per token: a token-weighted moving average over real batches.

    ``seconds_per_token`` is ``prior`` until a batch has been measured, then
    ``sum(decayed seconds) / sum(decayed tokens)`` -- big batches weigh more than
    the small ones whose fixed overhead makes them look slow per token. The
    seconds are the batcher's busy time, not only the model's.
    """

    def __init__(self, prior: float = 5e-3, decay: float = 0.8, headroom: float = 0.8) -> None:
        self.prior = prior
        self.decay = decay
        # admit only what the estimate finishes within this share of the timeout: the rate
        # moves with load on the machine, and the estimate follows it a few batches late
        self.headroom = headroom
        self._seconds = 0.0
        self._tokens = 0.0

    def observe(self, seconds: float, tokens: int) -> None:
        if tokens <= 0 or seconds < 0:
            return
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
        within ``headroom`` x ``timeout`` and, when given, within ``protect`` seconds (what
        is left of the earliest deadline among queued requests this one could delay)."""
        if timeout is None or pending <= 0:
            return
        spt = self.seconds_per_token
        ahead, total = pending * spt, (pending + cost) * spt
        budget = timeout * self.headroom
        if protect is not None:
            budget = min(budget, protect)
        if total <= budget:
            return
        # when enough of the queue has drained (all of it, if this request alone is too big)
        retry = max(1, math.ceil(min(ahead, total - budget)))
        raise Overloaded(
            f"about {ahead:.1f}s of work is queued ({pending} tokens at "
            f"{spt * 1e3:.3g} ms/token); with this request's {cost} tokens it "
            + (
                f"could not finish within its {timeout:g}s timeout"
                if budget >= timeout * self.headroom
                else "would delay queued requests past their timeout"
            ),
            retry_after=retry,
        )


def token_cost(tokens: Sequence[str]) -> int:
    """What admission counts for a sentence: its tokens and the model's <S> and </S>."""
    return len(tokens) + 2


# the server's defaults (api/settings.py reads these; the budget's are elmo_service's)
DEFAULT_FILL_WAIT_MS = 10.0
DEFAULT_MAX_QUEUE = 4096


class Ticket:
    """An announced request; ``retire`` is idempotent."""

    __slots__ = ("live", "runner")

    def __init__(self, runner: Any) -> None:  # the runner it was announced to, or None
        self.runner = runner
        self.live = runner is not None

    def retire(self) -> None:
        if self.live and self.runner is not None:
            self.runner.retire(self)


class BatcherClosed(Exception):
    """The batcher was stopped (shutdown or model swap) before the work ran."""
