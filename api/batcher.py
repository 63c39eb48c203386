"""Micro-batching: two priority lanes, one model thread (or one per lane), the only model callers.

Requests ``submit`` token lists (already tokenized in the request path) and
await one future per sentence. The worker thread:

* wakes as soon as anything is queued and the model is idle -- there is no
  fixed batch delay: whatever queued up while the previous batch ran forms
  the next one (as TEI's next batch forms while the current one runs);
* takes pending sentences FIFO up to a few batches' worth of padded tokens,
  drops those whose future is already done (client gone, timed out), sorts
  the rest by length and cuts them into batches under the token budget
  (``elmo_service.bilm.runner.plan_batches``, the planner the library uses too);
* runs each batch as one ``Embedder.embed_batch`` call, which does not plan
  again, and hands results back to the event loop; sentences cancelled while
  earlier batches ran are dropped too.

Priority lanes (``priority`` in a request: ``interactive``, the default, or
``batch``): each lane has its own queue, queue bound and admission.

* Interactive work goes first: a take starts with the interactive queue, and
  while batch work waits, the room left in that batch (``topup_tokens``, 128
  padded tokens by default, at most one slice) is filled with batch sentences,
  oldest first: the interactive batch stays short, and batch work rides along
  on the steps the model takes for it anyway.
* No starvation: while both lanes wait, the batch lane gets at least
  ``batch_share`` of the model's recent tokens (``elmo_api.lanes.LaneShare``: why a
  share and not an age rule is said there).
* A bound on waiting behind batch work already computing: while interactive
  traffic is live (a request in the last ``interactive_window`` seconds), batch
  work runs in slices of at most ``slice_tokens`` padded tokens; otherwise in
  full batches, and after each batch of a take the worker looks at the
  interactive queue again (the rest of the take goes back to the front of the
  batch queue). So an interactive request waits behind at most one slice (one
  full batch for the first one after a quiet spell), then runs with at most a
  quarter slice of batch sentences beside it.

Documents (``POST /v1/embed/document``) are batch-lane work of the same loop: each
waiting document's next round is computed in one batched step (``elmo_api.document_rounds``),
after queued interactive work and in turns with batch-lane takes.

A full lane raises :class:`QueueFull` at once (the route answers 429). Queues
are counted in sentences, the unit the model works in.

Admission control (:mod:`elmo_api.admission`): a request is refused at the door when the
work ahead of it would not let it finish inside its timeout.

An interactive model thread (``interactive_fn``, ``ELMO_INTERACTIVE_THREAD``): the
interactive lane gets a worker thread of its own with its own model instance over the
same weights (one intra-op thread: the batch lane's two keep the cores). An interactive
request then never waits behind batch work already computing -- it runs at once, beside
it, the two sharing the CPU for its few milliseconds -- so the batch lane needs no
slices, no top-up and no share: it runs full batches on the main thread, the whole
time. The batch lane's thread runs ``batch_nice`` nicer (and so the kernel threads it
starts): when both compute, the CPU goes to interactive work first. Admission counts, for
interactive work, its own lane only, with its own seconds-per-token estimate (lone
sentences cost more per token than full batches).

Batch fill without a fixed delay: requests announce themselves as they enter the embedding
path, and a batch about to start waits -- at most ``fill_ratio`` of the recent batch time,
never over ``max_fill_wait`` -- for the announced ones and for as many returning clients
as the last batch answered; an idle server never waits, and an interactive sentence ends
the wait. Without it, closed-loop clients alternate batches of 1 and N-1, or settle into
two half-size batches (docs/serving.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from elmo_api import tracing
from elmo_api.admission import (
    DEFAULT_FILL_WAIT_MS,
    DEFAULT_MAX_QUEUE,
    BatcherClosed,
    EmbedFn,
    Overloaded,
    QueueFull,
    Runner,
    Ticket,
    TokenLists,
    WorkEstimate,
    admit,
    token_cost,
)
from elmo_api.direct import DirectRunner
from elmo_api.document_rounds import DocumentRounds
from elmo_api.lanes import (
    BATCH,
    DEFAULT_BATCH_SHARE,
    DEFAULT_BATCH_SLICE_TOKENS,
    DEFAULT_INTERACTIVE_WINDOW,
    DEFAULT_TOPUP_TOKENS,
    INTERACTIVE,
    LANES,
    Lane,
    LaneShare,
    renice,
    start_lane_thread,
)
from elmo_api.lanes import QueuedSentence as _Item
from elmo_api.lanes import set_results as _set_results
from elmo_api.metrics import Metrics
from elmo_service.bilm.runner import (
    DEFAULT_BATCH_TOKENS,
    DEFAULT_MAX_BATCH_SENTENCES,
    BatchBudget,
    plan_batches,
)

log = logging.getLogger("elmo_api.batcher")

# re-exported: the runners' shared vocabulary lives in elmo_api.admission
__all__ = [
    "DEFAULT_FILL_WAIT_MS",
    "DEFAULT_MAX_QUEUE",
    "Batcher",
    "BatcherClosed",
    "DirectRunner",
    "EmbedFn",
    "Overloaded",
    "QueueFull",
    "Runner",
    "Ticket",
    "TokenLists",
    "WorkEstimate",
    "token_cost",
]


class Batcher:
    """The lanes and the one model thread of a served model (see the module docstring).

    # Parameters

    embed_fn : `EmbedFn`
        Runs one planned batch (``Embedder.embed_batch``): the batcher is the only
        planner on the serving path.
    batch_tokens : `int`, optional
        The padded-token budget of one batch (``len(batch) * longest``, markers included).
    max_batch_sentences : `int`, optional
        The most sentences in one batch.
    max_queue : `int`, optional
        Interactive sentences queued at most; beyond, :class:`QueueFull` (a 429).
    batch_max_queue : `int`, optional
        Batch-lane sentences queued at most (default ``max_queue``).
    slice_tokens : `int`, optional
        The padded-token budget of a batch-lane slice while interactive traffic is live:
        the bound on what an interactive request waits behind.
    batch_share : `float`, optional
        The batch lane's least share of the model while both lanes wait (:class:`LaneShare`).
    interactive_window : `float`, optional
        Seconds after an interactive request during which batch work runs in slices.
    topup_tokens : `int`, optional
        Padded tokens of batch work an interactive batch takes along (default 128, at most
        a slice).
    metrics : `Metrics`, optional
        Prometheus metrics to update (queue depth, batch sizes, refusals).
    take_batches : `int`, optional (default = `4`)
        How many batches' worth of tokens the worker takes from the queue at once
        (sorted by length together, so a take packs with little padding).
    max_fill_wait : `float`, optional
        Seconds a batch may wait at most for announced or returning requests.
    fill_ratio : `float`, optional (default = `0.25`)
        ... and at most this share of the recent batch duration.
    name : `str`, optional (default = `"batcher"`)
        The worker thread's name.
    estimate : `WorkEstimate`, optional
        Seconds per token for admission control (a fresh, slow prior when None).
    interactive_fn : `EmbedFn`, optional
        When given, the interactive lane runs on a thread of its own through this function
        (a second model instance over the same weights: it must be safe to call while
        ``embed_fn`` runs), and the main thread serves the batch lane alone.
    interactive_threads : `int`, optional (default = `1`)
        Intra-op (torch) threads of the interactive thread (None: leave torch's default).
    batch_nice : `int`, optional (default = `0`)
        With a thread per lane: the batch lane's thread (and the threads it starts: the
        kernel's direction workers, OpenMP's) runs this much nicer (Linux), so the CPU
        goes to the interactive thread and the event loop first when they need it.
    """

    def __init__(
        self,
        embed_fn: EmbedFn,
        *,
        batch_tokens: int = DEFAULT_BATCH_TOKENS,
        max_batch_sentences: int = DEFAULT_MAX_BATCH_SENTENCES,
        max_queue: int = DEFAULT_MAX_QUEUE,
        batch_max_queue: int | None = None,
        slice_tokens: int = DEFAULT_BATCH_SLICE_TOKENS,
        batch_share: float = DEFAULT_BATCH_SHARE,
        interactive_window: float = DEFAULT_INTERACTIVE_WINDOW,
        topup_tokens: int | None = None,
        metrics: Metrics | None = None,
        take_batches: int = 4,
        max_fill_wait: float = DEFAULT_FILL_WAIT_MS / 1000.0,
        fill_ratio: float = 0.25,
        name: str = "batcher",
        estimate: WorkEstimate | None = None,
        interactive_fn: EmbedFn | None = None,
        interactive_threads: int | None = 1,
        batch_nice: int = 0,
    ) -> None:
        self.embed_fn = embed_fn
        self.budget = BatchBudget(batch_tokens, max_batch_sentences)
        self.slice = BatchBudget(min(slice_tokens, batch_tokens), max_batch_sentences)
        # an interactive batch takes batch work along up to this many padded tokens: a little
        # (the default, 128) keeps the interactive request's own batch short -- what it waits
        # for is mostly that batch -- and recovers part of what its extra batch costs; a full
        # slice makes it a slice the batch lane would have run anyway (no extra batch: more
        # batch throughput, a slice's time on every interactive request; docs/serving.md)
        self.topup_tokens = min(
            self.slice.tokens, DEFAULT_TOPUP_TOKENS if topup_tokens is None else topup_tokens
        )
        self.max_queue = max_queue
        self.lane_max_queue = {
            INTERACTIVE: max_queue,
            BATCH: max_queue if batch_max_queue is None else batch_max_queue,
        }
        self.share = LaneShare(batch_share, floor=batch_tokens)
        self.interactive_window = interactive_window
        self.metrics = metrics
        self.take_batches = take_batches
        self.take_tokens = batch_tokens * take_batches
        self.max_fill_wait = max_fill_wait
        self.fill_ratio = fill_ratio
        self._batch_seconds = 0.0  # moving average of recent batch durations
        self.estimate = estimate or WorkEstimate()
        # tokens (with markers) queued or running, and of which queued, per lane: admission
        self._pending_cost = {lane: 0 for lane in LANES}
        self._queued_cost = {lane: 0 for lane in LANES}
        self._running_batch = 0  # batch-lane tokens in the model now
        self._last_interactive = -math.inf  # when an interactive request last arrived
        # since when each worker has been busy ("main"; "interactive" with its own thread)
        self._busy_mark = {"main": time.perf_counter(), "interactive": time.perf_counter()}
        self._incoming = 0  # announced requests not yet submitted
        self._returning = 0  # sentences answered by the last batch not yet matched by arrivals
        self._queues: dict[Lane, deque[_Item]] = {lane: deque() for lane in LANES}
        self._cond = threading.Condition()
        self._closed = False
        self.rounds = DocumentRounds(self._cond)  # documents' pass 1, batch-lane work
        self.batches_run = 0
        self.recent: deque[tuple[int, int, float]] = deque(
            maxlen=512
        )  # (sentences, announced, waited s)
        self.lanes_run: deque[tuple[int, int]] = deque(maxlen=512)  # (interactive, batch) sentences
        self._last_fill = (0, 0.0)
        self.sentences_run = 0
        self.dropped = 0
        self.interactive_fn = interactive_fn
        self.split = interactive_fn is not None
        self.batch_nice = batch_nice
        # the interactive lane's seconds per token: its own when it has its own thread
        self.interactive_estimate = WorkEstimate() if self.split else self.estimate
        self._thread = threading.Thread(target=self._worker, name=name, daemon=True)
        self._threads = [self._thread]
        if self.split:
            interactive = start_lane_thread(
                lambda: self._lane_worker(INTERACTIVE), f"{name}-interactive", interactive_threads
            )
            self._threads.append(interactive)
        self._thread.start()

    # -- request side (event loop) ---------------------------------------------
    quiet_for = 0.05

    @property
    def depth(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def lane_depth(self, lane: Lane) -> int:
        return len(self._queues[lane])

    @property
    def idle(self) -> bool:
        # a document between two rounds is back within a poll: a drain waits for it too
        return not self.depth and self._incoming == 0 and not self.rounds.active

    def announce(self) -> Ticket:
        """A request is on its way (see the module docstring); retire the ticket or submit with it."""
        with self._cond:
            self._incoming += 1
        return Ticket(self)

    def _retire(self, ticket: Ticket) -> None:
        with self._cond:
            if ticket.live:
                ticket.live = False
                self._incoming -= 1
                self._cond.notify_all()

    def _protect(self, lane: Lane, cost: int) -> float | None:
        """Seconds left before the earliest deadline that ``cost`` more tokens could push back.

        The worker sorts each take (up to ``take_tokens``) by length, so a request
        that joins the take the oldest queued request of its lane will run in can be
        run before it: admitting it must not make that request miss its deadline.
        Under the lock; queued requests share the request timeout, so the oldest live
        one has the earliest deadline. None when this request would start a later take.
        """
        if self._queued_cost[lane] + cost > self.take_tokens:
            return None
        now = time.perf_counter()
        for it in self._queues[lane]:
            if not it.future.done() and it.deadline > now:
                return it.deadline - now
        return None

    @property
    def pending_tokens(self) -> int:
        """Tokens (with sentence markers) queued or in the model now."""
        return sum(self._pending_cost.values())

    def _ahead(self, lane: Lane) -> int:
        """Tokens a request of ``lane`` waits for: interactive work waits for its own lane
        and the batch in the model now; batch work for everything."""
        if lane == INTERACTIVE:
            # with its own thread, interactive work waits for nothing of the batch lane's
            return self._pending_cost[INTERACTIVE] + (0 if self.split else self._running_batch)
        return self._pending_cost[BATCH] if self.split else self.pending_tokens

    def submit_nowait(
        self,
        token_lists: Sequence[Sequence[str]],
        ticket: Ticket | None = None,
        timeout: float | None = None,
        lane: Lane = INTERACTIVE,
        timing: Any = None,
    ) -> list[asyncio.Future]:
        """Queue sentences in ``lane``; one future per sentence. Raises QueueFull (Overloaded
        when the work ahead would not let them finish within ``timeout``) / BatcherClosed."""
        if lane not in LANES:
            raise ValueError(f"unknown lane {lane!r} (one of {', '.join(LANES)})")
        loop = asyncio.get_running_loop()
        trace = tracing.capture()
        items = [
            _Item(toks, loop.create_future(), loop, lane, timing, trace) for toks in token_lists
        ]
        if ticket is not None and ticket._batcher is not self:
            ticket.retire()  # announced to another batcher (the model was swapped meanwhile)
            ticket = None
        with self._cond:
            if ticket is not None and ticket.live:
                ticket.live = False
                self._incoming -= 1
            if self._closed:
                raise BatcherClosed("the model is shutting down")
            cost = sum(it.cost for it in items)
            queue = self._queues[lane]
            estimate = self.interactive_estimate if lane == INTERACTIVE else self.estimate
            admit(
                waiting=len(queue), sentences=len(items), max_queue=self.lane_max_queue[lane],
                estimate=estimate, pending_cost=self._ahead(lane), cost=cost,
                timeout=timeout, metrics=self.metrics,
                protect=lambda c: self._protect(lane, c), lane=lane,
            )  # fmt: skip
            now = time.perf_counter()
            if timeout is not None:
                deadline = now + estimate.headroom * timeout
                for it in items:
                    it.deadline = deadline
            if lane == INTERACTIVE:
                self._last_interactive = now
            if timing is not None:
                timing.submitted = now
            self._pending_cost[lane] += cost
            self._queued_cost[lane] += cost
            queue.extend(items)
            self._returning = max(0, self._returning - len(items))
            self._gauge()
            self._cond.notify_all()
        return [it.future for it in items]

    async def embed(
        self,
        token_lists: Sequence[Sequence[str]],
        timeout: float | None = None,
        ticket: Ticket | None = None,
        lane: Lane = INTERACTIVE,
        timing: Any = None,
    ) -> list[np.ndarray]:
        """Queue, wait, return ``[L+1, T, D]`` per sentence. On timeout or cancellation
        the sentences still queued are dropped before they reach the model."""
        if not token_lists:
            if ticket is not None:
                ticket.retire()
            return []
        futures = self.submit_nowait(token_lists, ticket, timeout, lane, timing)
        try:
            async with asyncio.timeout(timeout):
                out = list(await asyncio.gather(*futures))
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        if timing is not None:
            timing.close_runner()
        return out

    def forget_warm_up(self) -> None:
        """The warm-up's batches built kernel caches and compiled (12 ms/token measured for
        the first batch of a lane's kernel instance against ~0.2 in a flood): the estimates
        start from the prior again rather than refuse the first real work."""
        self.estimate.reset()
        self.interactive_estimate.reset()

    # -- lifecycle ------------------------------------------------------------------
    def close(self, timeout: float = 30.0, drain: bool = True) -> None:
        """Stop taking work; run (drain) or fail what is still queued; wait for the worker."""
        with self._cond:
            self._closed = True
            pending: list[_Item] = []
            if not drain:
                for lane, queue in self._queues.items():
                    gone = list(queue)
                    queue.clear()
                    self._pending_cost[lane] -= sum(it.cost for it in gone)
                    self._queued_cost[lane] -= sum(it.cost for it in gone)
                    pending += gone
                self.rounds.fail(self.rounds.closed_error())
                self._gauge()
            self._cond.notify_all()
        self._complete(pending, error=BatcherClosed("the model is shutting down"))
        end = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, end - time.monotonic()))

    @property
    def alive(self) -> bool:
        return all(t.is_alive() for t in self._threads) and not self._closed

    # -- worker thread -------------------------------------------------------------------
    def _gauge(self) -> None:
        if self.metrics:
            self.metrics.queue_depth.set(self.depth)
            for lane, queue in self._queues.items():
                self.metrics.lane_queue_depth.labels(lane).set(len(queue))

    def _pop(self, lane: Lane, tokens: int, taken: list[_Item]) -> int:
        """Move sentences of ``lane`` into ``taken``, oldest first, while their tokens fit
        (always at least one when ``taken`` is empty); returns the tokens moved."""
        queue, moved = self._queues[lane], 0
        while queue and (not taken or moved + queue[0].cost <= tokens):
            it = queue.popleft()
            moved += it.cost
            taken.append(it)
        self._queued_cost[lane] -= moved
        return moved

    def _top_up(self, taken: list[_Item]) -> None:
        """Fill an interactive batch with batch-lane sentences, oldest first, up to
        ``topup_tokens`` padded tokens (see ``__init__``)."""
        queue = self._queues[BATCH]
        n, longest, moved = len(taken), max(it.cost for it in taken), 0
        while queue and n < self.slice.sentences:
            cost = queue[0].cost
            if (n + 1) * max(longest, cost) > self.topup_tokens:
                break
            it = queue.popleft()
            taken.append(it)
            n, longest, moved = n + 1, max(longest, cost), moved + cost
        self._queued_cost[BATCH] -= moved

    def _take(self) -> tuple[list[_Item], BatchBudget, bool] | None:
        """The next take: its sentences, the budget to plan them under, and whether the
        worker may put its later batches back when interactive work arrives."""
        with self._cond:
            while not self.depth and not self.rounds.waiting and not self._closed:
                self._cond.wait()
            if not self.depth:
                if self._closed:  # closed and drained
                    self.rounds.fail(self.rounds.closed_error())
                    return None
                return [], self.budget, False  # a document's round: the worker's next pick
            self._busy_mark["main"] = time.perf_counter()  # work is waiting: busy from now
            lane = self._choose()
            if lane == BATCH or not self._queues[BATCH]:
                # interactive work on its own fills as before; batch work stops waiting
                # the moment an interactive sentence arrives
                self._fill(stop_on_interactive=lane == BATCH)
                lane = self._choose()
            taken: list[_Item] = []
            if lane == INTERACTIVE:
                mixed = bool(self._queues[BATCH])
                # beside waiting batch work, one batch at a time: the share is checked per batch
                self._pop(INTERACTIVE, self.budget.tokens if mixed else self.take_tokens, taken)
                if mixed and sum(it.cost for it in taken) < self.topup_tokens:
                    self._top_up(taken)
                budget, preemptible = self.budget, False
            else:
                live = time.perf_counter() - self._last_interactive < self.interactive_window
                budget = self.slice if live else self.budget
                # a few slices' worth, sorted together: they pack with little padding, and
                # what is left when interactive work arrives goes back (see _worker)
                self._pop(BATCH, budget.tokens * self.take_batches, taken)
                preemptible = True
            self._gauge()
            return taken, budget, preemptible

    def _choose(self) -> Lane:
        """Under the lock: the lane the next take serves (see LaneShare)."""
        interactive, batch = self._queues[INTERACTIVE], self._queues[BATCH]
        if interactive and (not batch or not self.share.batch_due()):
            return INTERACTIVE
        return BATCH if batch else INTERACTIVE

    def _fill(self, stop_on_interactive: bool = False) -> None:
        """Wait (bounded, under the lock) for announced or returning requests while the batch has room."""
        self._last_fill = (self._incoming + self._returning, 0.0)
        if not (self._incoming or self._returning):
            return
        wait = min(self.max_fill_wait, self.fill_ratio * self._batch_seconds)
        t0 = time.perf_counter()
        deadline = t0 + wait
        try:
            self._fill_wait(deadline, stop_on_interactive)
        finally:
            self._last_fill = (self._last_fill[0], time.perf_counter() - t0)

    def _fill_wait(self, deadline: float, stop_on_interactive: bool) -> None:
        while (self._incoming > 0 or self._returning > 0) and not self._closed:
            if stop_on_interactive and self._queues[INTERACTIVE]:
                return
            queued, depth = (
                (self._queued_cost[BATCH], len(self._queues[BATCH]))
                if self.split  # the interactive thread empties its lane by itself
                else (sum(self._queued_cost.values()), self.depth)
            )
            if queued >= self.budget.tokens or depth >= self.budget.sentences:
                return
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            self._cond.wait(left)

    def _finished(self, items: list[_Item]) -> None:
        """``items`` left the pending work (answered, failed or dropped)."""
        with self._cond:
            for it in items:
                self._pending_cost[it.lane] -= it.cost

    def _requeue(self, items: list[_Item]) -> None:
        """Batch-lane sentences taken but not run go back to the front of their queue."""
        with self._cond:
            self._queues[BATCH].extendleft(reversed(items))
            self._queued_cost[BATCH] += sum(it.cost for it in items)
            self._gauge()
            self._cond.notify_all()

    def _drop_cancelled(self, items: list[_Item]) -> list[_Item]:
        live = [it for it in items if not it.future.done()]
        n = len(items) - len(live)
        if n:
            self._finished([it for it in items if it.future.done()])
            self.dropped += n
            if self.metrics:
                self.metrics.dropped.labels("cancelled").inc(n)
        return live

    def plan(self, items: list[_Item], budget: BatchBudget | None = None) -> list[list[_Item]]:
        """Sort by length (longest first) and cut under the padded-token budget."""
        cut = plan_batches([it.cost for it in items], budget or self.budget)
        return [[items[i] for i in b] for b in cut]

    def _complete(
        self, items: list[_Item], values: list | None = None, error: BaseException | None = None
    ) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, object]]] = {}
        for i, it in enumerate(items):
            by_loop.setdefault(it.loop, []).append(
                (it.future, None if values is None else values[i])
            )
        for loop, pairs in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: its requests are gone
                loop.call_soon_threadsafe(_set_results, pairs, error)

    def _take_lane(self, lane: Lane) -> list[_Item] | None:
        """With a thread per lane: the next take of ``lane`` (None once closed and drained).
        The batch lane waits for arrivals to fill its batch; interactive work never does."""
        worker = "interactive" if lane == INTERACTIVE else "main"
        with self._cond:
            queue = self._queues[lane]
            rounds = self.rounds if lane == BATCH else None
            while not queue and not (rounds and rounds.waiting) and not self._closed:
                self._cond.wait()
            if not queue:
                if self._closed:
                    if rounds is not None:
                        rounds.fail(rounds.closed_error())
                    return None
                return []  # a document's round: the worker's next pick
            self._busy_mark[worker] = time.perf_counter()
            if lane == BATCH:
                self._fill()
            taken: list[_Item] = []
            self._pop(lane, self.take_tokens, taken)
            self._gauge()
            return taken

    def _lane_worker(self, lane: Lane) -> None:
        """With a thread per lane: run ``lane``'s takes in full batches until closed."""
        worker = "interactive" if lane == INTERACTIVE else "main"
        reniced = lane == INTERACTIVE or self.batch_nice <= 0
        while (taken := self._take_lane(lane)) is not None:
            if lane == BATCH:
                self._doc_rounds()
            for batch in self.plan(self._drop_cancelled(taken)):
                batch = self._drop_cancelled(batch)  # cancelled while earlier batches ran
                if batch:
                    self._run(batch, worker)
                if not reniced:
                    # the kernel's direction workers compute the batch: they inherit this
                    # thread's niceness when it starts them, but may have been started by
                    # another thread before (a previous model, a library call)
                    reniced = True
                    renice(
                        [t for t in threading.enumerate() if t.name.startswith("elmo-bilstm")],
                        self.batch_nice,
                    )

    def _worker(self) -> None:
        if self.split:
            if self.batch_nice > 0:
                renice([threading.current_thread()], self.batch_nice)
            self._lane_worker(BATCH)
            return
        while True:
            self._doc_rounds()
            got = self._take()
            if got is None:
                return
            taken, budget, preemptible = got
            batches = self.plan(self._drop_cancelled(taken), budget)
            for k, batch in enumerate(batches):
                batch = self._drop_cancelled(batch)  # cancelled while earlier batches ran
                if batch:
                    self._run(batch)
                rest = batches[k + 1 :]
                if preemptible and rest and self._queues[INTERACTIVE]:
                    # interactive work arrived: it goes next, the rest of this take after it
                    self._requeue([it for b in rest for it in b])
                    break

    def document_round(self, run, cancelled=lambda: False, timeout: float | None = None) -> None:
        """One round of a document's pass 1 on the model thread (``elmo_api.document_rounds``);
        blocks the calling (document) thread until it is done."""
        self.rounds.wait_round(run, cancelled, timeout, closed=lambda: self._closed)

    def _doc_rounds(self) -> None:
        """Run the documents' waiting rounds as one step when it is their turn: never before
        queued interactive work (unless it has a thread of its own), and alternating with
        batch-lane takes while batch sentences wait."""
        with self._cond:
            if not self.rounds.waiting or (self._queues[INTERACTIVE] and not self.split):
                return
            if self._queues[BATCH] and not self.rounds.turn:
                self.rounds.turn = True  # a batch take first, then the documents
                return
            self.rounds.turn = False
            # a step as long as a batch-lane batch: a slice while interactive traffic is live
            live = time.perf_counter() - self._last_interactive < self.interactive_window
            taken = self.rounds.take(
                (self.slice if live and not self.split else self.budget).tokens
            )
        self.rounds.run(taken)
        # admission's seconds per token count sentences' work, not the documents'
        self._busy_mark["main"] = time.perf_counter()

    def _run(self, batch: list[_Item], worker: str = "main") -> None:
        """One model call on the thread of ``worker`` (``interactive_fn`` on the interactive
        thread, else ``embed_fn``; read per call, so a test can wrap it)."""
        main = worker == "main"
        fn = self.embed_fn if main else self.interactive_fn
        assert fn is not None
        start = time.perf_counter()
        if main:
            self._running_batch = sum(it.cost for it in batch if it.lane == BATCH)
        if self.metrics:
            for it in batch:
                self.metrics.queue_seconds.observe(start - it.enqueued)
        try:
            with tracing.model_call(batch):
                out = fn([it.tokens for it in batch])
        except Exception as e:  # a model failure fails this batch's requests, not the worker
            log.exception("batch of %d sentences failed", len(batch))
            if main:
                self._running_batch = 0
            self._finished(batch)
            self._complete(batch, error=e)
            return
        end = time.perf_counter()
        took = end - start
        if main:
            self._running_batch = 0
        self._finished(batch)
        per_lane = {lane: 0 for lane in LANES}
        for it in batch:
            per_lane[it.lane] += it.cost
        with self._cond:  # two workers with a thread per lane: ids and counts under the lock
            batch_id = self.batches_run
            self.batches_run += 1
            self.sentences_run += len(batch)
            if main:  # the batch lane's fill (the interactive thread never waits to fill)
                self._returning = len(batch)
                self._batch_seconds = (
                    took if not self._batch_seconds else 0.8 * self._batch_seconds + 0.2 * took
                )
        for it in batch:
            if it.timing is not None:
                it.timing.add_batch(batch_id, took, end)
        if main:
            self.share.ran(per_lane)
            self.recent.append((len(batch), *self._last_fill))
        n_interactive = sum(it.lane == INTERACTIVE for it in batch)
        self.lanes_run.append((n_interactive, len(batch) - n_interactive))
        if self.metrics:
            m = self.metrics
            m.batch_seconds.observe(took)
            m.batch_sentences.observe(len(batch))
            m.batch_tokens.observe(len(batch) * max(it.cost for it in batch))
            m.tokens.inc(sum(len(it.tokens) for it in batch))
        # the estimate counts the worker's busy time, not only the model's: fill waits and
        # planning are part of what a queued request waits for (updated before the answers
        # go out, so whoever gets them sees the estimate that includes their batch)
        now = time.perf_counter()
        estimate = self.estimate if main else self.interactive_estimate
        estimate.observe(now - self._busy_mark[worker], sum(it.cost for it in batch))
        self._busy_mark[worker] = now
        if self.metrics and main:
            self.metrics.seconds_per_token.set(self.estimate.seconds_per_token)
        self._complete(batch, out)
