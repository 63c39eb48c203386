"""Model listing and activation: every artifact listed with its version and provenance,
the served one marked; ``activate`` swaps under concurrent traffic with zero failed
requests, and every response's vectors belong to the model version it reports."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from elmo_api.main import create_app
from elmo_api.settings import load_settings
from elmo_service.artifact import save_artifact
from elmo_service.embedder import Embedder
from elmo_service.tokenizers import WordTokenizer
from tests.support.core_fixtures import tiny_model
from tests.support.live_server import LiveServer

ADMIN = {"authorization": "Bearer admin"}
USER = {"authorization": "Bearer user"}
SENTENCES = [
    "the bank of the river",
    "boats sail slowly past green fields",
    "people walk every morning",
]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("models")
    for name, seed in (("alpha", 0), ("beta", 1)):
        save_artifact(
            tiny_model(seed),
            WordTokenizer(),
            d / name,
            provenance={"source": "test_models_swap", "seed": seed},
        )
    (d / "not-a-model").mkdir()
    return d


@pytest.fixture(scope="module")
def refs(models_dir):
    out = {}
    for name in ("alpha", "beta"):
        emb = Embedder.load(models_dir / name, threads=1)
        out[emb.version] = {s: emb.embed([s])[0].layers for s in SENTENCES}
    return out


@pytest.fixture
def live(models_dir, redis_server, tmp_path):
    redis_server.flushall()
    s = load_settings(
        models_dir=models_dir,
        model="alpha",
        threads=1,
        data_dir=tmp_path / "data",
        runs_dir=tmp_path / "runs",
        redis_url=redis_server.url,
        api_keys="user",
        admin_keys="admin",
        batch_fill_wait_ms=2,
    )
    with LiveServer(create_app(s)) as srv:
        yield srv


def test_lists_every_artifact_and_marks_the_served_one(live, refs):
    body = httpx.get(live.url + "/v1/models", headers=USER).json()
    assert [m["id"] for m in body["data"]] == ["alpha"]  # OpenAI list: what is served
    arts = {a["id"]: a for a in body["artifacts"]}
    assert sorted(arts) == ["alpha", "beta"]  # folders without a manifest are not models
    assert arts["alpha"]["served"] is True and arts["beta"]["served"] is False
    assert {a["version"] for a in arts.values()} == set(refs)
    assert arts["beta"]["provenance"] == {"source": "test_models_swap", "seed": 1}
    assert arts["beta"]["n_layers"] == 3 and arts["beta"]["tokenizer"] == "word"
    assert body["served"] == {"id": "alpha", "version": arts["alpha"]["version"]}


@pytest.mark.slow
def test_activate_needs_admin_and_a_real_artifact(live):
    url = live.url + "/v1/models/beta/activate"
    assert httpx.post(url).status_code == 401
    r = httpx.post(url, headers=USER)
    assert r.status_code == 403 and r.json()["field"] == "authorization"
    r = httpx.post(live.url + "/v1/models/nope/activate", headers=ADMIN)
    assert r.status_code == 404 and r.json()["field"] == "name"
    r = httpx.post(live.url + "/v1/models/not-a-model/activate", headers=ADMIN)
    assert r.status_code == 404
    for bad in ("..", ".hidden", "..%2F..%2Fetc"):
        r = httpx.post(live.url + f"/v1/models/{bad}/activate", headers=ADMIN)
        assert r.status_code in (404, 422), (bad, r.status_code)
        assert r.json()["code"] in ("not_found", "invalid_input")
    # the served model is unchanged
    assert httpx.get(live.url + "/v1/models", headers=USER).json()["served"]["id"] == "alpha"
    # activating what is served is a no-op
    r = httpx.post(live.url + "/v1/models/alpha/activate", headers=ADMIN)
    assert r.status_code == 200 and r.json()["changed"] is False


@pytest.mark.slow
def test_activate_under_load_fails_no_request(live, refs):
    results: list[tuple[float, float, int, str | None, int]] = []
    lock = threading.Lock()
    stop = threading.Event()

    def client(k: int) -> None:
        with httpx.Client(base_url=live.url, headers=USER, timeout=30) as c:
            for i in range(2000):  # bounded
                if stop.is_set():
                    return
                j = (k + i) % len(SENTENCES)
                t0 = time.monotonic()
                # a fixed sentence (cached after its first time: checks versioned cache keys)
                # and a new one (a cache miss: every request reaches the model's batcher)
                fresh = f"client {k} request {i} sails past the bank"
                r = c.post("/v1/embed", json={"sentences": [SENTENCES[j], fresh]})
                t1 = time.monotonic()
                version = None
                if r.status_code == 200:
                    body = r.json()
                    version = body["model"]["version"]
                    got = np.asarray(body["data"][0]["layers"]["data"], dtype=np.float32)
                    want = refs[version][SENTENCES[j]]
                    assert np.allclose(got, want, atol=1e-5), "vectors of another version"
                with lock:
                    results.append((t0, t1, r.status_code, version, j))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 20
        while len(results) < 30 and time.monotonic() < deadline:
            time.sleep(0.01)
        t_activate = time.monotonic()
        r = httpx.post(live.url + "/v1/models/beta/activate", headers=ADMIN, timeout=60)
        t_done = time.monotonic()
        assert r.status_code == 200, r.text
        assert r.json()["previous"]["id"] == "alpha" and r.json()["activated"]["id"] == "beta"
        n_at_done = len(results)
        while len(results) < n_at_done + 30 and time.monotonic() < deadline + 20:
            time.sleep(0.01)
    finally:
        stop.set()
        for t in threads:
            t.join(30)

    statuses = [s for _, _, s, _, _ in results]
    assert statuses.count(200) == len(statuses), {s: statuses.count(s) for s in set(statuses)}
    v_beta = r.json()["activated"]["version"]
    v_alpha = next(v for v in refs if v != v_beta)
    before = [v for t0, _, _, v, _ in results if t0 < t_activate]
    after = [v for t0, _, _, v, _ in results if t0 > t_done]
    assert before and set(before) == {v_alpha}
    assert after and set(after) == {v_beta}  # the switch is complete once activate answers
    served = httpx.get(live.url + "/v1/models", headers=USER).json()
    assert served["served"]["id"] == "beta"
    assert {a["id"]: a["served"] for a in served["artifacts"]} == {"alpha": False, "beta": True}


def test_models_load_on_threads_that_end(models_dir, tmp_path, monkeypatch):
    """Startup, activation and ``elmo-service serve``'s preload load the model on a thread
    that ends, all through api/loading.py (elmo_service.runtime.in_transient_thread): a
    thread that lives on would keep OpenMP workers beside the batcher's, and libgomp would
    stop spin-waiting in the model's thread (batch-1 calls ~20 % slower, measured)."""
    from fastapi.testclient import TestClient

    import elmo_api.loading
    import elmo_api.server
    import elmo_service.artifact

    loaded_on: list[str] = []

    def spy(real):
        def wrapper(*args, **kwargs):
            loaded_on.append(threading.current_thread().name)
            return real(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(
        elmo_api.loading, "load_served_model", spy(elmo_api.loading.load_served_model)
    )
    settings = dict(
        models_dir=models_dir, model="alpha", threads=1, data_dir=tmp_path / "data",
        runs_dir=tmp_path / "runs", admin_keys="admin",
    )  # fmt: skip
    with TestClient(create_app(load_settings(**settings))) as c:
        assert c.post("/v1/embed", json={"sentences": ["a b"]}).status_code == 200
        assert c.post("/v1/models/beta/activate", headers=ADMIN).status_code == 200
    assert loaded_on == ["elmo-load", "elmo-load"]

    monkeypatch.setattr(
        elmo_service.artifact, "load_artifact", spy(elmo_service.artifact.load_artifact)
    )
    app, _ = elmo_api.server.build(**settings)
    assert app.state.preloaded_artifact.path == models_dir / "alpha"
    assert loaded_on[-1] == "elmo-load"
