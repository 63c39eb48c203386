"""Admission control: overload is refused at the door (429 + Retry-After), not after a wait.

Deterministic: the model is held on a gate and the seconds-per-token estimate
is injected, so no assertion depends on how fast this machine is.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from fastapi.testclient import TestClient

from elmo_api.admission import Overloaded, WorkEstimate
from elmo_api.batcher import Batcher
from elmo_api.main import create_app
from elmo_api.metrics import Metrics
from elmo_api.settings import load_settings
from tests.support.fake_models import FakeModel


def test_estimate_starts_at_the_prior_then_follows_real_batches_weighted_by_tokens():
    est = WorkEstimate(prior=0.5, decay=0.5)
    assert est.seconds_per_token == 0.5
    est.observe(1.0, 1000)  # 1 ms/token
    assert est.seconds_per_token == pytest.approx(1e-3)
    est.observe(0.01, 2)  # a tiny batch (5 ms/token of overhead) barely moves it
    assert est.seconds_per_token == pytest.approx((0.5 + 0.01) / (500 + 2))
    est.check(0, 10**9, timeout=1.0)  # nothing ahead: always admitted


def test_check_refuses_what_cannot_finish_and_says_when_to_retry():
    est = WorkEstimate(prior=1.0, headroom=1.0)
    est.check(6, 4, timeout=10.0)  # 10 s: just fits
    with pytest.raises(Overloaded) as e:
        est.check(6, 5, timeout=10.0)
    assert e.value.retry_after == 1  # one second of the queue must drain
    with pytest.raises(Overloaded) as e:
        est.check(6, 50, timeout=10.0)  # too big to fit even behind 0 s: when the queue is empty
    assert e.value.retry_after == 6
    assert "10s timeout" in str(e.value)
    with pytest.raises(Overloaded):  # the default keeps 20% of the timeout for estimate error
        WorkEstimate(prior=1.0).check(6, 3, timeout=10.0)
    WorkEstimate(prior=1.0).check(6, 2, timeout=10.0)


def test_batcher_refuses_at_submit_when_queued_work_exceeds_the_timeout():
    model = FakeModel(threading.Event())
    metrics = Metrics()
    b = Batcher(model, metrics=metrics, estimate=WorkEstimate(prior=1.0, headroom=1.0))  # 1 s/tok

    async def main():
        running = asyncio.ensure_future(b.embed([["a"]], timeout=10))  # cost 3 (with <S> </S>)
        await asyncio.to_thread(model.started.wait, 5)
        queued = asyncio.ensure_future(b.embed([["b", "c"]], timeout=10))  # 3 + 4 = 7 s <= 10
        await asyncio.sleep(0)
        assert b.pending_tokens == 7
        with pytest.raises(Overloaded) as e:  # at the door: submit_nowait never waits
            b.submit_nowait([["d", "e", "f", "g"]], timeout=10)  # 7 + 6 = 13 s > 10
        # 13 s of work; the queued request's deadline is (just under) 10 s away
        assert e.value.retry_after in (3, 4)
        assert b.pending_tokens == 7 and b.depth == 1  # nothing of it was queued
        b.submit_nowait([["d"]], timeout=None)[0].cancel()  # no timeout: no admission check
        model.gate.set()
        await running
        await queued
        assert b.pending_tokens == 0  # answered and dropped work both leave the estimate

    asyncio.run(main())
    b.close()
    assert b.estimate.seconds_per_token < 1.0  # measured from the real batches now
    text = metrics.render()[0].decode()
    assert 'elmo_rejected_requests_total{reason="overloaded"} 1.0' in text


def test_a_request_that_would_overtake_a_queued_one_past_its_deadline_is_refused():
    """Takes are sorted by length: a longer request queued later runs first, so admitting
    it must leave the queued request's deadline intact, whatever its own timeout."""
    model = FakeModel(threading.Event())
    b = Batcher(model, estimate=WorkEstimate(prior=1.0, headroom=1.0))

    async def main():
        running = asyncio.ensure_future(b.embed([["a"]], timeout=60))  # 3 s
        await asyncio.to_thread(model.started.wait, 5)
        queued = asyncio.ensure_future(b.embed([["b", "c"]], timeout=11))  # done by 7 s of 11
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="would delay queued requests"):
            b.submit_nowait([["d", "e", "f"]], timeout=100)  # 12 s: fine for it, not for "b c"
        b.submit_nowait([["d"]], timeout=100)[0].cancel()  # 10 s: "b c" still makes it
        model.gate.set()
        await running
        await queued

    asyncio.run(main())
    b.close()


def test_http_overload_is_429_with_retry_after_before_any_wait(tiny_model_dir, tmp_path):
    s = load_settings(model_path=tiny_model_dir, threads=1, data_dir=tmp_path, request_timeout=30)
    app = create_app(s)
    with TestClient(app) as c:
        served = app.state.holder.current
        # interactive requests without batch work: the main model thread's function
        real, gate, started = served.runner.embed_fn, threading.Event(), threading.Event()

        def blocked(sentences):
            started.set()
            assert gate.wait(20)
            return real(sentences)

        served.runner.embed_fn = blocked
        slow = WorkEstimate(prior=1.0)  # a slow model: 1 s per token
        served.runner.estimate = served.runner.interactive_estimate = slow
        results = {}
        busy = threading.Thread(
            target=lambda: results.update(busy=c.post("/v1/embed", json={"sentences": ["busy"]}))
        )
        busy.start()
        try:
            assert started.wait(10)
            long = " ".join(["word"] * 30)  # 32 tokens + 3 ahead = 35 s > 0.8 x 30 s
            r = c.post("/v1/embed", json={"sentences": [long]})
            # refused at the door, not after its 30 s: answered while the model is still held
            # (no clock: a timeout would be a 504 after the gate, not a 429 before it)
            assert "busy" not in results and not gate.is_set()
            assert r.status_code == 429, r.text
            assert r.json()["code"] == "overloaded" and r.headers["retry-after"] == "3"
            assert "timeout" in r.json()["message"]
            fits = threading.Thread(  # 3 s ahead + 3 s of its own: admitted, waits for the model
                target=lambda: results.update(fits=c.post("/v1/embed", json={"sentences": ["x"]}))
            )
            fits.start()
            deadline = time.monotonic() + 10
            while served.runner.pending_tokens < 6 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert served.runner.pending_tokens == 6
        finally:
            gate.set()
            busy.join(20)
        fits.join(20)
        assert results["busy"].status_code == 200 and results["fits"].status_code == 200
