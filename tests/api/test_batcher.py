"""The micro-batcher: merging, token budget, no fixed delay, backpressure, drops,
timeouts -- unit tests with a fake model, then through HTTP."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from elmo_api.admission import BatcherClosed, QueueFull
from elmo_api.batcher import Batcher
from elmo_api.main import create_app
from elmo_api.metrics import Metrics
from elmo_api.settings import load_settings
from tests.support.fake_models import FakeModel, token_values


def run(coro):
    return asyncio.run(coro)


def test_concurrent_requests_merge_into_one_batch_and_get_their_own_answers():
    gate = threading.Event()
    model = FakeModel(gate)
    b = Batcher(model, batch_tokens=10_000, max_queue=1000)

    async def main():
        first = asyncio.ensure_future(b.embed([["warm"]]))
        await asyncio.to_thread(model.started.wait, 5)  # the worker is now busy with "warm"
        reqs = [[[f"r{i}", f"t{j}"] for j in range(i % 3 + 1)] for i in range(20)]
        tasks = [asyncio.ensure_future(b.embed(r)) for r in reqs]
        await asyncio.sleep(0.05)
        gate.set()
        await first
        results = await asyncio.gather(*tasks)
        for req, res in zip(reqs, results, strict=True):
            for toks, arr in zip(req, res, strict=True):
                assert np.array_equal(arr, token_values(toks))

    run(main())
    b.close()
    assert len(model.batches) == 2  # "warm", then everything that queued meanwhile
    assert len(model.batches[1]) == sum(i % 3 + 1 for i in range(20))


def test_no_fixed_delay_when_idle():
    model = FakeModel()
    b = Batcher(model)

    async def main():
        t = time.perf_counter()
        await b.embed([["a", "b"]])
        return time.perf_counter() - t

    assert run(main()) < 0.5  # generous for a loaded CI machine; a fixed delay would show in recent
    assert all(waited == 0.0 for _, _, waited in b.recent)
    b.close()


def test_batches_respect_token_budget_and_are_sorted_by_length():
    gate = threading.Event()
    model = FakeModel(gate)
    b = Batcher(model, batch_tokens=40, max_queue=1000)
    lengths = [3, 17, 8, 1, 12, 5, 9, 2, 14, 6]

    async def main():
        first = asyncio.ensure_future(b.embed([["x"]]))
        await asyncio.to_thread(model.started.wait, 5)
        tasks = [asyncio.ensure_future(b.embed([[f"w{n}"] * n])) for n in lengths]
        await asyncio.sleep(0.05)
        gate.set()
        await first
        await asyncio.gather(*tasks)

    run(main())
    b.close()
    batches = model.batches[1:]
    assert sorted(len(s) for batch in batches for s in batch) == sorted(lengths)
    flat = [len(s) for batch in batches for s in batch]
    assert flat == sorted(flat, reverse=True)
    for batch in batches:
        assert len(batch) * (max(len(s) for s in batch) + 2) <= 40 or len(batch) == 1


def test_full_queue_refuses_at_once():
    gate = threading.Event()
    model = FakeModel(gate)
    metrics = Metrics()
    b = Batcher(model, max_queue=4, metrics=metrics)

    async def main():
        busy = asyncio.ensure_future(b.embed([["busy"]]))
        await asyncio.to_thread(model.started.wait, 5)
        queued = asyncio.ensure_future(b.embed([["a"], ["b"], ["c"]]))
        await asyncio.sleep(0.01)
        refused = b.embed([["d"], ["e"]])
        with pytest.raises(QueueFull):  # in its first step: at the door, no wait (no clock)
            refused.send(None)
        gate.set()
        await busy
        await queued

    run(main())
    b.close()
    assert metrics.rejected.labels("queue_full")._value.get() == 1


def test_cancelled_and_timed_out_work_never_reaches_the_model():
    gate = threading.Event()
    model = FakeModel(gate)
    metrics = Metrics()
    b = Batcher(model, metrics=metrics)

    async def main():
        busy = asyncio.ensure_future(b.embed([["busy"]]))
        await asyncio.to_thread(model.started.wait, 5)
        gone = asyncio.ensure_future(b.embed([["gone", "away"], ["me", "too"]]))
        kept = asyncio.ensure_future(b.embed([["kept"]]))
        with pytest.raises(TimeoutError):
            await b.embed([["too", "slow"]], timeout=0.05)
        await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.sleep(0.01)
        gate.set()
        await busy
        assert np.array_equal((await kept)[0], token_values(["kept"]))

    run(main())
    b.close()
    seen = [tuple(s) for batch in model.batches for s in batch]
    assert ("kept",) in seen
    for dropped in (("gone", "away"), ("me", "too"), ("too", "slow")):
        assert dropped not in seen
    assert b.dropped == 3
    assert metrics.dropped.labels("cancelled")._value.get() == 3


def test_model_error_fails_only_that_batch():
    calls = []

    def flaky(sentences):
        calls.append(sentences)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return [np.zeros((1, len(s), 1), np.float32) for s in sentences]

    b = Batcher(flaky)

    async def main():
        with pytest.raises(RuntimeError):
            await b.embed([["a"]])
        return await b.embed([["b"]])

    assert run(main())[0].shape == (1, 1, 1)
    b.close()


def test_close_drains_queue_then_refuses():
    model = FakeModel(delay=0.02)
    b = Batcher(model)

    async def main():
        tasks = [asyncio.ensure_future(b.embed([[f"s{i}"]])) for i in range(5)]
        await asyncio.sleep(0)
        await asyncio.to_thread(b.close)
        await asyncio.gather(*tasks)
        with pytest.raises(BatcherClosed):
            await b.embed([["late"]])

    run(main())


# -- through HTTP ---------------------------------------------------------------------


def _settings(model_dir, tmp_path, **kw):
    return load_settings(model_path=model_dir, threads=1, data_dir=tmp_path, cache=False, **kw)


def _block_model(app):
    """Make the served model wait on a gate; returns (gate, started)."""
    runner = app.state.holder.current.runner
    attr = _model_attr(runner)
    real = getattr(runner, attr)
    gate, started = threading.Event(), threading.Event()

    def blocked(sentences):
        started.set()
        assert gate.wait(20)
        return real(sentences)

    setattr(runner, attr, blocked)
    return gate, started


def _model_attr(runner) -> str:
    """The runner's function that computes interactive requests when no batch work waits:
    the main model thread's (the express thread takes them only beside batch work)."""
    return "embed_fn"


def test_http_queue_full_is_429_json(tiny_model_dir, tmp_path):
    app = create_app(_settings(tiny_model_dir, tmp_path, max_queue=3, max_sentences=3))
    with TestClient(app) as c:
        gate, started = _block_model(app)
        results = {}

        def call(name, body):
            results[name] = c.post("/v1/embed", json=body)

        t1 = threading.Thread(target=call, args=("busy", {"sentences": ["running now"]}))
        t1.start()
        assert started.wait(5)
        t2 = threading.Thread(target=call, args=("queued", {"sentences": ["a b", "c d", "e f"]}))
        t2.start()
        deadline = time.monotonic() + 5
        while app.state.holder.current.runner.depth < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        r = c.post("/v1/embed", json={"sentences": ["one more"]})
        assert r.status_code == 429
        assert r.json()["code"] == "overloaded" and r.headers["retry-after"] == "1"
        gate.set()
        t1.join(10)
        t2.join(10)
        assert results["busy"].status_code == 200 and results["queued"].status_code == 200


def test_http_timeout_is_503_json(tiny_model_dir, tmp_path):
    app = create_app(_settings(tiny_model_dir, tmp_path, request_timeout=0.2))
    with TestClient(app) as c:
        gate, _ = _block_model(app)
        try:
            r = c.post("/v1/embed", json={"sentences": ["slow"]})
            assert r.status_code == 503
            assert r.json()["code"] == "timeout"
        finally:
            gate.set()


@pytest.mark.slow
def test_announced_requests_fill_the_batch_but_an_idle_server_never_waits():
    model = FakeModel(delay=0.2)
    b = Batcher(model, max_fill_wait=1.0)

    async def main():
        await b.embed([["prime"]])  # sets the recent batch time (~200 ms): waits up to 50 ms
        await b.embed([["alone"]])  # nothing announced, its own client came back: starts at once
        # a ticket retired without submitting (a cache hit) ends the wait
        hit = b.announce()
        task = asyncio.ensure_future(b.embed([["four"]]))
        await asyncio.sleep(0.001)
        hit.retire()
        await task
        # three requests announced (in flight in the server); the first submits at once,
        # the others a little later: one batch, not two
        tickets = [b.announce() for _ in range(3)]
        first = asyncio.ensure_future(b.embed([["one"]], ticket=tickets[0]))
        await asyncio.sleep(0.002)
        rest = [
            asyncio.ensure_future(b.embed([[w]], ticket=t))
            for w, t in zip(("two", "three"), tickets[1:], strict=True)
        ]
        await asyncio.gather(first, *rest)

    run(main())
    b.close()
    sizes = [n for n, _, _ in b.recent]
    assert sizes == [1, 1, 1, 3]
    assert b.recent[1][1:] == (0, 0.0)  # "alone": nothing announced, no wait at all
    assert b.recent[2][2] < 0.05  # "four": waited only until the cache hit retired
    assert sorted(map(tuple, model.batches[3])) == [("one",), ("three",), ("two",)]
    assert b._incoming == 0


def test_closed_loop_clients_merge_into_one_batch():
    """Clients answered by a batch come back within milliseconds: the next batch
    waits (bounded) for them instead of splitting the clients into two groups."""
    model = FakeModel(delay=0.05)
    b = Batcher(model, max_fill_wait=0.02, fill_ratio=1.0)

    async def client(i: int, rounds: int):
        for r in range(rounds):
            await b.embed([[f"c{i}r{r}"]])
            await asyncio.sleep(0.001 * (i % 4))  # the HTTP round trip, a little uneven

    async def main():
        # start in two waves, as a server under load sees them
        first = [asyncio.ensure_future(client(i, 6)) for i in range(8)]
        await asyncio.sleep(0.01)
        second = [asyncio.ensure_future(client(i, 6)) for i in range(8, 16)]
        await asyncio.gather(*first, *second)

    run(main())
    b.close()
    sizes = [n for n, _, _ in b.recent]
    assert sum(sizes) == 96
    # after the first round the waves merge: batches of all 16 clients in between
    # (the first wave starts and finishes one round ahead of the second)
    assert sizes[1:-1] == [16] * (len(sizes) - 2), sizes
