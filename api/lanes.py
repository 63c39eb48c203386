"""Priority lanes: the batcher's queue entries and its fairness rule.

Two lanes, named by a request's ``priority``: ``interactive`` (the default) and
``batch`` (:mod:`elmo_api.batcher` says how one policy serves them).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from elmo_api.admission import token_cost

Lane = Literal["interactive", "batch"]
INTERACTIVE: Lane = "interactive"
BATCH: Lane = "batch"
LANES: tuple[Lane, ...] = (INTERACTIVE, BATCH)

# the lanes' defaults (api/settings.py reads these; docs/serving.md says how they were chosen)
DEFAULT_BATCH_SHARE = 0.2
# the batch lane's niceness beside the express thread: the CPU goes to interactive work and
# the event loop first (interactive p99 1.8x idle under a batch flood, against 9.5-11.7x at 0)
DEFAULT_BATCH_NICE = 10


@dataclass(eq=False)
class QueuedSentence:
    """One sentence in a lane's queue, with the future its request awaits."""

    tokens: Sequence[str]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    lane: Lane = INTERACTIVE
    timing: Any = None  # the request's elmo_api.lanes.RequestTiming, if it keeps one
    trace: Any = None  # the request's tracing context, when tracing is on
    enqueued: float = field(default_factory=time.perf_counter)
    deadline: float = math.inf  # by when admission promised it an answer (perf_counter)

    @property
    def cost(self) -> int:
        return token_cost(self.tokens)


def set_results(
    pairs: list[tuple[asyncio.Future, object]], error: BaseException | None = None
) -> None:
    """Runs on the event loop: complete futures that nobody cancelled meanwhile."""
    for fut, value in pairs:
        if fut.done():
            continue
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)


class LaneShare:
    """The batch lane's share of the model over recent batches, in tokens (one model thread).

    A share, not an age rule: under a sustained batch flood an age rule hands the whole model
    to the aged backlog, always. While both lanes wait the batch lane gets at least
    ``batch_share`` and interactive work the rest. Tokens stand for model time (and keep the
    rule deterministic); each batch decays the past by ``decay``.
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
