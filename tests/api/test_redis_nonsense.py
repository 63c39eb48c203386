"""A Redis that answers well-formed nonsense never causes a 500.

The fake is a real process speaking RESP (:mod:`tests.support.fake_redis`): every
reply parses, but has the wrong type or length (a wrong-length ``MGET`` array, an
integer, ``+OK`` to everything). The cache reads it as a backend failure (counted,
breaker opened, served uncached and correct); the task store answers 503, or its
last good read. A write a real Redis refuses (``OOM`` under ``noeviction``) does
not stop the cache being read.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from elmo_api.cache import BadReply, RedisCache, check_mget
from elmo_api.encoding import decode_array
from elmo_api.main import create_app
from elmo_api.settings import load_settings
from elmo_service.embedder import Embedder
from tests.support.fake_redis import MODES, FakeRedis, fake_redis  # noqa: F401 - a fixture

torch.set_num_threads(1)

SENTS = ["The proxy answers nonsense.", "Vectors stay right.", "Short one."]
ADMIN = {"authorization": "Bearer admin-key"}


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    return Embedder.load(tiny_model_dir, threads=1)


def _settings(model_dir, tmp_path, url):
    return load_settings(
        model_path=model_dir, threads=1, data_dir=tmp_path, redis_url=url,
        redis_retry_interval=0.05, admin_keys="admin-key", jobs_embedded_worker=False,
    )  # fmt: skip


def _metric(c, name):
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def client(fake, tiny_model_dir, tmp_path_factory):
    app = create_app(_settings(tiny_model_dir, tmp_path_factory.mktemp("d"), fake.url))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("mode", MODES)
def test_embed_routes_serve_correct_vectors_on_nonsense(client, fake, ref, mode):
    fake.set_mode(mode)
    bad_before = _metric(client, 'elmo_cache_errors_total{kind="bad_reply"}')
    want = [e.layers for e in ref.embed(SENTS)]
    for _ in range(3):  # the breaker's half-open trials meet the nonsense again
        time.sleep(0.06)  # past the retry interval
        r = client.post("/v1/embed", json={"sentences": SENTS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["cache_hits"] == 0
        for d, w in zip(body["data"], want, strict=True):
            assert np.abs(decode_array(d["layers"]) - w).max() <= 1e-5
        # a task from the store, and the default mix (also read from the store)
        r = client.post("/v1/embed", json={"sentences": SENTS, "task": "shipped"})
        assert r.status_code == 200, r.text
        r = client.post("/v1/embeddings", json={"input": SENTS, "model": "tiny"})
        assert r.status_code == 200, r.text
        assert len(r.json()["data"]) == 3
    # every MGET met nonsense: counted each time the breaker let one through
    assert _metric(client, 'elmo_cache_errors_total{kind="bad_reply"}') >= bad_before + 3
    # served, yet out of rotation: it never read the fleet's desired model (#50 item 8)
    ready = client.get("/readyz")
    assert ready.status_code == 503 and ready.json()["code"] == "fleet_unjoined", ready.text


@pytest.mark.parametrize("mode", MODES)
def test_task_routes_answer_503_or_the_last_good_read_never_500(client, fake, mode):
    fake.set_mode(mode)
    calls = [
        ("GET", "/v1/tasks", None),
        ("GET", "/v1/tasks/shipped", None),
        ("GET", "/v1/tasks/nosuch", None),
        ("PUT", "/v1/tasks/mine", {"weights": [0.0, 1.0, 2.0]}),
        ("DELETE", "/v1/tasks/mine", None),
        ("POST", "/v1/embed", {"sentences": SENTS, "task": "mine"}),
    ]
    for method, path, body in calls:
        r = client.request(method, path, json=body, headers=ADMIN)
        assert r.status_code < 500 or r.status_code == 503, (method, path, r.status_code, r.text)
        assert set(r.json()) >= {"code", "message"} if r.status_code >= 400 else True
        if r.status_code == 503:
            assert r.json()["code"] == "store_unavailable" and "retry-after" in r.headers
    # the shipped task is known without the store
    assert client.get("/v1/tasks/shipped").status_code in (200, 503)


def test_check_mget_refuses_wrong_types_and_lengths():
    assert check_mget([b"a", None], 2) == [b"a", None]
    for bad in ([b"a"], [b"a", None, None], 3, b"OK", [b"a", 7], {"a": b"b"}, None):
        with pytest.raises(BadReply):
            check_mget(bad, 2)


def test_a_refused_write_does_not_stop_reads(redis_server_factory, tiny_model_dir, tmp_path, ref):
    """Under ``noeviction`` a full Redis refuses SET with OOM: the cache it holds is still read."""
    server = redis_server_factory()
    with TestClient(create_app(_settings(tiny_model_dir, tmp_path, server.url))) as c:
        assert c.post("/v1/embed", json={"sentences": SENTS}).json()["usage"]["cache_misses"] == 3
        admin = server.client()
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", "1")  # every write now refused with OOM
        try:
            new = ["A sentence the full cache cannot take."]
            r = c.post("/v1/embed", json={"sentences": new})
            assert r.status_code == 200 and r.json()["usage"]["cache_misses"] == 1
            assert _metric(c, 'elmo_cache_errors_total{kind="write_refused"}') >= 1
            for _ in range(3):  # the cached sentences are still hits
                body = c.post("/v1/embed", json={"sentences": SENTS}).json()
                assert body["usage"]["cache_hits"] == 3
            ready = c.get("/readyz").json()["cache"]
            assert ready["state"] == "ok" and ready["writes"] == "refused"
            assert "OutOfMemoryError" in ready["last_write_error"]
            assert _metric(c, 'elmo_cache_errors_total{kind="backend"}') == 0
        finally:
            admin.config_set("maxmemory", "0")
            admin.close()
        time.sleep(0.1)  # writes resume after the retry interval
        c.post("/v1/embed", json={"sentences": new})
        assert c.post("/v1/embed", json={"sentences": new}).json()["usage"]["cache_hits"] == 1


def test_redis_cache_never_raises_on_nonsense(fake):
    for mode in MODES:
        fake.set_mode(mode)
        cache = RedisCache(fake.url, retry_interval=0.0)
        assert cache.get_many(["a", "b", "c"]) == [None, None, None]
        assert cache.breaker.state == "down", mode
        cache.set_many([("a", b"x"), ("b", b"y")], ttl=5)  # retry_interval 0: tried again
        # "+OK" is the right answer to SET (the breaker closes); the rest are not
        assert cache.breaker.state == ("ok" if mode in ("ok", "short") else "down"), mode
        cache.delete_many(["a"])  # ":1" is a plausible answer to DEL; the rest are not
        assert cache.breaker.state == ("ok" if mode == "int" else "down"), mode
        cache.close()


def test_a_separate_cache_redis_keeps_vectors_apart_from_tasks(
    redis_server_factory, tiny_model_dir, tmp_path
):
    """ELMO_CACHE_REDIS_URL: the cache on its own (evictable) Redis, tasks on REDIS_URL."""
    store, cache = redis_server_factory(), redis_server_factory()
    s = load_settings(
        model_path=tiny_model_dir, threads=1, data_dir=tmp_path, redis_url=store.url,
        cache_redis_url=cache.url, admin_keys="admin-key", jobs_embedded_worker=False,
    )  # fmt: skip
    with TestClient(create_app(s)) as c:
        assert c.post("/v1/embed", json={"sentences": SENTS}).status_code == 200
        r = c.put("/v1/tasks/mine", json={"weights": [0.0, 1.0, 2.0]}, headers=ADMIN)
        assert r.status_code == 201
    a, b = store.client(), cache.client()
    try:
        assert a.keys("elmo:emb:*") == [] and len(a.keys("elmo:tasks:*")) == 1
        assert len(b.keys("elmo:emb:*")) == 3 and b.keys("elmo:tasks:*") == []
    finally:
        a.close()
        b.close()
