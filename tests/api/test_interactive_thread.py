"""The express thread (``ELMO_INTERACTIVE_THREAD``, the default on CPU): an interactive
request is answered while a batch computes, on the express thread with one intra-op
thread; without batch work the main thread runs it on every core; a sentence's vectors
are the same whichever thread (and kernel instance) computed it."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from elmo_api.batcher import Batcher
from elmo_api.encoding import decode_array
from elmo_api.lanes import BATCH
from elmo_api.main import create_app
from elmo_api.settings import load_settings
from elmo_service.artifact import load_artifact
from elmo_service.embedder import Embedder
from tests.support.determinism import same_vectors

MODEL = Path(__file__).resolve().parents[2] / "models" / "default"


class Recorder:
    """A fake model: records its batches, the thread and torch thread count of each call,
    and (with ``gate``) holds its first call until the gate opens."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate
        self.started = threading.Event()
        self.batches: list[list[tuple[str, ...]]] = []
        self.threads: list[tuple[str, int]] = []
        self.nice: list[int] = []

    def __call__(self, sentences):
        self.threads.append((threading.current_thread().name, torch.get_num_threads()))
        self.nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(10)
        self.batches.append([tuple(s) for s in sentences])
        return [np.full((1, len(s), 1), float(len(s)), np.float32) for s in sentences]


def test_interactive_request_is_answered_while_a_batch_computes():
    gate = threading.Event()
    main, inter = Recorder(gate), Recorder()
    default = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        b = Batcher(main, interactive_fn=inter, max_fill_wait=0, name="t", batch_nice=3)
        assert torch.get_num_threads() == 2  # the caller's count is left as it was

        async def scenario():
            bulk = asyncio.ensure_future(b.embed([["b0", "x"], ["b1", "y"]], lane=BATCH))
            await asyncio.to_thread(main.started.wait, 5)  # the batch computes, held
            # answered while the gate holds the batch (30 s: a deadline, not a timing)
            urgent = await asyncio.wait_for(b.embed([["now"]]), 30)
            assert not bulk.done()  # ... still in the model
            gate.set()
            return urgent, await bulk

        urgent, bulk = asyncio.run(scenario())
        b.close()
    finally:
        torch.set_num_threads(default)
    assert urgent[0].shape == (1, 1, 1)
    assert [len(x) for x in bulk] == [1, 1]
    assert inter.batches == [[("now",)]]  # interactive work only on its own thread ...
    assert sorted(main.batches[0]) == [("b0", "x"), ("b1", "y")]  # ... batch work only here
    assert inter.threads == [("t-interactive", 1)]  # one intra-op thread: no oversubscription
    assert main.threads == [("t", 2)]  # the batch thread keeps the process's count
    # the batch lane yields the CPU to interactive work (niceness is per thread on Linux)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert inter.nice == [base] and main.nice == [min(19, base + 3)]


def test_with_its_own_thread_batch_work_runs_in_full_batches():
    """An interactive request never waits behind batch work, so the batch lane keeps its
    efficient full batches while interactive requests arrive."""
    main, inter = Recorder(threading.Event()), Recorder()
    b = Batcher(main, interactive_fn=inter, batch_tokens=64, max_fill_wait=0)

    async def scenario():
        bulk = asyncio.ensure_future(b.embed([[f"b{i}", "y"] for i in range(32)], lane=BATCH))
        await asyncio.to_thread(main.started.wait, 5)
        more = [asyncio.ensure_future(b.embed([[f"i{k}"]])) for k in range(4)]
        await asyncio.gather(*more)  # answered while the main thread is held
        main.gate.set()
        await bulk

    asyncio.run(scenario())
    b.close()
    assert all(s[0].startswith("b") for batch in main.batches for s in batch)
    assert sum(len(batch) for batch in main.batches) == 32
    assert max(len(batch) for batch in main.batches) == 16  # 16 x 4 = 64 tokens: full
    assert sorted(s for batch in inter.batches for s in batch) == [(f"i{k}",) for k in range(4)]


def test_without_batch_work_interactive_work_runs_on_the_main_thread_on_every_core():
    """A server with no batch work computes interactive requests with every intra-op thread
    (the express thread's one would leave a core idle), several requests in one batch."""
    main, inter = Recorder(), Recorder()
    default = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        b = Batcher(main, interactive_fn=inter, max_fill_wait=0, name="t")

        async def scenario():
            return await asyncio.gather(*(b.embed([[f"i{k}"]]) for k in range(3)))

        asyncio.run(scenario())
        b.close()
    finally:
        torch.set_num_threads(default)
    assert inter.batches == []
    assert sorted(s for batch in main.batches for s in batch) == [("i0",), ("i1",), ("i2",)]
    assert {t for t in main.threads} == {("t", 2)}


def test_admission_counts_only_the_interactive_lane_for_interactive_work():
    main, inter = Recorder(threading.Event()), Recorder()
    b = Batcher(main, interactive_fn=inter, max_fill_wait=0)
    b.estimate.observe(100.0, 1)  # the batch lane looks hopelessly slow ...

    async def scenario():
        bulk = asyncio.ensure_future(b.embed([["b0", "x"]] * 4, lane=BATCH, timeout=30))
        await asyncio.to_thread(main.started.wait, 5)
        # ... yet interactive work is admitted: nothing of the batch lane is ahead of it
        out = await b.embed([["now"]], timeout=1.0)
        main.gate.set()
        await bulk
        return out

    assert len(asyncio.run(scenario())) == 1
    b.close()


@pytest.mark.slow
def test_two_kernel_instances_at_once_give_the_same_vectors():
    """The production set-up on the bundled model: the batch lane's instance with two torch
    threads (the direction workers), the interactive one with one, computing at the same
    time; every sentence within the determinism bound of itself alone."""
    default = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        artifact = load_artifact(MODEL, device="cpu")
        first, second = Embedder(artifact), Embedder(artifact)
        texts = [f"Sentence number {i} talks about banks , rivers and money ." for i in range(48)]
        texts += ["The long one . " * 40, "short", "中文句子，混合 English 🙂"]
        toks = [[t.piece for t in ts] for ts in first.tokenize(texts)]
        alone = [first.run_batch([t])[0] for t in toks]
        spans: dict[str, list[tuple[float, float]]] = {"main": [], "interactive": []}

        def timed(fn, name):
            def run(sentences):
                t0 = time.perf_counter()
                try:
                    return fn(sentences)
                finally:
                    spans[name].append((t0, time.perf_counter()))

            return run

        b = Batcher(
            timed(first.run_batch, "main"),
            interactive_fn=timed(second.run_batch, "interactive"),
            max_fill_wait=0,
        )

        async def scenario():
            bulk = [
                asyncio.ensure_future(b.embed(toks[k : k + 17], lane=BATCH))
                for k in range(0, len(toks), 17)
            ]
            singles = []
            for i in range(len(toks)):
                singles.append(await b.embed([toks[i]]))
            return [x for f in bulk for x in await f], [s[0] for s in singles]

        batched, singles = asyncio.run(scenario())
        b.close()
    finally:
        torch.set_num_threads(default)
    for i in range(len(toks)):
        assert same_vectors(batched[i], alone[i]), (texts[i], np.abs(batched[i] - alone[i]).max())
        assert same_vectors(singles[i], alone[i]), (texts[i], np.abs(singles[i] - alone[i]).max())
    # the two instances really computed at the same time (else this test proves little)
    assert any(
        a0 < b1 and b0 < a1 for a0, a1 in spans["main"] for b0, b1 in spans["interactive"]
    ), spans


def test_http_interactive_answer_while_a_batch_request_is_held(tiny_model_dir, tmp_path):
    s = load_settings(model_path=tiny_model_dir, threads=1, data_dir=tmp_path, cache=False)
    assert s.interactive_thread  # the default
    with TestClient(create_app(s)) as c:
        runner = c.app.state.holder.current.runner
        assert runner.express
        real, gate, started = runner.embed_fn, threading.Event(), threading.Event()

        def held(sentences):
            started.set()
            assert gate.wait(20)
            return real(sentences)

        runner.embed_fn = held
        body = {"sentences": ["the river bank ."], "encoding": "base64"}
        results = {}
        bulk = threading.Thread(
            target=lambda: results.update(
                batch=c.post("/v1/embed", json={**body, "priority": "batch"})
            )
        )
        bulk.start()
        try:
            assert started.wait(10)
            r = c.post("/v1/embed", json=body)  # interactive: its own thread, at once
            assert r.status_code == 200, r.text
            assert bulk.is_alive()  # the batch request is still held in the model
        finally:
            gate.set()
            bulk.join(20)
        assert results["batch"].status_code == 200, results["batch"].text
        got = [decode_array(d["layers"]) for d in r.json()["data"]]
        want = [decode_array(d["layers"]) for d in results["batch"].json()["data"]]
        assert len(got) == len(want) == 1
        assert same_vectors(got[0], want[0])


def test_http_one_model_thread_when_switched_off(tiny_model_dir, tmp_path):
    s = load_settings(
        model_path=tiny_model_dir, threads=1, data_dir=tmp_path, interactive_thread=False
    )
    with TestClient(create_app(s)) as c:
        runner = c.app.state.holder.current.runner
        assert not runner.express and runner.interactive_fn is None
        assert c.post("/v1/embed", json={"sentences": ["a b"]}).status_code == 200


def test_the_warm_up_reaches_the_express_threads_kernel_instance_on_its_thread():
    """A request reaches the express thread only beside batch work: the warm-up runs each
    thread's model function on that thread, before queued work."""
    main, inter = Recorder(), Recorder()
    b = Batcher(main, interactive_fn=inter, max_fill_wait=0, name="w")
    done = b.run_on_each(lambda fn: fn([["warm", "up"]]))
    assert [len(f.result(10)) for f in done] == [1, 1]
    b.close()
    assert main.batches == [[("warm", "up")]] and inter.batches == [[("warm", "up")]]
    assert [t for t, _ in main.threads] == ["w"] and [t for t, _ in inter.threads] == [
        "w-interactive"
    ]


def test_an_interactive_request_while_the_main_thread_fills_a_batch_goes_to_the_express_thread():
    """The main thread waits (the fill) for batch requests on their way; an interactive
    request meanwhile does not wait for that batch."""
    main, inter = Recorder(), Recorder()
    # any batch's time x 1e9: after the first one, the fill may wait up to 30 s
    b = Batcher(main, interactive_fn=inter, max_fill_wait=30.0, fill_ratio=1e9)

    async def scenario():
        await b.embed([["warm"]])
        announced = b.announce()  # a request on its way: the fill waits for it
        bulk = asyncio.ensure_future(b.embed([["b0"]], lane=BATCH))
        for _ in range(3000):  # the main thread took the batch work and fills
            if b.lane_depth(BATCH) == 0:
                break
            await asyncio.sleep(0.01)
        urgent = await asyncio.wait_for(b.embed([["now"]]), 30)
        assert not bulk.done()  # the batch is still waiting for the announced request
        announced.retire()
        await bulk
        return urgent

    asyncio.run(scenario())
    b.close()
    assert inter.batches == [[("now",)]] and main.batches == [[("warm",)], [("b0",)]]


def test_between_a_batch_clients_requests_interactive_work_stays_on_the_express_thread():
    """Closed-loop batch clients leave the batch queue empty for a moment after each answer:
    an interactive request then still goes to the express thread (batch work was recent),
    and to the main thread once batch work has been quiet for ``batch_quiet``."""
    main, inter = Recorder(), Recorder()
    b = Batcher(main, interactive_fn=inter, max_fill_wait=0, batch_quiet=3600.0)

    async def scenario():
        await b.embed([["b0"]], lane=BATCH)  # answered: the batch queue is empty now
        # the main thread has left the batch (its answer can reach us a moment before): a
        # call on each model thread runs only once that thread took its next work
        for done in b.run_on_each(lambda fn: None):
            await asyncio.wrap_future(done)
        await b.embed([["now"]])

    asyncio.run(scenario())
    b.close()
    assert main.batches == [[("b0",)]] and inter.batches == [[("now",)]]

    main, inter = Recorder(), Recorder()
    b = Batcher(main, interactive_fn=inter, max_fill_wait=0, batch_quiet=0.0)
    asyncio.run(scenario())
    b.close()
    assert main.batches == [[("b0",)], [("now",)]] and inter.batches == []
