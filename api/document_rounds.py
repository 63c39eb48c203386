"""Documents as batch-lane work of the batcher: several documents' rounds in one step.

A document's pass 1 (``elmo_service.document.DocumentRun``) is a sequence of rounds, each a
chunk of both directions from the state the previous round left. The route's thread waits
for one round at a time (:meth:`DocumentRounds.wait_round`); the batcher's main thread
computes the waiting rounds as one step (``elmo_service.document.advance``: a row per
document and direction). A caller that stops wanting its round withdraws it while it is
queued; a round in the model is waited for, so its run (and spills) may be closed once
``wait_round`` returns or raises.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from threading import Condition

from elmo_api.admission import BatcherClosed
from elmo_service.document import DocumentCancelled, DocumentRun, advance

POLL_S = 0.05  # how often a waiting round asks whether its caller still wants it
# the route's round (pass 1's unit; answer chunks stay ``chunk_tokens``): 8 documents' rows,
# a round each way, fill a batch's 4,096 tokens, which bound a step's buffers (docs/documents.md)
ROUND_TOKENS = 256


class RoundTimeout(TimeoutError):
    """A round waited past its timeout without reaching the model."""


class _Round(Future):
    """A round of ``run``: done once computed (its exception: the step's failure)."""

    def __init__(self, run: DocumentRun) -> None:
        super().__init__()
        self.run = run


class DocumentRounds:
    """Rounds waiting for the model, under the batcher's condition ``cond``."""

    def __init__(self, cond: Condition) -> None:
        self._cond = cond
        self.waiting: list[_Round] = []
        self.turn = False  # the documents' turn next when batch sentences wait too
        self.steps = self.rounds_run = 0  # batched steps run; rounds computed (one a document)
        self.active = 0  # callers waiting for a round (queued or in the model)
        self.closed = False  # the batcher closed: no more rounds
        # the runs of the last step with rounds left: their callers queue the next a moment
        # after it (their threads wake); a step waits for them (``fill``), or the documents
        # split into groups that take turns, each step half empty
        self.returning: set[DocumentRun] = set()

    def wait_round(
        self,
        run: DocumentRun,
        cancelled: Callable[[], bool] = lambda: False,
        timeout: float | None = None,
    ) -> None:
        """Compute one round of ``run`` on the model thread; block until it is done.
        Raises DocumentCancelled when ``cancelled()`` turns true (within ``POLL_S``),
        RoundTimeout when the round waited ``timeout`` seconds without starting."""
        r = _Round(run)
        with self._cond:
            if self.closed:
                raise self.closed_error()
            self.waiting.append(r)
            self.returning.discard(run)
            self.active += 1
            self._cond.notify_all()
        try:
            self._wait(r, cancelled, timeout)
        finally:
            with self._cond:
                self.active -= 1

    def _wait(self, r: _Round, cancelled: Callable[[], bool], timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not wait([r], POLL_S).done:
            gone = cancelled()
            if not gone and (deadline is None or time.monotonic() <= deadline):
                continue
            with self._cond:
                queued = r in self.waiting
                if queued:
                    self.waiting.remove(r)
            if queued:
                raise DocumentCancelled if gone else RoundTimeout(timeout)
            wait([r])  # in the model now: the run is not ours to close until it ends
            if gone:
                raise DocumentCancelled
        r.result()  # the step's failure, if it failed

    @staticmethod
    def closed_error() -> BaseException:
        return BatcherClosed("the model is shutting down")

    def take(self, rows: int | None = None, tokens: int | None = None) -> list[_Round]:
        """Under the lock: the waiting rounds, oldest first, while their rows (a chunk each
        way) fit in ``rows`` and their tokens (rows x round: the step's buffers) in ``tokens``;
        at least one, all with None. A step lasts a round's time steps whatever its rows:
        more documents a step run faster each."""
        n, used = 0, 0
        for r in self.waiting:
            cost = 2 * r.run.round_tokens
            over_rows = rows is not None and 2 * (n + 1) > rows
            if n and (over_rows or (tokens is not None and used + cost > tokens)):
                break
            n, used = n + 1, used + cost
        taken, self.waiting = self.waiting[:n], self.waiting[n:]
        return taken

    def fill(self, seconds: float) -> None:
        """Under the lock: wait at most ``seconds`` for the last step's documents to queue
        their next rounds."""
        deadline = time.monotonic() + seconds
        while self.returning and not self.closed and (left := deadline - time.monotonic()) > 0:
            self._cond.wait(left)
        self.returning.clear()

    def fail(self, error: BaseException) -> None:
        """Under the lock: fail every waiting round (the batcher closes)."""
        for r in self.take():
            r.set_exception(error)

    def run(self, taken: list[_Round]) -> None:
        """On the model thread, without the lock: one batched step of ``taken``'s rounds."""
        error: BaseException | None = None
        try:
            advance([r.run for r in taken])
            self.steps += 1
            self.rounds_run += len(taken)
        except Exception as e:  # noqa: BLE001 - a failed step fails its documents, not the worker
            error = e
        finally:
            with self._cond:
                self.returning = set() if error else {r.run for r in taken if not r.run.done}
            for r in taken:
                if error is None:
                    r.set_result(None)
                else:
                    r.set_exception(error)
