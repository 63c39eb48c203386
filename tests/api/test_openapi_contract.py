"""The OpenAPI document is true to what the routes return, and its examples work.

Every route in the document is called for real; every response (200s and
errors) is validated with jsonschema against the schema the document gives for
that status. Object schemas are closed here (``additionalProperties: false``
where the document lists properties), so an undocumented field fails too.
Every request example shown at /docs is posted and must be accepted.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from fastapi.testclient import TestClient

from elmo_api.main import create_app
from elmo_api.routers.document import DocumentRequest
from elmo_api.schemas import EmbeddingsRequest, EmbedRequest, TaskIn
from elmo_api.settings import load_settings
from tests.jobs.test_jobs import write_corpus
from tests.support.core_fixtures import tiny_artifact

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "default"

ADMIN = {"Authorization": "Bearer admin-key"}


def _close_objects(node: Any) -> Any:
    """Every object schema that lists its properties allows no others (a copy)."""
    if isinstance(node, dict):
        node = {k: _close_objects(v) for k, v in node.items()}
        if "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
        return node
    if isinstance(node, list):
        return [_close_objects(v) for v in node]
    return node


class Contract:
    """Checks responses against the app's own OpenAPI document; records what was checked."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.components = _close_objects(copy.deepcopy(spec.get("components", {})))
        self.checked: set[tuple[str, str]] = set()

    def check(self, method: str, path: str, r) -> Any:
        op = self.spec["paths"][path][method.lower()]
        status = str(r.status_code)
        assert status in op["responses"], f"{method} {path}: status {status} is not documented"
        content = op["responses"][status].get("content", {})
        ctype = r.headers.get("content-type", "").split(";")[0]
        assert ctype in content, f"{method} {path} {status}: {ctype} not documented ({content})"
        schema = _close_objects(content[ctype].get("schema", {}))
        body = r.json() if ctype == "application/json" else r.text
        root = {**schema, "components": self.components}
        jsonschema.Draft202012Validator(root).validate(body)
        self.checked.add((method.upper(), path))
        return body


@pytest.fixture(scope="module")
def api(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("contract")
    models = root / "models"
    # the bundled model, as `make serve` serves it: the docs examples must work there
    shutil.copytree(BUNDLED, models / "default")
    tiny_artifact(models / "beta", seed=5)
    write_corpus(root / "data" / "corpora" / "book.txt")  # the job example's corpus
    s = load_settings(
        models_dir=models, model="default", threads=1, data_dir=root / "data",
        runs_dir=root / "runs", admin_keys="admin-key", jobs_embedded_worker=False,
    )  # fmt: skip
    app = create_app(s)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c, Contract(app.openapi())


def _examples(model) -> list[dict[str, Any]]:
    return model.model_config["json_schema_extra"]["examples"]


@pytest.mark.slow
def test_every_route_returns_what_the_document_says(api):
    c, contract = api
    ok = contract.check
    for i, example in enumerate(_examples(TaskIn)):
        r = c.put("/v1/tasks/ner", json=example, headers=ADMIN)
        assert r.status_code == (201 if i == 0 else 200), r.text
        ok("PUT", "/v1/tasks/{name}", r)
    ok("GET", "/v1/tasks", c.get("/v1/tasks"))
    ok("GET", "/v1/tasks/{name}", c.get("/v1/tasks/pos"))
    ok("GET", "/v1/tasks/{name}", c.get("/v1/tasks/nope"))  # 404
    ok("PUT", "/v1/tasks/{name}", c.put("/v1/tasks/x", json={"weights": [1]}, headers=ADMIN))

    for example in _examples(EmbedRequest):
        r = c.post("/v1/embed", json=example)
        assert r.status_code == 200, (example, r.text)
        ok("POST", "/v1/embed", r)
    for body in (
        {"sentences": ["Words, pooled."], "output": "both", "granularity": "word"},
        {"sentences": ["Max."], "pooling": "max", "encoding": "base64", "dtype": "float16"},
        {"sentences": ["a"], "layers": ["0"]},  # 422
        {"sentences": ["a"] * 10_000},  # 413
    ):
        ok("POST", "/v1/embed", c.post("/v1/embed", json=body))
    for example in _examples(DocumentRequest):
        r = c.post("/v1/embed/document", json=example)
        assert r.status_code == 200, (example, r.text)
        ok("POST", "/v1/embed/document", r)
    for body in ({"document": ""}, {"document": "a", "chunk_tokens": 10**6}):  # 422, 413
        ok("POST", "/v1/embed/document", c.post("/v1/embed/document", json=body))
    for example in _examples(EmbeddingsRequest):
        r = c.post("/v1/embeddings", json=example)
        assert r.status_code == 200, (example, r.text)
        ok("POST", "/v1/embeddings", r)
    r = c.post(
        "/v1/embeddings", json={"input": "x", "model": "default", "encoding_format": "base64"}
    )
    ok("POST", "/v1/embeddings", r)
    ok("POST", "/v1/embeddings", c.post("/v1/embeddings", json={"input": "x", "model": "gpt"}))
    r = c.post("/v1/embeddings", json={"input": [[9906, 1917]], "model": "default"})  # ids
    ok("POST", "/v1/embeddings", r)
    ok("POST", "/v1/embeddings", c.post("/v1/embeddings", json={"input": [[-1]], "model": "x"}))
    # TEI's routes, answers and errors in TEI's shapes
    for path in ("/embed", "/embed_all", "/"):
        ok("POST", path, c.post(path, json={"inputs": ["A river bank.", "x"]}))
        ok("POST", path, c.post(path, json={"inputs": 7}))  # 422
    ok("POST", "/tokenize", c.post("/tokenize", json={"inputs": "A river bank."}))
    ok("POST", "/tokenize", c.post("/tokenize", json={"inputs": []}))  # 422
    ok("GET", "/info", c.get("/info"))

    ok("GET", "/v1/models", c.get("/v1/models"))
    limits = ok("GET", "/v1/limits", c.get("/v1/limits"))
    assert limits["max_sentences"] == c.app.state.settings.max_sentences
    ok("GET", "/v1/models/{model_id}", c.get("/v1/models/default"))
    ok("GET", "/v1/models/{model_id}", c.get("/v1/models/other"))  # 404
    (tmp := c.app.state.settings.models_dir / "broken").mkdir()
    (tmp / "manifest.json").write_text("{not json")  # listed with its error
    listed = ok("GET", "/v1/models", c.get("/v1/models"))
    assert any("error" in a for a in listed["artifacts"])
    activate = "/v1/models/{name}/activate"
    r = c.post("/v1/models/beta/activate", headers=ADMIN)
    assert ok("POST", activate, r)["changed"] is True
    r = c.post("/v1/models/default/activate", headers=ADMIN)
    assert ok("POST", activate, r)["previous"]["id"] == "beta"
    ok("POST", activate, c.post("/v1/models/default/activate", headers=ADMIN))  # no change
    ok("POST", activate, c.post("/v1/models/default%00/activate", headers=ADMIN))  # 422
    ok("POST", activate, c.post("/v1/models/beta/activate"))  # 401

    ok("DELETE", "/v1/tasks/{name}", c.delete("/v1/tasks/ner", headers=ADMIN))
    ok("DELETE", "/v1/tasks/{name}", c.delete("/v1/tasks/ner", headers=ADMIN))  # 404
    ok("DELETE", "/v1/tasks/{name}", c.delete("/v1/tasks/pos", headers=ADMIN))  # 409: shipped

    (job,) = _examples_job()
    r = c.post("/v1/jobs", json=job, headers=ADMIN)
    assert r.status_code == 202, r.text
    job_id = ok("POST", "/v1/jobs", r)["id"]
    ok("POST", "/v1/jobs", c.post("/v1/jobs", json={"corpus": "x"}, headers=ADMIN))  # 422
    ok("GET", "/v1/jobs", c.get("/v1/jobs", headers=ADMIN))
    ok("GET", "/v1/jobs/{job_id}", c.get(f"/v1/jobs/{job_id}", headers=ADMIN))
    ok("POST", "/v1/jobs/{job_id}/cancel", c.post(f"/v1/jobs/{job_id}/cancel", headers=ADMIN))
    retry = "/v1/jobs/{job_id}/retry"
    ok("POST", retry, c.post(f"/v1/jobs/{job_id}/retry", headers=ADMIN))  # 409: not failed yet
    ok("POST", retry, c.post("/v1/jobs/jnosuch/retry", headers=ADMIN))  # 404

    selftest = ok("GET", "/v1/selftest", c.get("/v1/selftest", headers=ADMIN))
    assert selftest["ok"] is True  # the bundled model's stored vectors, served
    ok("GET", "/v1/selftest", c.get("/v1/selftest"))  # 401
    ok("GET", "/healthz", c.get("/healthz"))
    assert ok("GET", "/readyz", c.get("/readyz"))["status"] == "ready"
    assert "elmo_requests_total" in ok("GET", "/metrics", c.get("/metrics"))

    documented = {
        (m.upper(), p)
        for p, ops in contract.spec["paths"].items()
        for m in ops
        if m != "parameters"
    }
    assert documented - contract.checked == set(), "routes never checked"


def _examples_job() -> list[dict[str, Any]]:
    from elmo_jobs import JobIn

    return _examples(JobIn)


@pytest.mark.slow
def test_readyz_while_loading_matches_its_documented_503(tiny_model_dir, tmp_path):
    app = create_app(load_settings(model_path=tiny_model_dir, threads=1, data_dir=tmp_path))
    contract = Contract(app.openapi())
    with TestClient(app) as c:
        holder = app.state.holder
        served, holder._current = holder._current, None  # as during start-up
        try:
            body = contract.check("GET", "/readyz", c.get("/readyz"))
            assert body["status"] == "starting"
        finally:
            holder._current = served
