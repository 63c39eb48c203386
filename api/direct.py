"""The unbatched runner (``ELMO_BATCHING=false``): the benchmark's naive baseline."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from elmo_api.admission import (
    DEFAULT_MAX_QUEUE,
    BatcherClosed,
    EmbedFn,
    Ticket,
    WorkEstimate,
    admit,
    token_cost,
)
from elmo_api.metrics import Metrics
from elmo_service.document import DocumentCancelled, advance


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

    def _call(self, token_lists: Sequence[Sequence[str]], timing: Any = None) -> list[np.ndarray]:
        with self._lock:
            start = time.perf_counter()
            out = self.embed_fn(token_lists)
            end = time.perf_counter()
            self.estimate.observe(end - start, sum(map(token_cost, token_lists)))
        if timing is not None:
            timing.add_batch(id(out), end - start, end)
        if self.metrics:
            m = self.metrics
            m.batch_seconds.observe(time.perf_counter() - start)
            m.batch_sentences.observe(len(token_lists))
            m.tokens.inc(sum(len(t) for t in token_lists))
        return out

    def document_round(self, run, cancelled=lambda: False, timeout: float | None = None) -> None:
        """No batcher: the document's thread computes its round itself, under the model's
        lock (``elmo_service.document.advance``); ``timeout`` is the batcher's concern."""
        if cancelled():
            raise DocumentCancelled
        advance([run])

    async def embed(
        self,
        token_lists: Sequence[Sequence[str]],
        timeout: float | None = None,
        ticket: Ticket | None = None,
        lane: str = "interactive",
        timing: Any = None,
    ) -> list[np.ndarray]:
        """One call per request, first come first served: no lanes here (``lane`` is
        accepted and only counted)."""
        if not token_lists:
            return []
        if self._closed:
            raise BatcherClosed("the model is shutting down")
        cost = sum(token_cost(t) for t in token_lists)
        admit(
            waiting=self._pending, sentences=len(token_lists), max_queue=self.max_queue,
            estimate=self.estimate, pending_cost=self._pending_cost, cost=cost,
            timeout=timeout, metrics=self.metrics, lane=lane,
        )  # fmt: skip
        self._pending += len(token_lists)
        self._pending_cost += cost
        if timing is not None:
            timing.submitted = time.perf_counter()
        try:
            async with asyncio.timeout(timeout):
                try:
                    call = asyncio.get_running_loop().run_in_executor(
                        self._executor, self._call, token_lists, timing
                    )
                except RuntimeError as e:  # closed from another thread since the check
                    raise BatcherClosed("the model is shutting down") from e
                out = await call
                if timing is not None:
                    timing.close_runner()
                return out
        finally:
            self._pending -= len(token_lists)
            self._pending_cost -= cost

    def close(self, timeout: float = 10.0) -> None:
        self._closed = True
        self._executor.shutdown(wait=False)  # a call under way finishes; nothing new starts
