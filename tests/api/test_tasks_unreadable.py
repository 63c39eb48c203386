"""One task never breaks the tasks route (#50 item 6), with a real redis-server: a ``meta``
value the API's JSON cannot carry (an integer past 64 bits, NaN, a lone surrogate, nesting
too deep) is refused at PUT with a 422 naming it; a task already stored badly (written
straight into Redis) is flagged by ``GET /v1/tasks`` on every replica sharing that Redis,
its own GET answers a 409 naming it, and an admin can replace or delete it."""

from __future__ import annotations

import json

import pytest
import redis
from fastapi.testclient import TestClient

from elmo_api.main import create_app
from elmo_api.settings import load_settings

ADMIN = {"authorization": "Bearer admin"}
GOOD = {"weights": [0, 1, 0]}


def _app(model_dir, tmp_path, url):
    return create_app(
        load_settings(
            model_path=model_dir, threads=1, data_dir=tmp_path, admin_keys="admin", redis_url=url
        )
    )


@pytest.mark.parametrize(
    "raw, field",
    [
        (b'{"weights": [0, 1, 0], "meta": {"n": 18446744073709551616}}', "meta.n"),  # 2**64
        (b'{"weights": [0, 1, 0], "meta": {"a": [1, -9223372036854775809]}}', "meta.a[1]"),
        (b'{"weights": [0, 1, 0], "meta": {"x": NaN}}', "meta.x"),
        (b'{"weights": [0, 1, 0], "meta": {"s": "\\ud800"}}', "meta.s"),
        (b'{"weights": [0, 1, 0], "meta": {"d": ' + b"[" * 80 + b"]" * 80 + b"}}", "meta.d"),
    ],
)
def test_a_meta_that_cannot_round_trip_is_refused_naming_it(
    tiny_model_dir, tmp_path, redis_server, raw, field
):
    redis_server.flushall()
    with TestClient(_app(tiny_model_dir, tmp_path, redis_server.url)) as c:
        h = {**ADMIN, "content-type": "application/json"}
        r = c.put("/v1/tasks/x", content=raw, headers=h)
        assert r.status_code == 422, r.text
        assert r.json()["field"].startswith(field), r.json()
        assert c.get("/v1/tasks/x").status_code == 404  # nothing stored
        listed = c.get("/v1/tasks")
        assert listed.status_code == 200 and listed.json()["unreadable"] == []
        # the largest that does round-trip is kept, exactly
        ok = {**GOOD, "meta": {"n": 2**64 - 1, "m": -(2**63)}}
        assert c.put("/v1/tasks/x", json=ok, headers=ADMIN).status_code == 201
        assert c.get("/v1/tasks/x").json()["meta"] == ok["meta"]


BAD = {
    "big": json.dumps({**GOOD, "meta": {"n": 2**70}}),
    "nan": '{"weights": [0, 1, 0], "meta": {"x": NaN}}',
    "garbage": "{not json",
    "huge_int": '{"weights": [0, 1, 0], "meta": {"n": ' + "9" * 5000 + "}}",
    "weights": json.dumps({"weights": "abc"}),
    "list": "[1, 2]",
}


def test_a_task_stored_badly_never_makes_the_tasks_routes_answer_500(
    tiny_model_dir, tmp_path, redis_server
):
    redis_server.flushall()
    one, two = _app(tiny_model_dir, tmp_path / "a", redis_server.url), None
    with TestClient(one) as a:
        assert a.put("/v1/tasks/fine", json=GOOD, headers=ADMIN).status_code == 201
        r = redis.Redis.from_url(redis_server.url)
        (key,) = [k for k in r.keys("*tasks*")]
        for name, value in BAD.items():
            r.hset(key, name, value)
        r.hset(key, "shipped", BAD["big"])  # a bad override of a shipped task
        two = _app(tiny_model_dir, tmp_path / "b", redis_server.url)
        with TestClient(two) as b:  # another replica sharing the Redis
            for c in (a, b):
                listed = c.get("/v1/tasks")
                assert listed.status_code == 200, listed.text
                body = listed.json()
                assert [t["name"] for t in body["data"]] == ["fine"]
                flagged = {u["name"]: u["error"] for u in body["unreadable"]}
                assert set(flagged) == {*BAD, "shipped"}
                assert "meta.n" in flagged["big"] and "64 bits" in flagged["big"]
                for name in (*BAD, "shipped"):
                    g = c.get(f"/v1/tasks/{name}")
                    assert g.status_code == 409, (name, g.text)
                    err = g.json()
                    assert err["code"] == "unreadable_task" and err["field"] == "name"
                    assert repr(name) in err["message"] and "DELETE" in err["message"]
                # embedding with it is refused, never a 500; other tasks still serve
                e = c.post("/v1/embed", json={"sentences": ["a b"], "task": "big"})
                assert e.status_code == 409, e.text
                ok = c.post("/v1/embed", json={"sentences": ["a b"], "task": "fine"})
                assert ok.status_code == 200
            # an admin repairs one and deletes another; the list follows
            assert a.put("/v1/tasks/big", json=GOOD, headers=ADMIN).status_code == 200
            assert a.delete("/v1/tasks/garbage", headers=ADMIN).status_code == 200
            body = b.get("/v1/tasks").json()
            assert [t["name"] for t in body["data"]] == ["big", "fine"]
            assert "garbage" not in {u["name"] for u in body["unreadable"]}
