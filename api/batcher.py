"""Micro-batching: the server's only model callers, one policy over two priority lanes.

Requests ``submit`` token lists and await a future per sentence. A model thread wakes as soon
as anything is queued and it is free (no fixed batch delay: what queued while the last batch
ran forms the next, as in TEI); a take is sorted by length and cut under the token budget
(``plan_batches``, the library's planner); sentences whose future is done (client gone, timed
out) are dropped before the model. Each lane has a queue, a bound and admission
(:class:`elmo_api.lanes.LaneQueue`); documents' rounds are batch-lane work
(:mod:`elmo_api.document_rounds`), in turns with batch-lane takes.

:meth:`Batcher._pick` decides what each model thread runs next: **the main thread** (every
intra-op thread, ``batch_nice`` nicer) batch work first, interactive work when none waits;
**the express thread** (CPU: a second kernel instance, one intra-op thread) interactive work
while the main thread is on batch work; **without it** (GPU, ``ELMO_INTERACTIVE_THREAD=false``)
the main thread interactive work first, giving batch work ``batch_share``. A batch about to
start waits (bounded) for announced requests and returning clients, or closed-loop clients
alternate batches of 1 and N-1. docs/serving.md has the policy and its figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from elmo_api import tracing
from elmo_api.admission import (
    DEFAULT_FILL_WAIT_MS,
    DEFAULT_MAX_QUEUE,
    BatcherClosed,
    Ticket,
    WorkEstimate,
)
from elmo_api.document_rounds import DocumentRounds
from elmo_api.lanes import (
    BATCH,
    DEFAULT_BATCH_SHARE,
    INTERACTIVE,
    LANES,
    Lane,
    LaneQueue,
    LaneShare,
)
from elmo_api.lanes import QueuedSentence as _Item
from elmo_api.metrics import Metrics
from elmo_service.bilm.runner import (
    DEFAULT_BATCH_TOKENS,
    DEFAULT_MAX_BATCH_SENTENCES,
    BatchBudget,
    plan_batches,
)
from elmo_service.runtime import renice, start_thread

log = logging.getLogger("elmo_api.batcher")

EmbedFn = Callable[[Sequence[Sequence[str]]], list[np.ndarray]]  # one planned batch
MAIN, EXPRESS = "main", "express"  # the model threads
ROUNDS = "rounds"  # what the main thread may pick besides a lane: the documents' rounds
CALL = "call"  # a run_on_each call
# with the express thread: how long after batch work the main thread still counts as on it
BATCH_QUIET_S = 0.25


class _Worker:
    """A model thread: its ``run_on_each`` calls, what it computes (a lane, ROUNDS or None),
    since when it has been busy (admission's seconds per token count that time)."""

    __slots__ = ("busy_since", "calls", "computing")

    def __init__(self) -> None:
        self.calls: deque[tuple[Callable[[EmbedFn], Any], Future]] = deque()
        self.computing: str | None = None
        self.busy_since = time.perf_counter()


class Batcher:
    """The lanes and the model threads of a served model (see the module docstring).

    ``embed_fn`` runs one planned batch (``Embedder.run_batch``) on the main thread;
    ``interactive_fn``, when given, on the express thread (a second model instance over the
    same weights; both read per call: a test can wrap them). ``batch_tokens`` (padded, markers
    included) and ``max_batch_sentences`` bound a batch, ``take_batches`` batches a take;
    ``max_queue`` / ``batch_max_queue`` bound each lane; ``estimate``: the main thread's
    seconds per token; ``batch_quiet``: seconds after batch work during which the main
    thread still counts as on it.
    """

    quiet_for = 0.05  # idle this long before a drain may close the batcher

    def __init__(
        self,
        embed_fn: EmbedFn,
        *,
        batch_tokens: int = DEFAULT_BATCH_TOKENS,
        max_batch_sentences: int = DEFAULT_MAX_BATCH_SENTENCES,
        max_queue: int = DEFAULT_MAX_QUEUE,
        batch_max_queue: int | None = None,
        batch_share: float = DEFAULT_BATCH_SHARE,
        metrics: Metrics | None = None,
        take_batches: int = 4,
        max_fill_wait: float = DEFAULT_FILL_WAIT_MS / 1000.0,
        fill_ratio: float = 0.25,
        name: str = "batcher",
        estimate: WorkEstimate | None = None,
        interactive_fn: EmbedFn | None = None,
        batch_nice: int = 0,
        batch_quiet: float = BATCH_QUIET_S,
    ) -> None:
        self.embed_fn, self.interactive_fn = embed_fn, interactive_fn
        self.express = interactive_fn is not None
        self.budget = BatchBudget(batch_tokens, max_batch_sentences)
        self.take_tokens = batch_tokens * take_batches
        batch_max_queue = max_queue if batch_max_queue is None else batch_max_queue
        self.lanes = {
            INTERACTIVE: LaneQueue(INTERACTIVE, max_queue),
            BATCH: LaneQueue(BATCH, batch_max_queue),
        }
        self.share = LaneShare(batch_share, floor=batch_tokens)
        self.metrics = metrics
        self.max_fill_wait, self.fill_ratio = max_fill_wait, fill_ratio
        self.batch_nice, self.batch_quiet = batch_nice, batch_quiet
        self.estimate = estimate or WorkEstimate()
        # the express thread's seconds per token: lone sentences cost more per token
        self.interactive_estimate = WorkEstimate() if self.express else self.estimate
        self._workers = {MAIN: _Worker(), EXPRESS: _Worker()}
        self._running_batch = 0  # batch-lane tokens in the model now
        self._last_batch = -float("inf")  # when batch work last arrived or ran
        self._batch_seconds = 0.0  # moving average of the main thread's batch durations
        self._incoming = 0  # announced requests not yet submitted
        self._returning = 0  # sentences answered by the last batch not yet matched by arrivals
        self._last_fill = (0, 0.0)  # (requests the last fill waited for, its seconds)
        self._cond = threading.Condition()
        self._closed = False
        self.rounds = DocumentRounds(self._cond)  # documents' pass 1, batch-lane work
        self.batches_run = self.sentences_run = self.dropped = 0
        self.recent: deque[tuple[int, int, float]] = deque(maxlen=512)  # (n, announced, waited)
        self._threads = [threading.Thread(target=self._work, args=(MAIN,), name=name, daemon=True)]
        if self.express:  # one intra-op thread: beside the main thread's, within the cores
            self._threads.append(
                start_thread(lambda: self._work(EXPRESS), f"{name}-interactive", 1)
            )
        self._threads[0].start()

    # -- request side (event loop) ---------------------------------------------
    @property
    def depth(self) -> int:
        return sum(len(q) for q in self.lanes.values())

    def lane_depth(self, lane: Lane) -> int:
        return len(self.lanes[lane])

    @property
    def idle(self) -> bool:
        # a document between two rounds is back within a poll: a drain waits for it too
        return not self.depth and self._incoming == 0 and not self.rounds.active

    @property
    def pending_tokens(self) -> int:
        """Tokens (with sentence markers) queued or in the model now."""
        return sum(q.pending for q in self.lanes.values())

    def announce(self) -> Ticket:
        """A request is on its way (the fill waits for it); retire the ticket or submit with it."""
        with self._cond:
            self._incoming += 1
        return Ticket(self)

    def retire(self, ticket: Ticket) -> None:
        """An announced request will not submit (refused, answered from the cache, gone)."""
        with self._cond:
            if ticket.live:
                ticket.live = False
                self._incoming -= 1
                self._cond.notify_all()

    def _main_on_batch(self) -> bool:
        """Under the lock: the main thread is on batch work: computing it, with some waiting,
        or within ``batch_quiet`` of the last (closed-loop batch clients and documents come
        back within it: an interactive request meanwhile must neither wait for the main
        thread nor run there beside their next batch)."""
        return (
            self._workers[MAIN].computing in (BATCH, ROUNDS)
            or bool(self.lanes[BATCH])
            or self.rounds.active > 0
            or time.perf_counter() - self._last_batch < self.batch_quiet
        )

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
        loop, trace = asyncio.get_running_loop(), tracing.capture()
        items = [_Item(t, loop.create_future(), loop, lane, timing, trace) for t in token_lists]
        if ticket is not None and ticket.runner is not self:
            ticket.retire()  # announced to another batcher (the model was swapped meanwhile)
            ticket = None
        with self._cond:
            if ticket is not None and ticket.live:
                ticket.live = False
                self._incoming -= 1
            if self._closed:
                raise BatcherClosed("the model is shutting down")
            queue = self.lanes[lane]
            express = lane == INTERACTIVE and self.express and self._main_on_batch()
            estimate = self.interactive_estimate if express else self.estimate
            # what this request waits for: the express thread runs nothing of the batch lane
            if lane == BATCH:
                ahead = self.pending_tokens
            else:
                ahead = queue.pending + (0 if express else self._running_batch)
            queue.admit(items, ahead, estimate, timeout, self.take_tokens, self.metrics)
            now = time.perf_counter()
            if timeout is not None:
                for it in items:
                    it.deadline = now + estimate.headroom * timeout
            if timing is not None:
                timing.submitted = now
            if lane == BATCH:
                self._last_batch = now
            queue.push(items)
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

    def run_on_each(self, call: Callable[[EmbedFn], Any]) -> list[Future]:
        """Run ``call(model_fn)`` once on each model thread with its own model function,
        before any queued work (the warm-up: the express thread's kernel instance is warmed
        on its thread, though no request would reach it without batch work)."""
        futures = []
        with self._cond:
            for worker in (MAIN, EXPRESS) if self.express else (MAIN,):
                futures.append(Future())
                self._workers[worker].calls.append((call, futures[-1]))
            self._cond.notify_all()
        return futures

    def forget_warm_up(self) -> None:
        """The warm-up's batches built kernel caches and compiled (docs/serving.md): the
        estimates start from the prior again rather than refuse the first real work."""
        self.estimate.reset()
        self.interactive_estimate.reset()

    # -- the policy (under the lock) ----------------------------------------------------
    def _pick(self, worker: str) -> str | None:
        """What ``worker`` runs next: a lane, ``ROUNDS``, or None (nothing for it now)."""
        interactive, batch, rounds = self.lanes[INTERACTIVE], self.lanes[BATCH], self.rounds
        if worker == EXPRESS:
            return INTERACTIVE if interactive and self._main_on_batch() else None
        if self.express:
            if interactive and not self._main_on_batch():
                return INTERACTIVE
        elif interactive and not (batch and self.share.batch_due()):
            return INTERACTIVE
        if rounds.waiting and (not batch or rounds.turn):
            return ROUNDS  # documents and batch takes take turns
        return BATCH if batch else None

    def _take(self, worker: str) -> tuple[str, Any] | None:
        """Wait for ``worker``'s next work and take it: (what, items), or (CALL, a call). None
        once closed (the main thread first drains what is queued)."""
        w = self._workers[worker]
        with self._cond:
            while True:
                if w.calls:
                    return CALL, w.calls.popleft()
                while (what := self._pick(worker)) is None and not w.calls:
                    if self._closed and (worker == EXPRESS or not self.depth):
                        if worker == MAIN:
                            self.rounds.fail(self.rounds.closed_error())
                        return None
                    # interactive work the main thread leaves to the express thread for now
                    # becomes its own once batch work has been quiet for batch_quiet
                    self._cond.wait(self.batch_quiet if self.lanes[INTERACTIVE] else None)
                if what is None:
                    continue  # a call came
                w.busy_since = time.perf_counter()  # work waits: busy from now
                if what == ROUNDS:
                    self.rounds.fill(self.max_fill_wait)
                    break
                if worker == EXPRESS:
                    break
                # the fill may bring interactive work, or hand the queue to the express thread;
                # while it waits for batch work the main thread counts as on it
                w.computing = what
                self._fill(stop_on_interactive=what == BATCH and not self.express)
                w.computing = None
                if (what := self._pick(worker)) is not None:
                    break
            if what == ROUNDS:  # a batch's rows and tokens (8 documents of the route's rounds)
                taken = self.rounds.take(self.budget.sentences, self.budget.tokens)
            else:
                taken = self.lanes[what].pop(self.take_tokens)
            if what in (BATCH, ROUNDS):
                self.rounds.turn = what == BATCH
            w.computing = what
            self._gauge()
            self._cond.notify_all()  # the express thread looks again
            return what, taken

    def _fill(self, stop_on_interactive: bool) -> None:
        """Wait (bounded) for announced or returning requests while the batch has room."""
        self._last_fill = (self._incoming + self._returning, 0.0)
        if not self._last_fill[0]:
            return
        t0 = time.perf_counter()
        deadline = t0 + min(self.max_fill_wait, self.fill_ratio * self._batch_seconds)
        while (self._incoming > 0 or self._returning > 0) and not self._closed:
            if stop_on_interactive and self.lanes[INTERACTIVE]:
                break
            queued = sum(q.queued for q in self.lanes.values())
            if queued >= self.budget.tokens or self.depth >= self.budget.sentences:
                break
            if (left := deadline - time.perf_counter()) <= 0:
                break
            self._cond.wait(left)
        self._last_fill = (self._last_fill[0], time.perf_counter() - t0)

    def _gauge(self) -> None:
        if self.metrics:
            self.metrics.queue_depth.set(self.depth)
            for lane, queue in self.lanes.items():
                self.metrics.lane_queue_depth.labels(lane).set(len(queue))

    # -- the model threads ---------------------------------------------------------------
    def _work(self, worker: str) -> None:
        w = self._workers[worker]
        nice = self.batch_nice if worker == MAIN and self.express else 0
        if nice > 0:
            renice([threading.current_thread()], nice)
        while (got := self._take(worker)) is not None:
            what, taken = got
            if what == CALL:
                call, fut = taken
                try:
                    fut.set_result(call(self.embed_fn if worker == MAIN else self.interactive_fn))
                except Exception as e:  # noqa: BLE001 - the caller gets it
                    fut.set_exception(e)
                continue
            try:
                if what == ROUNDS:
                    self.rounds.run(taken)
                    # admission's seconds per token count sentences' work, not the documents'
                    w.busy_since = time.perf_counter()
                else:
                    self._run_take(worker, what, taken)
            finally:
                with self._cond:
                    if w.computing in (BATCH, ROUNDS):
                        self._last_batch = time.perf_counter()
                    w.computing = None
                    self._cond.notify_all()
            if nice > 0:
                # the kernel's direction workers inherit this thread's niceness when it
                # starts them, but another thread may have started them (a library call)
                renice([t for t in threading.enumerate() if t.name.startswith("elmo-bilstm")], nice)
                nice = 0

    def _run_take(self, worker: str, lane: str, taken: list[_Item]) -> None:
        """A take, sorted by length and cut under the budget; without the express thread,
        queued interactive work goes before the rest of a batch take (back in front)."""
        taken = self._drop_cancelled(taken)
        batches = [
            [taken[i] for i in b] for b in plan_batches([it.cost for it in taken], self.budget)
        ]
        for k, batch in enumerate(batches):
            batch = self._drop_cancelled(batch)  # cancelled while earlier batches ran
            if batch:
                self._run(batch, worker)
            if lane == BATCH and k + 1 < len(batches) and not self.express:
                with self._cond:
                    if self.lanes[INTERACTIVE]:
                        self.lanes[BATCH].push(
                            [it for b in batches[k + 1 :] for it in b], front=True
                        )
                        self._gauge()
                        self._cond.notify_all()
                        return

    def _finished(self, items: list[_Item]) -> None:
        """``items`` left the pending work (answered, failed or dropped)."""
        with self._cond:
            for it in items:
                self.lanes[it.lane].pending -= it.cost

    def _drop_cancelled(self, items: list[_Item]) -> list[_Item]:
        live = [it for it in items if not it.future.done()]
        if len(live) < len(items):
            self._finished([it for it in items if it.future.done()])
            self.dropped += len(items) - len(live)
            if self.metrics:
                self.metrics.dropped.labels("cancelled").inc(len(items) - len(live))
        return live

    @staticmethod
    def _complete(
        items: list[_Item], values: list | None = None, error: BaseException | None = None
    ) -> None:
        """The answers (or the error) go back to the requests' event loops."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, object]]] = {}
        for i, it in enumerate(items):
            by_loop.setdefault(it.loop, []).append(
                (it.future, None if values is None else values[i])
            )
        for loop, pairs in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: its requests are gone
                loop.call_soon_threadsafe(_set_results, pairs, error)

    def _run(self, batch: list[_Item], worker: str = MAIN) -> None:
        """One model call on ``worker``'s thread, and its bookkeeping."""
        main = worker == MAIN
        fn = self.embed_fn if main else self.interactive_fn
        assert fn is not None
        per_lane = {lane: sum(it.cost for it in batch if it.lane == lane) for lane in LANES}
        start = time.perf_counter()
        if main:
            self._running_batch = per_lane[BATCH]
        try:
            with tracing.model_call(batch):
                out, error = fn([it.tokens for it in batch]), None
        except Exception as e:  # a model failure fails this batch's requests, not the thread
            log.exception("batch of %d sentences failed", len(batch))
            out, error = None, e
        end = time.perf_counter()
        took = end - start
        if main:
            self._running_batch = 0
        self._finished(batch)
        if error is not None:
            self._complete(batch, error=error)
            return
        with self._cond:  # two threads: ids and counts under the lock
            batch_id = self.batches_run
            self.batches_run += 1
            self.sentences_run += len(batch)
            if main:  # the fill's inputs (the express thread never waits to fill)
                self._returning = len(batch)
                self._batch_seconds = (
                    0.8 * self._batch_seconds + 0.2 * took if self._batch_seconds else took
                )
                self.share.ran(per_lane)
                self.recent.append((len(batch), *self._last_fill))
        for it in batch:
            if it.timing is not None:
                it.timing.add_batch(batch_id, took, end)
        if self.metrics:
            self.metrics.observe_batch(start, took, batch)
        # the estimate counts the thread's busy time, fill waits and planning included (before
        # the answers go out, so whoever gets them sees the estimate with their batch)
        w, now = self._workers[worker], time.perf_counter()
        estimate = self.estimate if main else self.interactive_estimate
        estimate.observe(now - w.busy_since, per_lane[INTERACTIVE] + per_lane[BATCH])
        w.busy_since = now
        if self.metrics and main:
            self.metrics.seconds_per_token.set(self.estimate.seconds_per_token)
        self._complete(batch, out)

    # -- lifecycle ------------------------------------------------------------------
    def close(self, timeout: float = 30.0, drain: bool = True) -> None:
        """Stop taking work; run (drain) or fail what is still queued; wait for the threads."""
        with self._cond:
            self._closed = self.rounds.closed = True
            pending = [] if drain else [it for q in self.lanes.values() for it in q.clear()]
            if not drain:
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


def _set_results(
    pairs: Iterable[tuple[asyncio.Future, object]], error: BaseException | None = None
) -> None:
    """On the event loop: complete the futures that nobody cancelled meanwhile."""
    for fut, value in pairs:
        if not fut.done():
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(value)
