"""Sentence cache: entry format and verification, byte-bounded LRU, circuit breaker,
and a REAL redis-server: hits, garbage entries, outage mid-test and recovery."""

from __future__ import annotations

import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from elmo_api.cache import CircuitBreaker, CorruptEntry, LocalCache, pack, token_digest, unpack
from elmo_api.encoding import decode_array
from elmo_api.main import create_app
from elmo_api.settings import load_settings
from elmo_service.embedder import Embedder

# -- units ----------------------------------------------------------------------------------


def test_pack_unpack_roundtrip_and_verification():
    x = np.random.default_rng(0).standard_normal((3, 5, 16)).astype(np.float32)
    d = token_digest(["a", "b", "c", "d", "e"])
    blob = pack(x, "float32", "v1", d)
    assert np.array_equal(
        unpack(blob, dtype="float32", version="v1", digest=d, shape=(3, 5, 16)), x
    )
    half = unpack(
        pack(x, "float16", "v1", d), dtype="float16", version="v1", digest=d, shape=(3, 5, 16)
    )
    assert np.array_equal(half, x.astype(np.float16).astype(np.float32))
    bad = [
        dict(blob=b"garbage", dtype="float32", version="v1", digest=d, shape=(3, 5, 16)),
        dict(blob=blob, dtype="float16", version="v1", digest=d, shape=(3, 5, 16)),
        dict(blob=blob, dtype="float32", version="v2", digest=d, shape=(3, 5, 16)),
        dict(
            blob=blob, dtype="float32", version="v1", digest=token_digest(["x"]), shape=(3, 5, 16)
        ),
        dict(blob=blob, dtype="float32", version="v1", digest=d, shape=(3, 6, 16)),
        dict(blob=blob[:-4], dtype="float32", version="v1", digest=d, shape=(3, 5, 16)),
        dict(
            blob=b"ELC1" + blob[4:-4] + b"\x00\x00\xc0\x7f",
            dtype="float32",
            version="v1",
            digest=d,
            shape=(3, 5, 16),
        ),
    ]
    for kw in bad:
        with pytest.raises(CorruptEntry):
            unpack(**kw)


def test_token_digest_separates_tokens():
    assert token_digest(["ab", "c"]) != token_digest(["a", "bc"])
    assert token_digest(["a"]) == token_digest(["a"])


def test_local_cache_is_bounded_in_bytes():
    c = LocalCache(max_bytes=10_000, ttl=60)
    for i in range(50):
        c.set_many([(f"k{i}", b"x" * 1000)], ttl=60)
        assert c.current_bytes <= 10_000
    assert c.get_many(["k0"]) == [None]  # evicted, least recently used first
    assert c.get_many(["k49"]) == [b"x" * 1000]
    c.set_many([("huge", b"x" * 20_000)], ttl=60)  # larger than the whole cache: skipped
    assert c.get_many(["huge"]) == [None]


def test_local_cache_ttl():
    now = [0.0]
    c = LocalCache(max_bytes=10_000, ttl=10, timer=lambda: now[0])
    c.set_many([("k", b"v")], ttl=10)
    now[0] = 5
    assert c.get_many(["k"]) == [b"v"]
    now[0] = 11
    assert c.get_many(["k"]) == [None]


def test_circuit_breaker():
    now = [0.0]
    br = CircuitBreaker(retry_interval=5, timer=lambda: now[0])
    assert br.allow() and br.state == "ok"
    br.failure("down")
    assert br.state == "down" and not br.allow()
    now[0] = 5
    assert br.allow()  # one trial
    assert not br.allow()  # others keep skipping while it runs
    br.failure("still down")
    assert not br.allow()
    now[0] = 10
    assert br.allow()
    br.success()
    assert br.state == "ok" and br.allow()


# -- with a real Redis ---------------------------------------------------------------------


SENTS = ["The cache keeps layers.", "Mixes are computed from cached layers.", "Short one."]


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    return Embedder.load(tiny_model_dir, threads=1)


def _settings(model_dir, tmp_path, url, **kw):
    return load_settings(
        model_path=model_dir,
        threads=1,
        data_dir=tmp_path,
        redis_url=url,
        redis_retry_interval=0.2,
        **kw,
    )


def _post(c, sentences, **kw):
    r = c.post("/v1/embed", json={"sentences": sentences, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def _close(body, ref_layers):
    for d, e in zip(body["data"], ref_layers, strict=True):
        assert np.abs(decode_array(d["layers"]) - e).max() <= 1e-5


def _metric(c, name):
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_redis_cache_hits_and_mix_from_cached_layers(redis_server, tiny_model_dir, tmp_path, ref):
    redis_server.flushall()
    want = [e.layers for e in ref.embed(SENTS)]
    with TestClient(create_app(_settings(tiny_model_dir, tmp_path, redis_server.url))) as c:
        first = _post(c, SENTS)
        assert first["usage"]["cache_misses"] == 3
        second = _post(c, SENTS)
        assert second["usage"]["cache_hits"] == 3
        _close(first, want)
        _close(second, want)
        # a different task mix is served from the same cached layers
        mixed = _post(c, SENTS, output="both", mix=[3.0, 0.0, -1.0])
        assert mixed["usage"]["cache_hits"] == 3
        ready = c.get("/readyz").json()
        assert (
            ready["cache"]["backend"] == "redis"
            and ready["cache"]["state"] == "ok"
            and ready["cache"]["reachable"]
        )
    r = redis_server.client()
    keys = r.keys("elmo:emb:*")
    assert len(keys) == 3
    assert all(0 < r.ttl(k) <= 7 * 24 * 3600 for k in keys)  # every entry expires
    r.close()


def test_garbage_and_mismatched_entries_are_ignored_and_recomputed(
    redis_server, tiny_model_dir, tmp_path, ref
):
    redis_server.flushall()
    want = [e.layers for e in ref.embed(SENTS)]
    with TestClient(create_app(_settings(tiny_model_dir, tmp_path, redis_server.url))) as c:
        _post(c, SENTS)
        r = redis_server.client()
        keys = sorted(r.keys("elmo:emb:*"))
        good = r.get(keys[1])
        r.set(keys[0], b"\x00garbage\xff" * 10, ex=60)
        # right header layout, wrong model version
        r.set(keys[1], good.replace(ref.version.encode(), b"0" * len(ref.version)), ex=60)
        r.set(keys[2], good[: len(good) // 2], ex=60)  # truncated
        body = _post(c, SENTS)
        assert body["usage"]["cache_hits"] == 0 and body["usage"]["cache_misses"] == 3
        _close(body, want)
        assert _metric(c, 'elmo_cache_errors_total{kind="corrupt"}') == 3
        # recomputed values overwrote the bad entries
        again = _post(c, SENTS)
        assert again["usage"]["cache_hits"] == 3
        _close(again, want)
        r.close()


@pytest.mark.slow
def test_redis_outage_mid_test_then_recovery(redis_server_factory, tiny_model_dir, tmp_path, ref):
    server = redis_server_factory()
    want = [e.layers for e in ref.embed(SENTS)]
    with TestClient(create_app(_settings(tiny_model_dir, tmp_path, server.url))) as c:
        assert _post(c, SENTS)["usage"]["cache_misses"] == 3
        assert _post(c, SENTS)["usage"]["cache_hits"] == 3

        server.stop()
        for _ in range(3):  # still served, uncached
            body = _post(c, SENTS)
            assert body["usage"]["cache_hits"] == 0
            _close(body, want)
        assert _metric(c, 'elmo_cache_errors_total{kind="backend"}') >= 1
        ready = c.get("/readyz")
        assert ready.status_code == 200
        assert (
            ready.json()["cache"]["state"] in ("down", "half_open")
            and not ready.json()["cache"]["reachable"]
        )
        # while Redis is down, requests do not wait on it: the breaker lets one trial through
        # at most (no clock: a loaded machine cannot make that fail)
        errors = _metric(c, 'elmo_cache_errors_total{kind="backend"}')
        _post(c, ["While Redis is down, requests do not wait on it."])
        assert _metric(c, 'elmo_cache_errors_total{kind="backend"}') <= errors + 1

        server.start()  # same port, empty
        deadline = time.monotonic() + 10
        hits = 0
        while time.monotonic() < deadline:
            time.sleep(0.25)  # > redis_retry_interval
            body = _post(c, SENTS)
            _close(body, want)
            hits = body["usage"]["cache_hits"]
            if hits == 3:
                break
        assert hits == 3, "the cache did not recover after Redis came back"
        assert c.get("/readyz").json()["cache"]["state"] == "ok"
