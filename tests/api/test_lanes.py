"""Priority lanes in the batcher: ordering, no starvation, preemption, per-lane limits, and
where a request's time went -- unit tests with a fake model, then one live server."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import httpx
import pytest

from elmo_api.admission import QueueFull
from elmo_api.batcher import Batcher
from elmo_api.lanes import BATCH, INTERACTIVE, LaneShare
from elmo_api.main import create_app
from elmo_api.metrics import Metrics
from elmo_api.settings import load_settings
from elmo_api.timing import RequestTiming
from tests.support.fake_models import FakeModel
from tests.support.live_server import LiveServer


def run(coro):
    return asyncio.run(coro)


WAIT = 30  # seconds an event may take at most on a loaded machine (a deadline, not a timing)


async def queued(b: Batcher, lane, n: int) -> None:
    """Until ``lane`` holds ``n`` sentences (a poll with a deadline, not a sleep)."""
    for _ in range(WAIT * 100):
        if b.lane_depth(lane) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{lane}: {b.lane_depth(lane)} queued, not {n}, within {WAIT}s")


def _first_batch_with(batches, token: str) -> int:
    return next(i for i, b in enumerate(batches) if any(token in s for s in b))


def test_interactive_work_runs_before_batch_work_queued_earlier():
    """One model thread (no express thread): the batch queued first waits for the
    interactive requests queued after it."""
    gate = threading.Event()
    model = FakeModel(gate)
    b = Batcher(model, batch_tokens=4096, max_fill_wait=0)

    async def main():
        warm = asyncio.ensure_future(b.embed([["warm"]]))
        await asyncio.to_thread(model.started.wait, 5)
        bulk = [asyncio.ensure_future(b.embed([[f"b{i}", "x"]], lane=BATCH)) for i in range(20)]
        await queued(b, BATCH, 20)  # all batch work queued first
        urgent = [asyncio.ensure_future(b.embed([[f"i{i}"]])) for i in range(3)]
        await queued(b, INTERACTIVE, 3)
        gate.set()
        await warm
        await asyncio.gather(*urgent, *bulk)

    run(main())
    b.close()
    after = model.batches[1:]
    # every interactive sentence, alone, in the first batch after the one that was running
    assert sorted(after[0]) == [("i0",), ("i1",), ("i2",)]
    assert all(s[0].startswith("b") for batch in after[1:] for s in batch)  # full batches
    assert sum(len(batch) for batch in after) == 23


def test_interactive_work_preempts_the_rest_of_a_batch_take():
    """Batch work alone runs in full batches (no interactive traffic yet); an interactive
    request arriving meanwhile waits for the batch running now, not for the whole take."""
    gate = threading.Event()
    model = FakeModel(gate)
    # budget of 12 padded tokens: 4 sentences of 1 token (+2 markers) per batch
    b = Batcher(model, batch_tokens=12, take_batches=8, max_fill_wait=0)

    async def main():
        bulk = asyncio.ensure_future(b.embed([[f"b{i}"] for i in range(16)], lane=BATCH))
        await asyncio.to_thread(model.started.wait, 5)  # the first of 4 batches computes
        urgent = asyncio.ensure_future(b.embed([["now"]]))
        await queued(b, INTERACTIVE, 1)
        gate.set()
        await asyncio.gather(bulk, urgent)

    run(main())
    b.close()
    assert len(model.batches[0]) == 4  # the take's first batch, already computing
    assert ("now",) in model.batches[1]  # next, not after the other 12 batch sentences
    assert sum(len(x) for x in model.batches) == 17


def test_flooded_interactive_lane_does_not_starve_batch_work():
    """Interactive requests fill their lane; the batch lane still gets its share of the
    model's batches. With a share of 0 (the control) the same batch work waits for the
    flood to end. Both lanes are queued while the model is held, then the model thread
    runs them on its own: the order of its batches is the policy's, whatever the load."""

    def flood(share: float) -> list[str]:
        gate = threading.Event()
        model = FakeModel(gate)
        # two interactive sentences of 20 tokens fill a batch: only the share lets batch work in
        b = Batcher(model, batch_tokens=64, batch_share=share, max_fill_wait=0)
        long = [f"w{k}" for k in range(20)]

        async def main():
            warm = asyncio.ensure_future(b.embed([["warm"]]))
            await asyncio.to_thread(model.started.wait, WAIT)
            inter = [asyncio.ensure_future(b.embed([long, long])) for _ in range(30)]
            await queued(b, INTERACTIVE, 60)
            bulk = asyncio.ensure_future(b.embed([[f"b{i}", "y"] for i in range(8)], lane=BATCH))
            await queued(b, BATCH, 8)
            gate.set()
            await asyncio.gather(warm, bulk, *inter)

        run(main())
        b.close()
        # each batch after the warm-up: "b" (batch lane only), "i" (interactive), "ib" (both)
        return [
            "".join(sorted({"b" if s[0].startswith("b") else "i" for s in batch}))
            for batch in model.batches[1:]
        ]

    order = flood(0.2)
    last_batch = max(i for i, k in enumerate(order) if "b" in k)
    last_inter = max(i for i, k in enumerate(order) if "i" in k)
    # the batch lane's work was done while interactive work still waited, early on
    assert last_batch < last_inter and last_batch < len(order) // 2, order
    control = flood(0.0)
    first_batch = min(i for i, k in enumerate(control) if "b" in k)
    assert all(k == "i" for k in control[:first_batch]) and first_batch > 0, control
    assert all(k == "b" for k in control[first_batch:]), control  # after the whole flood


def test_lane_share_is_a_bounded_share_of_tokens():
    share = LaneShare(batch_share=0.25, decay=0.9)
    runs = []
    for _ in range(200):  # both lanes always waiting: the rule alone decides
        lane = BATCH if share.batch_due() else INTERACTIVE
        runs.append(lane)
        share.ran({lane: 100})
    tail = runs[100:]
    assert 0.2 <= tail.count(BATCH) / len(tail) <= 0.35
    with pytest.raises(ValueError):
        LaneShare(batch_share=1.5)


def test_per_lane_queue_limits_and_refusals_are_counted_per_lane():
    gate = threading.Event()
    model = FakeModel(gate)
    metrics = Metrics()
    b = Batcher(model, max_queue=6, batch_max_queue=3, metrics=metrics, max_fill_wait=0)

    async def main():
        warm = asyncio.ensure_future(b.embed([["warm"]]))
        await asyncio.to_thread(model.started.wait, 5)
        held = b.submit_nowait([["a"], ["b"], ["c"]], lane=BATCH)
        with pytest.raises(QueueFull, match="batch queue full.*ELMO_BATCH_MAX_QUEUE"):
            b.submit_nowait([["d"]], lane=BATCH)
        # the interactive lane has its own room
        urgent = b.submit_nowait([["e"], ["f"], ["g"], ["h"], ["i"], ["j"]])
        with pytest.raises(QueueFull, match="interactive queue full"):
            b.submit_nowait([["k"]])
        assert b.lane_depth(BATCH) == 3 and b.lane_depth(INTERACTIVE) == 6 and b.depth == 9
        with pytest.raises(ValueError, match="unknown lane"):
            b.submit_nowait([["z"]], lane="urgent")  # type: ignore[arg-type]
        gate.set()
        await warm
        await asyncio.gather(*held, *urgent)

    run(main())
    b.close()
    assert metrics.lane_rejected.labels("batch", "queue_full")._value.get() == 1
    assert metrics.lane_rejected.labels("interactive", "queue_full")._value.get() == 1
    assert metrics.lane_queue_depth.labels("batch")._value.get() == 0


def test_interactive_admission_does_not_count_queued_batch_work():
    """Interactive work waits only for its lane and the batch running now: a big batch-lane
    backlog does not get it refused as overloaded, while batch work behind it is."""
    gate = threading.Event()
    model = FakeModel(gate)
    b = Batcher(model, max_fill_wait=0)
    b.estimate.observe(1.0, 100)  # 10 ms per token

    async def main():
        warm = asyncio.ensure_future(b.embed([["warm"]]))
        await asyncio.to_thread(model.started.wait, 5)
        backlog = b.submit_nowait([[f"b{i}"] * 30 for i in range(20)], lane=BATCH)  # ~6.4 s
        ok = b.submit_nowait([["fast"]], timeout=1.0)
        with pytest.raises(QueueFull):
            b.submit_nowait([["late"]], timeout=1.0, lane=BATCH)
        gate.set()
        await warm
        await asyncio.gather(*ok, *backlog)

    run(main())
    b.close()


def test_timing_parts_add_up_within_the_wall_time():
    model = FakeModel(delay=0.02)
    b = Batcher(model, max_fill_wait=0)

    async def main():
        timing = RequestTiming()
        t0 = time.perf_counter()
        await b.embed([["a", "b"], ["c"]], timing=timing)
        wall = time.perf_counter() - t0
        return timing, wall

    timing, wall = run(main())
    b.close()
    assert timing.inference >= 0.02  # the model call
    assert timing.queue >= 0
    assert timing.queue + timing.inference <= wall + 1e-6
    total = timing.total()
    assert total >= timing.queue + timing.inference
    headers = dict(timing.headers(total))
    assert set(headers) == {
        b"x-total-time",
        b"x-tokenization-time",
        b"x-queue-time",
        b"x-inference-time",
    }
    assert math.isclose(float(headers[b"x-inference-time"]), timing.inference * 1e3, rel_tol=1e-3)


# -- one live server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(tiny_model_dir, tmp_path_factory):
    s = load_settings(
        model_path=tiny_model_dir, threads=1, data_dir=tmp_path_factory.mktemp("d"), cache=False
    )
    app = create_app(s)
    with LiveServer(app) as srv:
        yield srv


TIMES = ("x-total-time", "x-tokenization-time", "x-queue-time", "x-inference-time")


def _times(r: httpx.Response) -> dict[str, float]:
    out = {h: float(r.headers[h]) for h in TIMES}
    for h, v in out.items():
        assert math.isfinite(v) and v >= 0, (h, v)
    parts = out["x-tokenization-time"] + out["x-queue-time"] + out["x-inference-time"]
    assert parts <= out["x-total-time"] + 1e-3, out
    return out


@pytest.mark.slow
def test_live_lanes_headers_and_metrics(live):
    with httpx.Client(base_url=live.url, timeout=30) as c:
        r = c.post("/v1/embed", json={"sentences": ["the bank ."], "priority": "interactive"})
        assert r.status_code == 200, r.text
        assert _times(r)["x-inference-time"] > 0  # no cache: the model ran
        r = c.post(
            "/v1/embeddings",
            json={"input": ["a river bank ."] * 3, "model": "tiny", "priority": "batch"},
        )
        assert r.status_code == 200, r.text
        _times(r)
        # both lanes at once from many clients: every answer right and timed
        with httpx.Client(base_url=live.url, timeout=30) as c2:
            import concurrent.futures as cf

            def one(i: int) -> httpx.Response:
                lane = "batch" if i % 2 else "interactive"
                return c2.post(
                    "/v1/embed",
                    json={"sentences": [f"word{i} x ."] * (1 + i % 4), "priority": lane},
                )

            with cf.ThreadPoolExecutor(8) as pool:
                for r in pool.map(one, range(24)):
                    assert r.status_code == 200, r.text
                    _times(r)
        bad = c.post("/v1/embed", json={"sentences": ["x"], "priority": "urgent"})
        assert bad.status_code == 422 and bad.json()["field"].endswith("priority"), bad.text
        assert "x-total-time" not in c.get("/v1/models").headers
        text = c.get("/metrics").text
        for lane in ("interactive", "batch"):
            for phase in ("total", "tokenization", "queue", "inference"):
                assert f'elmo_request_phase_seconds_count{{lane="{lane}",phase="{phase}"}}' in text
        assert 'elmo_lane_queue_depth{lane="batch"}' in text
