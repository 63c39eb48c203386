"""A job store whose Redis answers well-formed nonsense never causes a 500.

The fake is a real process speaking RESP (:mod:`tests.support.fake_redis`): every reply
parses, but its type or length is not what the command returns (``+OK`` to everything,
an integer, a short array, a wrong type). Each ``/v1/jobs`` route answers 503
``store_unavailable`` naming the garbage; the one exception is a ``GET`` answered with a
plain string (``+OK``): a string is what ``GET`` returns, so the record is reported
unreadable (409), as a damaged record would be.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from elmo_api.main import create_app
from elmo_jobs.backend import RqBackend
from elmo_jobs.state import JobRecord, StoreUnavailable, Unreadable
from tests.jobs.test_jobs import ADMIN, dirs, job_body, settings_for
from tests.support.fake_redis import MODES

torch.set_num_threads(1)

JOB = "j0123456789ab"  # a well-formed id: the routes reach the store with it
ROUTES = [
    pytest.param(method, path, body, id=f"{method} {path}")
    for method, path, body in [
        ("GET", "/v1/jobs", None),
        ("GET", f"/v1/jobs/{JOB}", None),
        ("POST", "/v1/jobs", job_body()),
        ("POST", f"/v1/jobs/{JOB}/cancel", None),
        ("POST", f"/v1/jobs/{JOB}/retry", None),
    ]
]
# (mode, route) -> 409: the record GET read back is the string "OK" (a string reply, so
# not garbage at the protocol level; not a record either). GET /v1/jobs/{id} first runs
# the reconcile pass (at most every 2 s), which meets the garbage of ZRANGE: 503 then.
STRING_RECORD = {
    ("ok", f"/v1/jobs/{JOB}"): {409, 503},
    ("ok", f"/v1/jobs/{JOB}/cancel"): {409},
    ("ok", f"/v1/jobs/{JOB}/retry"): {409},
}


@pytest.fixture(scope="module")
def client(fake, tiny_model_dir, tmp_path_factory):
    d = dirs(tmp_path_factory.mktemp("jobs-nonsense"))
    s = settings_for(tiny_model_dir, d, redis_url=fake.url, jobs_store_timeout=2.0,
                     jobs_embedded_worker=False, redis_retry_interval=0.05)  # fmt: skip
    with TestClient(create_app(s), raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
def test_every_jobs_route_answers_503_on_nonsense(client, fake, mode, method, path, body):
    fake.set_mode(mode)
    r = client.request(method, path, json=body, headers=ADMIN)
    err = r.json()
    if r.status_code == 409:
        assert r.status_code in STRING_RECORD.get((mode, path), ()), r.text
        assert err["code"] == "unreadable_record" and err["field"] == "job_id", err
        return
    assert r.status_code == 503, (mode, method, path, r.status_code, r.text)
    assert err["code"] == "store_unavailable" and "retry-after" in r.headers, err
    assert "job store" in err["message"], err


def _record(tmp_path) -> JobRecord:
    return JobRecord(id=JOB, name="nonsense", backend="rq", spec={}, train_config={},
                     run_dir=str(tmp_path / JOB))  # fmt: skip


def _calls(b: RqBackend, rec: JobRecord) -> dict[str, Any]:
    """Every store and rq call the API, the workers and the reconciler make."""
    s = b.store
    return {
        "ids": s.ids,
        "list": s.list,
        "get": lambda: s.get(rec.id),
        "create": lambda: s.create(rec),
        "create_if_absent": lambda: s.create_if_absent(rec),
        "update": lambda: s.update(rec.id, lambda r: True),
        "reserve": lambda: s.reserve(rec.name, rec.id, lambda job_id, age: True),
        "deliver": lambda: b.deliver(rec),
        "execution_lost": lambda: b.execution_lost(rec),
        "delivery_lost": lambda: b.delivery_lost(rec),
        "workers_seen": b.workers_seen,
        "reconcile": b.reconcile,
    }


@pytest.mark.parametrize("mode", MODES)
def test_store_and_rq_calls_raise_store_unavailable_on_nonsense(fake, tiny_model_dir, tmp_path,
                                                                 mode):  # fmt: skip
    """Below the routes: each call either raises StoreUnavailable ("answered garbage", or
    the client's own protocol error) or, for a GET read back as a plain string, Unreadable;
    never a TypeError or AttributeError from deep inside redis-py or rq, and never a
    silent success."""
    fake.set_mode(mode)
    d = dirs(tmp_path)
    b = RqBackend(settings_for(tiny_model_dir, d, redis_url=fake.url, jobs_store_timeout=2.0))
    rec = _record(d["runs"])
    try:
        for what, call in _calls(b, rec).items():
            b._workers_checked, b._reconciled = (0.0, None), 0.0  # no cached answers
            with pytest.raises((StoreUnavailable, Unreadable)) as e:
                call()
            if e.type is Unreadable:  # only a string read back where a record should be
                assert mode == "ok" and what in ("get", "update"), (what, e.value)
            else:
                assert "job store" in str(e.value), (what, e.value)
    finally:
        b.close()


def test_a_bug_in_our_own_callback_is_not_mistaken_for_garbage(redis_server, tiny_model_dir,
                                                              tmp_path):  # fmt: skip
    """The conversion covers what Redis answers, not our code: a TypeError raised by an
    update's mutator (run inside the WATCH transaction) stays a TypeError."""
    d = dirs(tmp_path)
    b = RqBackend(settings_for(tiny_model_dir, d, redis_url=redis_server.url,
                               redis_prefix="bugs"))  # fmt: skip
    try:
        rec = _record(d["runs"])
        b.store.create(rec)

        def buggy(r: JobRecord) -> bool:
            raise TypeError("a bug in the mutator")

        with pytest.raises(TypeError, match="a bug in the mutator"):
            b.store.update(rec.id, buggy)

        def buggy_free(job_id: str, age: float) -> bool:
            raise KeyError("a bug in the name check")

        b.store.reserve("taken", "j999999999999", lambda j, a: True)
        with pytest.raises(KeyError, match="a bug in the name check"):
            b.store.reserve("taken", rec.id, buggy_free)
        assert b.store.get(rec.id) == rec  # and the real store still works
    finally:
        b.close()
