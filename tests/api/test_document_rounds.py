"""Documents as batch-lane work of the batcher (``elmo_api.document_rounds``): several
documents' rounds in one batched step on the model thread, never before queued interactive
work, a round withdrawn when its caller stops wanting it, failed when the batcher closes.

A fake model and a fake ``advance`` that record what the model thread ran, in order; the
worker is held in a batch by an event while work queues, so every test is driven by
events (no sleeps, no durations asserted).
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from elmo_api import document_rounds
from elmo_api.admission import BatcherClosed
from elmo_api.batcher import Batcher
from elmo_service.document import DocumentCancelled

WAIT = 30  # seconds an event may take at most on a loaded machine (a deadline, not a timing)


class Recorder:
    """The model thread's calls, in order: ("embed", lanes' first tokens) or ("docs", names)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []
        self.gate = threading.Event()
        self.started = threading.Event()

    def embed(self, sentences):
        self.started.set()
        assert self.gate.wait(WAIT)
        self.calls.append(("embed", [s[0] for s in sentences]))
        return [np.zeros((1, len(s), 1), np.float32) for s in sentences]

    def advance(self, runs):
        self.calls.append(("docs", [r.name for r in runs]))
        for r in runs:
            r.left -= 1


class Run:
    """A document of ``rounds`` rounds (``Recorder.advance`` counts them down)."""

    def __init__(self, name: str, chunk: int = 1, rounds: int = 1) -> None:
        self.name, self.round_tokens, self.left = name, chunk, rounds

    @property
    def done(self) -> bool:
        return self.left == 0


@pytest.fixture
def rec(monkeypatch):
    r = Recorder()
    monkeypatch.setattr(document_rounds, "advance", r.advance)
    return r


def _until(pred, what: str) -> None:
    ev = threading.Event()
    for _ in range(int(WAIT / 0.01)):
        if pred():
            return
        ev.wait(0.01)
    raise AssertionError(f"not within {WAIT}s: {what}")


def _round_thread(b: Batcher, run: Run, errors: list, cancelled=lambda: False):
    def go():
        try:
            b.rounds.wait_round(run, cancelled)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            errors.append((run.name, e))

    t = threading.Thread(target=go)
    t.start()
    return t


def test_rounds_of_several_documents_run_as_one_step_after_queued_interactive_work(rec):
    b = Batcher(rec.embed, max_queue=100)
    errors: list = []

    async def main():
        busy = asyncio.ensure_future(b.embed([["busy"]], lane="batch"))
        await asyncio.to_thread(rec.started.wait, WAIT)  # the model thread is in a batch now
        threads = [_round_thread(b, Run(f"doc{i}"), errors) for i in range(3)]
        await asyncio.to_thread(_until, lambda: len(b.rounds.waiting) == 3, "3 rounds queued")
        assert not b.idle  # a model swap's drain waits for documents' rounds too
        fast = asyncio.ensure_future(b.embed([["interactive"]]))
        await asyncio.to_thread(_until, lambda: b.lane_depth("interactive") == 1, "queued")
        rec.gate.set()
        await asyncio.gather(busy, fast)
        for t in threads:
            await asyncio.to_thread(t.join, WAIT)

    asyncio.run(main())
    b.close()
    assert not errors
    assert rec.calls == [
        ("embed", ["busy"]),
        ("embed", ["interactive"]),  # queued interactive work first
        ("docs", ["doc0", "doc1", "doc2"]),  # then the three documents' rounds, one step
    ]
    assert b.rounds.steps == 1 and b.rounds.rounds_run == 3
    assert b.rounds.active == 0


@pytest.mark.parametrize(
    "budget",
    [
        {"batch_tokens": 4096, "max_batch_sentences": 4},  # rows: 2 + 2 of at most 4
        {"batch_tokens": 64, "max_batch_sentences": 100},  # tokens: 32 + 32 of 64
    ],
    ids=["rows", "tokens"],
)
def test_a_step_of_rounds_holds_at_most_a_batchs_rows_and_tokens(rec, budget):
    """Rounds of two rows of 16 tokens each (a chunk each way): two a step, oldest first,
    bound by the batch's rows or its tokens; the third waits for the next step."""
    b = Batcher(rec.embed, max_queue=100, **budget)
    errors: list = []

    async def main():
        busy = asyncio.ensure_future(b.embed([["busy"]], lane="batch"))
        await asyncio.to_thread(rec.started.wait, WAIT)
        threads = []
        for i in range(3):
            threads.append(_round_thread(b, Run(f"doc{i}", chunk=16), errors))
            await asyncio.to_thread(_until, lambda i=i: len(b.rounds.waiting) == i + 1, "queued")
        rec.gate.set()
        await busy
        for t in threads:
            await asyncio.to_thread(t.join, WAIT)

    asyncio.run(main())
    b.close()
    assert not errors
    assert [c for c in rec.calls if c[0] == "docs"] == [
        ("docs", ["doc0", "doc1"]),
        ("docs", ["doc2"]),
    ]


def test_a_step_waits_for_the_last_steps_documents_to_queue_their_next_rounds(rec):
    """Three documents of three rounds: after a step, their threads queue the next rounds
    one by one; the model thread waits for all three (not taking the first alone, which
    would split the documents into groups that take turns, each step part empty)."""
    b = Batcher(rec.embed, max_queue=100, max_fill_wait=WAIT)
    late = threading.Event()  # doc2 queues its next rounds only when this is set
    errors: list = []

    def document(run: Run, hold: threading.Event | None = None) -> None:
        try:
            b.rounds.wait_round(run)
            while not run.done:
                if hold is not None:
                    assert hold.wait(WAIT)
                b.rounds.wait_round(run)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            errors.append((run.name, e))

    async def main():
        busy = asyncio.ensure_future(b.embed([["busy"]], lane="batch"))
        await asyncio.to_thread(rec.started.wait, WAIT)  # held: all three first rounds queue
        runs = [Run(f"doc{i}", rounds=3) for i in range(3)]
        threads = [
            threading.Thread(target=document, args=(r, late if r.name == "doc2" else None))
            for r in runs
        ]
        for t in threads:
            t.start()
        await asyncio.to_thread(_until, lambda: len(b.rounds.waiting) == 3, "3 rounds queued")
        rec.gate.set()
        await busy
        # doc0 and doc1 are back; the model thread waits for doc2 rather than step without it
        await asyncio.to_thread(
            _until,
            lambda: len(b.rounds.waiting) == 2 and b.rounds.returning,
            "two rounds back, one awaited",
        )
        assert [c for c in rec.calls if c[0] == "docs"] == [("docs", ["doc0", "doc1", "doc2"])]
        late.set()
        for t in threads:
            await asyncio.to_thread(t.join, WAIT)

    asyncio.run(main())
    b.close()
    assert not errors
    steps = [sorted(names) for kind, names in rec.calls if kind == "docs"]
    assert steps == [["doc0", "doc1", "doc2"]] * 3


def test_documents_take_turns_with_batch_sentences(rec):
    b = Batcher(rec.embed, max_queue=100, batch_tokens=4, max_batch_sentences=1)
    b.take_batches = 1  # one sentence a take: the turns are visible
    errors: list = []

    async def main():
        busy = asyncio.ensure_future(b.embed([["busy"]], lane="batch"))
        await asyncio.to_thread(rec.started.wait, WAIT)
        more = [asyncio.ensure_future(b.embed([[f"s{i}"]], lane="batch")) for i in range(3)]
        await asyncio.to_thread(_until, lambda: b.lane_depth("batch") == 3, "3 queued")
        t = _round_thread(b, Run("doc"), errors)
        await asyncio.to_thread(_until, lambda: len(b.rounds.waiting) == 1, "a round queued")
        rec.gate.set()
        await asyncio.gather(busy, *more)
        await asyncio.to_thread(t.join, WAIT)

    asyncio.run(main())
    b.close()
    assert not errors
    kinds = [c[0] for c in rec.calls]
    # the round waits behind one batch-lane take, not behind the whole batch queue
    assert kinds.index("docs") <= 2, rec.calls
    assert kinds.count("docs") == 1 and kinds.count("embed") == 4


def test_a_round_whose_caller_left_never_reaches_the_model(rec):
    b = Batcher(rec.embed, max_queue=100)
    errors: list = []
    gone = threading.Event()

    async def main():
        busy = asyncio.ensure_future(b.embed([["busy"]], lane="batch"))
        await asyncio.to_thread(rec.started.wait, WAIT)
        t = _round_thread(b, Run("left"), errors, cancelled=gone.is_set)
        stays = _round_thread(b, Run("stays"), errors)
        await asyncio.to_thread(_until, lambda: len(b.rounds.waiting) == 2, "2 queued")
        gone.set()
        await asyncio.to_thread(t.join, WAIT)  # withdrawn while queued: returns at once
        assert not t.is_alive()
        rec.gate.set()
        await busy
        await asyncio.to_thread(stays.join, WAIT)

    asyncio.run(main())
    b.close()
    assert [(n, type(e)) for n, e in errors] == [("left", DocumentCancelled)]
    assert ("docs", ["stays"]) in rec.calls
    assert all("left" not in names for _, names in rec.calls)


def test_closing_the_batcher_fails_waiting_rounds(rec):
    b = Batcher(rec.embed, max_queue=100)
    errors: list = []

    async def main():
        busy = asyncio.ensure_future(b.embed([["busy"]], lane="batch"))
        await asyncio.to_thread(rec.started.wait, WAIT)
        t = _round_thread(b, Run("doc"), errors)
        await asyncio.to_thread(_until, lambda: len(b.rounds.waiting) == 1, "queued")
        closing = threading.Thread(target=b.close, kwargs={"drain": False})
        closing.start()
        await asyncio.to_thread(t.join, WAIT)
        rec.gate.set()
        await asyncio.gather(busy, return_exceptions=True)
        await asyncio.to_thread(closing.join, WAIT)

    asyncio.run(main())
    assert [(n, type(e)) for n, e in errors] == [("doc", BatcherClosed)]
    with pytest.raises(BatcherClosed):
        b.rounds.wait_round(Run("late"))


def test_documents_streamed_at_once_share_steps_and_keep_the_librarys_vectors(
    tiny_model_dir, tmp_path, monkeypatch
):
    """Three documents through the route at once: the model thread computes their rounds
    together (the first step is held until the other two wait), and each document's
    vectors are the library's for that document alone."""
    import httpx

    from elmo_api.encoding import decode_array
    from elmo_api.main import create_app
    from elmo_api.settings import load_settings
    from elmo_service.embedder import Embedder
    from tests.support.determinism import same_vectors
    from tests.support.live_server import LiveServer

    real = document_rounds.advance
    steps: list[int] = []
    state: dict = {}

    def held(runs):
        if not steps:  # the first step waits for the other documents' rounds to queue
            queued = lambda: len(runs) + len(state["b"].rounds.waiting) >= 3  # noqa: E731
            _until(queued, "the other rounds queued")
        steps.append(len(runs))
        real(runs)

    monkeypatch.setattr(document_rounds, "advance", held)
    docs = [" ".join(f"w{(7 * k + i) % 23}" for i in range(40 + 9 * k)) for k in range(3)]
    s = load_settings(model_path=tiny_model_dir, threads=1, data_dir=tmp_path, cache=False)
    with LiveServer(create_app(s)) as srv:
        state["b"] = srv.config.app.state.holder.current.runner
        out: dict[int, list] = {}

        def post(k: int) -> None:
            r = httpx.post(
                srv.url + "/v1/embed/document",
                json={"document": docs[k], "chunk_tokens": 8, "encoding": "base64"},
                timeout=WAIT * 4,
            )
            assert r.status_code == 200, r.text
            lines = [httpx.Response(200, content=x).json() for x in r.content.splitlines()]
            assert lines[-1]["done"] is True
            out[k] = [decode_array(x["layers"]) for x in lines[:-1]]

        threads = [threading.Thread(target=post, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT * 4)
    assert sorted(out) == [0, 1, 2]
    assert max(steps) >= 2, steps  # rounds of different documents in one batched step
    emb = Embedder.load(tiny_model_dir, threads=1)
    for k, doc in enumerate(docs):
        want = np.concatenate([c.layers for c in emb.embed_document(doc, 8)], axis=1)
        got = np.concatenate(out[k], axis=1)
        assert same_vectors(got, want), k
