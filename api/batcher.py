"""Micro-batching: one bounded queue, one worker thread, the only model caller.

Requests ``submit`` token lists (already tokenized in the request path) and
await one future per sentence. The worker thread:

* wakes as soon as anything is queued and the model is idle -- there is no
  fixed batch delay: whatever queued up while the previous batch ran forms
  the next one (as TEI's next batch forms while the current one runs);
* takes pending sentences FIFO up to a few batches' worth of padded tokens,
  drops those whose future is already done (client gone, timed out), sorts
  the rest by length and cuts them into batches under the token budget
  (``elmo_service.batching.plan_batches``, the planner the library uses too);
* runs each batch as one ``Embedder.embed_batch`` call, which does not plan
  again, and hands results back to the event loop; sentences cancelled while
  earlier batches ran are dropped too.

A full queue raises :class:`QueueFull` at once (the route answers 429). The
queue is counted in sentences, the unit the model works in.

Admission control: a request is also refused at the door (:class:`Overloaded`,
429 with ``Retry-After``) when the work already waiting -- queued and running
tokens x the measured seconds per token -- plus its own would not finish inside
its timeout (within 80% of it: headroom for the estimate's error). Admitting it
would only make it wait and then fail with 503 after the timeout, while taking
model time from requests that can still make it.
Seconds per token is a token-weighted moving average over real batches
(:class:`WorkEstimate`), starting from a deliberately slow prior. Since each
take is sorted by length, a later request can run before an earlier one of the
same take, so a request is also refused when it would push the oldest queued
request of its take past that request's deadline. A request with nothing ahead
of it is always admitted: waiting cannot help it.

Batch fill without a fixed delay: a request *announces* itself when it
enters the embedding path (before its cache lookup) and the announcement is
retired when it submits or needs no model. When the worker is about to start
a batch while announced requests are still on their way (parsed, being
looked up), it waits for them -- at most ``fill_ratio`` of the recent batch
duration and never more than ``max_fill_wait`` -- and starts at once when
they have arrived or when nothing is announced (an idle server never waits).
Without this, closed-loop clients alternate batches of 1 and of N-1.

Returning clients count as on their way too: the sentences a batch just
answered belong to clients that typically send their next request within a
few milliseconds. So after a batch of k sentences the next batch also waits
(same bound) until k sentences have arrived since that batch finished.
Without this, 16 closed-loop clients settle into two alternating batches of
8, each half the size it could be. A lone client never waits: its next
request is the one arrival expected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from api.metrics import Metrics
from elmo_service.batching import (
    DEFAULT_BATCH_TOKENS,
    DEFAULT_MAX_BATCH_SENTENCES,
    BatchBudget,
    plan_batches,
)

log = logging.getLogger("api.batcher")

TokenLists = Sequence[Sequence[str]]  # sentences as token texts
EmbedFn = Callable[[TokenLists], list[np.ndarray]]


class Runner(Protocol):
    """How a served model's calls reach it: :class:`Batcher`, or :class:`DirectRunner`."""

    # how long a runner must stay idle before a drain may close it (a DirectRunner sees
    # a request only once it calls the model, so it needs a longer quiet spell)
    quiet_for: float

    @property
    def depth(self) -> int:
        """Requests queued or running."""

    @property
    def idle(self) -> bool:
        """No request on its way: none announced, queued or running."""

    @property
    def alive(self) -> bool:
        """Still taking work."""

    def announce(self) -> Ticket:
        """A request is on its way (the AnnounceMiddleware calls this on arrival)."""

    async def embed(
        self, token_lists: TokenLists, timeout: float | None = None, ticket: Ticket | None = None
    ) -> list[np.ndarray]:
        """``[L+1, T, D]`` float32 per sentence, in order."""

    def close(self, timeout: float = ...) -> None:
        """Stop taking work and wait for what runs."""


# the server's defaults (api/settings.py reads these; the budget's are elmo_service's)
DEFAULT_FILL_WAIT_MS = 10.0
DEFAULT_MAX_QUEUE = 4096


class Ticket:
    """An announced request; ``retire`` is idempotent."""

    __slots__ = ("_batcher", "live")

    def __init__(self, batcher: Batcher | None) -> None:
        self._batcher = batcher
        self.live = batcher is not None

    def retire(self) -> None:
        if self.live and self._batcher is not None:
            self._batcher._retire(self)


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


def admit(
    *,
    waiting: int,
    sentences: int,
    max_queue: int,
    estimate: WorkEstimate,
    pending_cost: int,
    cost: int,
    timeout: float | None,
    metrics: Metrics | None,
    protect: Callable[[int], float | None] | None = None,
) -> None:
    """Both runners' admission: raise QueueFull when ``sentences`` more would pass
    ``max_queue`` waiting, Overloaded when the queued work (``pending_cost`` tokens) and
    this request's ``cost`` would not finish in time (:meth:`WorkEstimate.check`; ``protect``
    gives the earliest deadline this request could push back). Each refusal is counted."""
    if waiting + sentences > max_queue:
        if metrics:
            metrics.rejected.labels("queue_full").inc()
        raise QueueFull(f"queue full: {waiting} sentences waiting, limit {max_queue}")
    try:
        estimate.check(pending_cost, cost, timeout, protect(cost) if protect else None)
    except Overloaded:
        if metrics:
            metrics.rejected.labels("overloaded").inc()
        raise


class BatcherClosed(Exception):
    """The batcher was stopped (shutdown or model swap) before the work ran."""


@dataclass(eq=False)
class _Item:
    tokens: Sequence[str]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    enqueued: float = field(default_factory=time.perf_counter)
    deadline: float = math.inf  # by when admission promised it an answer (perf_counter)

    @property
    def cost(self) -> int:
        return token_cost(self.tokens)


def _set_results(
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


class Batcher:
    """The queue and the one model thread of a served model (see the module docstring).

    # Parameters

    embed_fn : `EmbedFn`
        Runs one planned batch (``Embedder.embed_batch``): the batcher is the only
        planner on the serving path.
    batch_tokens : `int`, optional
        The padded-token budget of one batch (``len(batch) * longest``, markers included).
    max_batch_sentences : `int`, optional
        The most sentences in one batch.
    max_queue : `int`, optional
        Sentences queued at most; beyond, :class:`QueueFull` (a 429).
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
    """

    def __init__(
        self,
        embed_fn: EmbedFn,
        *,
        batch_tokens: int = DEFAULT_BATCH_TOKENS,
        max_batch_sentences: int = DEFAULT_MAX_BATCH_SENTENCES,
        max_queue: int = DEFAULT_MAX_QUEUE,
        metrics: Metrics | None = None,
        take_batches: int = 4,
        max_fill_wait: float = DEFAULT_FILL_WAIT_MS / 1000.0,
        fill_ratio: float = 0.25,
        name: str = "batcher",
        estimate: WorkEstimate | None = None,
    ) -> None:
        self.embed_fn = embed_fn
        self.budget = BatchBudget(batch_tokens, max_batch_sentences)
        self.max_queue = max_queue
        self.metrics = metrics
        self.take_tokens = batch_tokens * take_batches
        self.max_fill_wait = max_fill_wait
        self.fill_ratio = fill_ratio
        self._batch_seconds = 0.0  # moving average of recent batch durations
        self.estimate = estimate or WorkEstimate()
        self._pending_cost = 0  # tokens (with markers) queued or running: admission control
        self._queued_cost = 0  # of which queued, not yet taken by the worker
        self._busy_mark = time.perf_counter()  # since when the worker has been busy
        self._incoming = 0  # announced requests not yet submitted
        self._returning = 0  # sentences answered by the last batch not yet matched by arrivals
        self._queue: deque[_Item] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._busy = False
        self.batches_run = 0
        self.recent: deque[tuple[int, int, float]] = deque(
            maxlen=512
        )  # (sentences, announced, waited s)
        self._last_fill = (0, 0.0)
        self.sentences_run = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._worker, name=name, daemon=True)
        self._thread.start()

    # -- request side (event loop) ---------------------------------------------
    quiet_for = 0.05

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def idle(self) -> bool:
        return not self._queue and self._incoming == 0

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
                self._cond.notify()

    def _protect(self, cost: int) -> float | None:
        """Seconds left before the earliest deadline that ``cost`` more tokens could push back.

        The worker sorts each take (up to ``take_tokens``) by length, so a request
        that joins the take the oldest queued request will run in can be run before
        it: admitting it must not make that request miss its deadline. Under the
        lock; queued requests share the request timeout, so the oldest live one has
        the earliest deadline. None when this request would start a later take.
        """
        if self._queued_cost + cost > self.take_tokens:
            return None
        now = time.perf_counter()
        for it in self._queue:
            if not it.future.done() and it.deadline > now:
                return it.deadline - now
        return None

    @property
    def pending_tokens(self) -> int:
        """Tokens (with sentence markers) queued or in the model now."""
        return self._pending_cost

    def submit_nowait(
        self,
        token_lists: Sequence[Sequence[str]],
        ticket: Ticket | None = None,
        timeout: float | None = None,
    ) -> list[asyncio.Future]:
        """Queue sentences; one future per sentence. Raises QueueFull (Overloaded when the
        queued work would not let them finish within ``timeout``) / BatcherClosed at once."""
        loop = asyncio.get_running_loop()
        items = [_Item(toks, loop.create_future(), loop) for toks in token_lists]
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
            admit(
                waiting=len(self._queue), sentences=len(items), max_queue=self.max_queue,
                estimate=self.estimate, pending_cost=self._pending_cost, cost=cost,
                timeout=timeout, metrics=self.metrics, protect=self._protect,
            )  # fmt: skip
            if timeout is not None:
                deadline = time.perf_counter() + self.estimate.headroom * timeout
                for it in items:
                    it.deadline = deadline
            self._pending_cost += cost
            self._queued_cost += cost
            self._queue.extend(items)
            self._returning = max(0, self._returning - len(items))
            self._gauge()
            self._cond.notify()
        return [it.future for it in items]

    async def embed(
        self,
        token_lists: Sequence[Sequence[str]],
        timeout: float | None = None,
        ticket: Ticket | None = None,
    ) -> list[np.ndarray]:
        """Queue, wait, return ``[L+1, T, D]`` per sentence. On timeout or cancellation
        the sentences still queued are dropped before they reach the model."""
        if not token_lists:
            if ticket is not None:
                ticket.retire()
            return []
        futures = self.submit_nowait(token_lists, ticket, timeout)
        try:
            async with asyncio.timeout(timeout):
                return list(await asyncio.gather(*futures))
        except BaseException:
            for f in futures:
                f.cancel()
            raise

    # -- lifecycle ------------------------------------------------------------------
    def close(self, timeout: float = 30.0, drain: bool = True) -> None:
        """Stop taking work; run (drain) or fail what is still queued; wait for the worker."""
        with self._cond:
            self._closed = True
            pending: list[_Item] = []
            if not drain:
                pending = list(self._queue)
                self._queue.clear()
                self._pending_cost -= sum(it.cost for it in pending)
                self._queued_cost -= sum(it.cost for it in pending)
                self._gauge()
            self._cond.notify_all()
        self._complete(pending, error=BatcherClosed("the model is shutting down"))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    # -- worker thread -------------------------------------------------------------------
    def _gauge(self) -> None:
        if self.metrics:
            self.metrics.queue_depth.set(len(self._queue))

    def _take(self) -> list[_Item] | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if not self._queue:  # closed and drained
                return None
            self._busy_mark = time.perf_counter()  # work is waiting: the worker is busy from now
            self._fill()
            taken: list[_Item] = []
            budget = self.take_tokens
            while self._queue and (not taken or self._queue[0].cost <= budget):
                it = self._queue.popleft()
                budget -= it.cost
                taken.append(it)
            self._queued_cost -= sum(it.cost for it in taken)
            self._gauge()
            return taken

    def _fill(self) -> None:
        """Wait (bounded, under the lock) for announced or returning requests while the batch has room."""
        self._last_fill = (self._incoming + self._returning, 0.0)
        if not (self._incoming or self._returning):
            return
        wait = min(self.max_fill_wait, self.fill_ratio * self._batch_seconds)
        t0 = time.perf_counter()
        deadline = t0 + wait
        try:
            self._fill_wait(deadline)
        finally:
            self._last_fill = (self._last_fill[0], time.perf_counter() - t0)

    def _fill_wait(self, deadline: float) -> None:
        while (self._incoming > 0 or self._returning > 0) and not self._closed:
            if (
                sum(it.cost for it in self._queue) >= self.budget.tokens
                or len(self._queue) >= self.budget.sentences
            ):
                return
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            self._cond.wait(left)

    def _finished(self, items: list[_Item]) -> None:
        """``items`` left the pending work (answered, failed or dropped)."""
        with self._cond:
            self._pending_cost -= sum(it.cost for it in items)

    def _drop_cancelled(self, items: list[_Item]) -> list[_Item]:
        live = [it for it in items if not it.future.done()]
        n = len(items) - len(live)
        if n:
            self._finished([it for it in items if it.future.done()])
            self.dropped += n
            if self.metrics:
                self.metrics.dropped.labels("cancelled").inc(n)
        return live

    def plan(self, items: list[_Item]) -> list[list[_Item]]:
        """Sort by length (longest first) and cut under the padded-token budget."""
        return [[items[i] for i in b] for b in plan_batches([it.cost for it in items], self.budget)]

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

    def _worker(self) -> None:
        while True:
            taken = self._take()
            if taken is None:
                return
            for batch in self.plan(self._drop_cancelled(taken)):
                batch = self._drop_cancelled(batch)  # cancelled while earlier batches ran
                if not batch:
                    continue
                self._run(batch)

    def _run(self, batch: list[_Item]) -> None:
        start = time.perf_counter()
        if self.metrics:
            for it in batch:
                self.metrics.queue_seconds.observe(start - it.enqueued)
        try:
            out = self.embed_fn([it.tokens for it in batch])
        except Exception as e:  # a model failure fails this batch's requests, not the worker
            log.exception("batch of %d sentences failed", len(batch))
            self._finished(batch)
            self._complete(batch, error=e)
            return
        took = time.perf_counter() - start
        self._finished(batch)
        self._batch_seconds = (
            took if not self.batches_run else 0.8 * self._batch_seconds + 0.2 * took
        )
        self.batches_run += 1
        self.sentences_run += len(batch)
        with self._cond:
            self._returning = len(batch)
        self.recent.append((len(batch), *self._last_fill))
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
        self.estimate.observe(now - self._busy_mark, sum(it.cost for it in batch))
        self._busy_mark = now
        if self.metrics:
            self.metrics.seconds_per_token.set(self.estimate.seconds_per_token)
        self._complete(batch, out)


class DirectRunner:
    """No batching: each request's sentences are one ``embed_fn`` call on the model thread.

    The naive baseline the benchmark compares against (``ELMO_BATCHING=false``);
    requests still queue (on the embedder's lock), bounded by ``max_queue``. One
    persistent thread runs every call, as the batcher's does: on the event loop's
    default executor each of its threads would keep a thread pool of its own for the
    model's parallel ops (see ``elmo_service.runtime.in_transient_thread``).

    # Parameters

    embed_fn : `EmbedFn`
        Runs one request's sentences (``Embedder.embed_tokens``, which plans them).
    max_queue : `int`, optional
        Sentences pending at most; beyond, :class:`QueueFull` (a 429).
    metrics : `Metrics`, optional
        Prometheus metrics to update.
    estimate : `WorkEstimate`, optional
        Seconds per token for admission control.
    """

    def __init__(
        self,
        embed_fn: EmbedFn,
        *,
        max_queue: int = DEFAULT_MAX_QUEUE,
        metrics: Metrics | None = None,
        estimate: WorkEstimate | None = None,
    ) -> None:
        self.embed_fn = embed_fn
        self.max_queue = max_queue
        self.metrics = metrics
        self.estimate = estimate or WorkEstimate()
        self._pending = 0
        self._pending_cost = 0
        self._lock = threading.Lock()
        self._closed = False
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="elmo-model")

    quiet_for = 0.5

    @property
    def depth(self) -> int:
        return self._pending

    @property
    def idle(self) -> bool:
        return self._pending == 0

    def announce(self) -> Ticket:
        return Ticket(None)

    @property
    def alive(self) -> bool:
        return not self._closed

    def _call(self, token_lists: Sequence[Sequence[str]]) -> list[np.ndarray]:
        with self._lock:
            start = time.perf_counter()
            out = self.embed_fn(token_lists)
            self.estimate.observe(time.perf_counter() - start, sum(map(token_cost, token_lists)))
        if self.metrics:
            m = self.metrics
            m.batch_seconds.observe(time.perf_counter() - start)
            m.batch_sentences.observe(len(token_lists))
            m.tokens.inc(sum(len(t) for t in token_lists))
        return out

    async def embed(
        self,
        token_lists: Sequence[Sequence[str]],
        timeout: float | None = None,
        ticket: Ticket | None = None,
    ) -> list[np.ndarray]:
        if not token_lists:
            return []
        if self._closed:
            raise BatcherClosed("the model is shutting down")
        cost = sum(token_cost(t) for t in token_lists)
        admit(
            waiting=self._pending, sentences=len(token_lists), max_queue=self.max_queue,
            estimate=self.estimate, pending_cost=self._pending_cost, cost=cost,
            timeout=timeout, metrics=self.metrics,
        )  # fmt: skip
        self._pending += len(token_lists)
        self._pending_cost += cost
        try:
            async with asyncio.timeout(timeout):
                try:
                    call = asyncio.get_running_loop().run_in_executor(
                        self._executor, self._call, token_lists
                    )
                except RuntimeError as e:  # closed from another thread since the check
                    raise BatcherClosed("the model is shutting down") from e
                return await call
        finally:
            self._pending -= len(token_lists)
            self._pending_cost -= cost

    def close(self, timeout: float = 10.0) -> None:
        self._closed = True
        self._executor.shutdown(wait=False)  # a call under way finishes; nothing new starts
