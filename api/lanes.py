"""Priority lanes: the batcher's queue entries, its threads and its fairness rule.

Two lanes, named by a request's ``priority``: ``interactive`` (the default) and
``batch`` (:mod:`elmo_api.batcher` says how one policy serves them).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from elmo_api.admission import token_cost

log = logging.getLogger("elmo_api.batcher")

Lane = Literal["interactive", "batch"]
INTERACTIVE: Lane = "interactive"
BATCH: Lane = "batch"
LANES: tuple[Lane, ...] = (INTERACTIVE, BATCH)

# the lanes' defaults (api/settings.py reads these; docs/serving.md says how they were chosen)
DEFAULT_BATCH_SHARE = 0.2
# the batch lane's niceness beside the express thread: the CPU goes to interactive work and
# the event loop first (interactive p99 1.8x idle under a batch flood, against 9.5-11.7x at 0)
DEFAULT_BATCH_NICE = 10


def start_lane_thread(
    target: Callable[[], None], name: str, threads: int | None
) -> threading.Thread:
    """Start a lane's model thread (daemon) with ``threads`` intra-op (torch) threads of its
    own, leaving the caller's count and torch's default for later threads as they were.

    The interactive lane's thread runs beside the batch lane's, which has the process's
    count (2 on 2 cores): one intra-op thread keeps the two lanes within the cores. None:
    torch's default (no torch import here).
    """
    if threads is None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        return thread
    import torch  # only when asked: the lanes themselves run any embed function

    pinned = threading.Event()

    def run() -> None:
        # torch sets a thread's count from its default on the thread's first parallel op:
        # take that first, or it would undo the count set here (the pattern of
        # elmo_service.bilm.kernels.bilstm.direction_pool)
        torch.get_num_threads()
        torch.set_num_threads(threads)
        pinned.set()
        target()

    default = torch.get_num_threads()
    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    pinned.wait(10)
    # torch also records the last count set as the default of threads started later: the
    # batch lane's thread (started after this one) keeps the process's count
    torch.set_num_threads(default)
    return thread


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


def renice(threads: list[threading.Thread], nice: int) -> None:
    """Make ``threads`` at least ``nice`` (Linux: niceness is per thread; raising it needs
    no privilege, lowering it does, so a thread already nicer stays as it is)."""
    for t in threads:
        try:
            tid = t.native_id
            if tid is not None and os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except (AttributeError, OSError) as e:  # not Linux, or not allowed
            log.warning("batch lane: cannot lower the priority of %s: %s", t.name, e)
            return


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
