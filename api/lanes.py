"""Priority lanes: the batcher's queues and its fairness rule.

Two lanes, named by a request's ``priority``: ``interactive`` (the default) and ``batch``
(:mod:`elmo_api.batcher` says how one policy serves them; docs/serving.md, the figures).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from elmo_api.admission import QueueFull, WorkEstimate
from elmo_api.metrics import Metrics

Lane = Literal["interactive", "batch"]
INTERACTIVE: Lane = "interactive"
BATCH: Lane = "batch"
LANES: tuple[Lane, ...] = (INTERACTIVE, BATCH)

# the lanes' defaults (api/settings.py reads these; docs/serving.md says how they were chosen)
DEFAULT_BATCH_SHARE = 0.2
# the batch lane's niceness beside the express thread: the CPU goes to interactive work and
# the event loop first
DEFAULT_BATCH_NICE = 10


@dataclass(eq=False)
class QueuedSentence:
    """One sentence in a lane's queue, with the future its request awaits."""

    tokens: Sequence[str]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    lane: Lane = INTERACTIVE
    timing: Any = None  # the request's elmo_api.timing.RequestTiming, if it keeps one
    trace: Any = None  # the request's tracing context, when tracing is on
    enqueued: float = field(default_factory=time.perf_counter)
    deadline: float = math.inf  # by when admission promised it an answer (perf_counter)

    @property
    def cost(self) -> int:
        """What admission counts: its tokens and the model's <S> and </S>."""
        return len(self.tokens) + 2


class LaneQueue:
    """A lane's sentences, oldest first, with their tokens: ``queued``, and ``pending``
    (queued or in the model), which admission counts. Under the batcher's lock."""

    def __init__(self, lane: Lane, max_queue: int) -> None:
        self.lane, self.max_queue = lane, max_queue
        self.items: deque[QueuedSentence] = deque()
        self.queued = self.pending = 0

    def __len__(self) -> int:
        return len(self.items)

    def admit(
        self,
        items: Sequence[QueuedSentence],
        ahead: int,
        estimate: WorkEstimate,
        timeout: float | None,
        take_tokens: int,
        metrics: Metrics | None,
    ) -> None:
        """Raise QueueFull when ``items`` would pass ``max_queue``, Overloaded when the
        ``ahead`` tokens and theirs would not finish in time (:mod:`elmo_api.admission`);
        each refusal counted, also per lane."""
        reason, cost = "queue_full", sum(it.cost for it in items)
        try:
            if len(self.items) + len(items) > self.max_queue:
                raise QueueFull(
                    f"{self.lane} queue full: {len(self.items)} sentences waiting, limit "
                    f"{self.max_queue}{' (ELMO_BATCH_MAX_QUEUE)' if self.lane == BATCH else ''}"
                )
            reason = "overloaded"
            estimate.check(ahead, cost, timeout, self._protect(cost, take_tokens))
        except QueueFull:
            if metrics:
                metrics.rejected.labels(reason).inc()
                metrics.lane_rejected.labels(self.lane, reason).inc()
            raise

    def _protect(self, cost: int, take_tokens: int) -> float | None:
        """Seconds left of the oldest live queued request's deadline when ``cost`` more
        tokens join its take (sorted by length, they may run first; queued requests share
        the timeout, so the oldest is the earliest); None when they start a later take."""
        if self.queued + cost > take_tokens:
            return None
        now = time.perf_counter()
        for it in self.items:
            if not it.future.done() and it.deadline > now:
                return it.deadline - now
        return None

    def push(self, items: Sequence[QueuedSentence], front: bool = False) -> None:
        """New sentences at the back; taken but not run (``front``) back at the front."""
        cost = sum(it.cost for it in items)
        if front:
            self.items.extendleft(reversed(items))
        else:
            self.items.extend(items)
            self.pending += cost
        self.queued += cost

    def pop(self, tokens: int) -> list[QueuedSentence]:
        """The oldest sentences while their tokens fit in ``tokens`` (at least one)."""
        taken, moved = [], 0
        while self.items and (not taken or moved + self.items[0].cost <= tokens):
            taken.append(self.items.popleft())
            moved += taken[-1].cost
        self.queued -= moved
        return taken

    def clear(self) -> list[QueuedSentence]:
        """Everything queued, out of the queue and the pending work."""
        taken, cost = list(self.items), sum(it.cost for it in self.items)
        self.items.clear()
        self.queued -= cost
        self.pending -= cost
        return taken


class LaneShare:
    """Without the express thread: the batch lane's share of the model, in tokens over
    recent batches (each decays the past by ``decay``). While both lanes wait, batch work
    gets at least ``batch_share``: a share, not an age rule, which under a sustained batch
    flood would hand the whole model to the aged backlog. Tokens stand for model time and
    keep the rule deterministic."""

    def __init__(self, batch_share: float = 0.2, decay: float = 0.9, floor: float = 0.0) -> None:
        if not 0.0 <= batch_share <= 1.0:
            raise ValueError("batch_share must be in [0, 1]")
        self.batch_share, self.decay = batch_share, decay
        # light interactive traffic (below ``floor`` recent tokens: the batcher passes a batch
        # budget) never yields: batch work already gets the idle model and the room in
        # interactive batches, and a lone request waiting for a batch slice only adds latency
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
