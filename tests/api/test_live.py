"""A live uvicorn server on 127.0.0.1: many concurrent clients, the official
``openai`` client, ``elmo_api.server``, /docs, and import safety of ``elmo_api.main``."""

from __future__ import annotations

import base64
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from elmo_api.encoding import decode_array
from elmo_api.main import create_app
from elmo_api.settings import load_settings
from elmo_service.embedder import Embedder, apply_mix
from elmo_service.scalar_mix import MixSpec
from tests.support.determinism import same_vectors
from tests.support.live_server import LiveServer

pytestmark = pytest.mark.slow  # a live uvicorn server, subprocesses

WORDS = [
    "the",
    "a",
    "bank",
    "river",
    "money",
    "rates",
    "sat",
    "on",
    "watched",
    "boats",
    "we",
    "they",
    "raised",
    "lowered",
    "city",
    "old",
    "new",
    "red",
]


def _sentence(i: int) -> str:
    rng = np.random.default_rng(i)
    n = int(rng.integers(1, 14))
    return " ".join(rng.choice(WORDS, n)) + f" s{i} ."


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    return Embedder.load(tiny_model_dir, threads=1)


@pytest.fixture(scope="module")
def live(tiny_model_dir, redis_server, tmp_path_factory):
    redis_server.flushall()
    s = load_settings(
        model_path=tiny_model_dir,
        threads=1,
        data_dir=tmp_path_factory.mktemp("d"),
        redis_url=redis_server.url,
        admin_keys="admin",
    )
    app = create_app(s)
    with LiveServer(app) as srv:
        srv.app = app
        yield srv


def test_many_concurrent_clients_get_their_own_answers(live, ref):
    n_clients, per_client = 12, 8
    sentences = {
        c: [[_sentence(c * 100 + k) for k in range(1 + (c + r) % 3)] for r in range(per_client)]
        for c in range(n_clients)
    }
    all_sents = sorted({s for reqs in sentences.values() for req in reqs for s in req})
    want = dict(zip(all_sents, (e.layers for e in ref.embed(all_sents)), strict=True))
    barrier = threading.Barrier(n_clients)
    failures: list[str] = []

    def client(c: int) -> int:
        checked = 0
        with httpx.Client(base_url=live.url, timeout=30) as http:
            barrier.wait()
            for req in sentences[c]:
                enc = "base64" if c % 2 else "json"
                r = http.post("/v1/embed", json={"sentences": req, "encoding": enc})
                if r.status_code != 200:
                    failures.append(r.text)
                    continue
                for s, d in zip(req, r.json()["data"], strict=True):
                    toks = [t["text"] for t in d["tokens"]]
                    if toks != s.split() or not same_vectors(decode_array(d["layers"]), want[s]):
                        failures.append(f"client {c}: wrong vectors for {s!r}")
                    checked += 1
        return checked

    with ThreadPoolExecutor(n_clients) as pool:
        checked = sum(pool.map(client, range(n_clients)))
    assert not failures, failures[:3]
    assert checked == sum(len(req) for reqs in sentences.values() for req in reqs)
    metrics = httpx.get(live.url + "/metrics").text
    assert "elmo_batch_sentences_bucket" in metrics
    # some model batches merged sentences from several requests
    runner = live.app.state.holder.current.runner
    assert runner.sentences_run > runner.batches_run


def test_openai_client(live, ref):
    from openai import OpenAI

    client = OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
    texts = ["The bank raised rates .", "We sat on the river bank ."]
    want = [apply_mix(e.layers, MixSpec.average(3)).mean(axis=0) for e in ref.embed(texts)]
    want = [w / np.linalg.norm(w) for w in want]  # unit length, as OpenAI's

    for fmt in ("float", "base64", None):
        kwargs = {} if fmt is None else {"encoding_format": fmt}  # None: the client picks (base64)
        resp = client.embeddings.create(model="tiny", input=texts, **kwargs)
        assert resp.object == "list" and resp.model == "tiny"
        assert [d.index for d in resp.data] == [0, 1]
        for d, w in zip(resp.data, want, strict=True):
            emb = d.embedding
            if isinstance(emb, str):
                emb = np.frombuffer(base64.b64decode(emb), dtype="<f4")
            assert len(emb) == ref.dim
            assert np.abs(np.asarray(emb, dtype=np.float32) - w).max() <= 1e-5
        n_tokens = sum(len(t.split()) for t in texts)
        assert resp.usage.prompt_tokens == n_tokens and resp.usage.total_tokens == n_tokens

    single = client.embeddings.create(model="tiny", input=texts[0], encoding_format="float")
    assert (
        len(single.data) == 1 and np.abs(np.array(single.data[0].embedding) - want[0]).max() <= 1e-5
    )
    assert (
        len(client.embeddings.create(model="tiny", input="x", dimensions=ref.dim).data[0].embedding)
        == ref.dim
    )

    import openai

    with pytest.raises(openai.BadRequestError) as e:  # OpenAI's own error body and status
        client.embeddings.create(model="tiny", input="x", dimensions=8)
    assert e.value.body["param"] == "dimensions" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="x")
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_models_endpoint(live, ref):
    body = httpx.get(live.url + "/v1/models").json()
    (m,) = body["data"]
    assert m["id"] == "tiny" and m["version"] == ref.version
    assert (
        m["config"]["lstm_dim"] == ref.cfg.lstm_dim and m["n_layers"] == 3 and m["dim"] == ref.dim
    )
    assert m["provenance"] == {"source": "tests/conftest.py", "weights": "random"}
    assert m["tasks_shipped"] == ["shipped"]
    assert httpx.get(live.url + "/v1/models/tiny").json()["version"] == ref.version


def test_docs_and_openapi_examples(live):
    assert httpx.get(live.url + "/docs").status_code == 200
    spec = httpx.get(live.url + "/openapi.json").json()
    paths = spec["paths"]
    for p in (
        "/v1/embed",
        "/v1/embeddings",
        "/v1/models",
        "/v1/tasks",
        "/v1/tasks/{name}",
        "/healthz",
        "/readyz",
        "/metrics",
    ):
        assert p in paths, p
    schemas = spec["components"]["schemas"]
    assert schemas["EmbedRequest"].get("examples")
    assert schemas["EmbeddingsRequest"].get("examples")
    assert schemas["TaskIn"].get("examples")
    assert "413" in paths["/v1/embed"]["post"]["responses"]


def test_metrics_by_route_and_status(live):
    httpx.post(live.url + "/v1/embed", json={"sentences": []})
    httpx.post(live.url + "/v1/embed", json={"sentences": ["count me"]})
    text = httpx.get(live.url + "/metrics").text
    assert 'elmo_requests_total{method="POST",route="/v1/embed",status="200"}' in text
    assert 'elmo_requests_total{method="POST",route="/v1/embed",status="422"}' in text
    assert (
        'elmo_request_duration_seconds_bucket{le="0.005",method="POST",route="/v1/embed",status="200"}'
        in text
    )
    for name in ("elmo_queue_depth", "elmo_batch_tokens_bucket", "elmo_tokens_total", "elmo_cache_hits_total",
                 "elmo_cache_misses_total", "elmo_model_info"):  # fmt: skip
        assert name in text, name


def test_readyz_before_ready_is_503(tiny_model_dir, tmp_path):
    app = create_app(load_settings(model_path=tiny_model_dir, threads=1, data_dir=tmp_path))
    from fastapi.testclient import TestClient

    c = TestClient(app, raise_server_exceptions=False)  # no lifespan: the model is not loaded
    r = c.get("/readyz")
    assert r.status_code == 503 and r.json()["code"] == "not_ready"
    assert c.get("/healthz").status_code == 200
    r = c.post("/v1/embed", json={"sentences": ["a"]})
    assert r.status_code == 503 and r.json()["code"] == "not_ready"


def test_importing_api_main_loads_no_model_and_reads_no_settings(tmp_path):
    code = (
        "import sys, elmo_api.main as m; "
        "assert m.app.state.settings is None; "
        "assert m.app.state.holder.current is None; "
        "assert 'elmo_service.embedder' not in sys.modules; print('ok')"
    )
    env = {"ELMO_THREADS": "not-a-number", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_server_run_serves_the_model(tiny_model_dir, tmp_path):
    """``elmo_api.server.run`` (what ``elmo-service serve`` calls) in a subprocess on a free port."""
    from tests.support.ports import free_port

    port = free_port()
    code = (
        "import elmo_api.server as s; "
        f"s.run('127.0.0.1', {port}, {str(tiny_model_dir)!r}, threads=1, data_dir={str(tmp_path)!r}, log_level='warning')"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path)
    try:
        import time

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, "server exited"
            time.sleep(0.1)
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/embed", json={"sentences": ["served"]}, timeout=10
        )
        assert r.status_code == 200 and r.json()["model"]["id"] == "tiny"
    finally:
        proc.terminate()
        proc.wait(30)


def test_server_run_rejects_bad_settings(tiny_model_dir):
    from elmo_api.server import run
    from elmo_service.errors import ArtifactError, ConfigError

    with pytest.raises(ConfigError, match="ELMO_MAX_QUEUE"):
        run("127.0.0.1", 1, tiny_model_dir, max_queue=0)
    with pytest.raises(ArtifactError, match="does not exist"):
        run("127.0.0.1", 1, tiny_model_dir.parent / "no-such-model")
