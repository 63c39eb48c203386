"""Tasks: list/get/put/delete, validation against the layer count, shipped tasks
read-only but overridable, persistence in a JSON file or in a real Redis."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from elmo_api.encoding import decode_array
from elmo_api.main import create_app
from elmo_api.settings import load_settings
from elmo_service.embedder import Embedder, apply_mix
from elmo_service.scalar_mix import MixSpec

ADMIN = {"authorization": "Bearer admin"}


def _app(model_dir, tmp_path, **kw):
    return create_app(
        load_settings(model_path=model_dir, threads=1, data_dir=tmp_path, admin_keys="admin", **kw)
    )


@pytest.fixture(params=["file", "redis"])
def store(request, tmp_path):
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        server.flushall()
        return {"redis_url": server.url}
    return {"tasks_file": tmp_path / "tasks.json"}


def test_crud_validation_and_use_in_embed(tiny_model_dir, tmp_path, store):
    with TestClient(_app(tiny_model_dir, tmp_path, **store)) as c:
        listed = c.get("/v1/tasks").json()
        assert listed["n_layers"] == 3
        assert [(t["name"], t["source"], t["read_only"]) for t in listed["data"]] == [
            ("shipped", "model", True)
        ]

        spec = {"weights": [0.0, 1.0, 2.0], "gamma": 0.5, "meta": {"note": "test"}}
        r = c.put("/v1/tasks/pos", json=spec, headers=ADMIN)
        assert r.status_code == 201 and r.json()["source"] == "store"
        r = c.put("/v1/tasks/pos", json={**spec, "gamma": 0.25}, headers=ADMIN)
        assert r.status_code == 200 and r.json()["gamma"] == 0.25
        got = c.get("/v1/tasks/pos").json()
        assert got["weights"] == [0.0, 1.0, 2.0] and got["meta"] == {"note": "test"}
        assert [t["name"] for t in c.get("/v1/tasks").json()["data"]] == ["pos", "shipped"]

        # validated against the model's layer count, with the expected count in the message
        r = c.put("/v1/tasks/bad", json={"weights": [1.0, 2.0]}, headers=ADMIN)
        assert (
            r.status_code == 422
            and r.json()["field"] == "weights"
            and "3 weights" in r.json()["message"]
        )
        r = c.put(
            "/v1/tasks/bad", json={"weights": [1, 2, 3], "per_direction": True}, headers=ADMIN
        )
        assert r.status_code == 422 and "5 weights" in r.json()["message"]
        r = c.put(
            "/v1/tasks/pd", json={"weights": [1, 2, 3, 4, 5], "per_direction": True}, headers=ADMIN
        )
        assert r.status_code == 201
        r = c.put("/v1/tasks/bad name!", json=spec, headers=ADMIN)
        assert r.status_code == 422 and r.json()["field"] == "name"

        # the stored task drives /v1/embed
        ref = Embedder.load(tiny_model_dir, threads=1)
        layers = ref.embed(["Tasks mix layers ."])[0].layers
        body = c.post("/v1/embed", json={"sentences": ["Tasks mix layers ."], "task": "pos"}).json()
        want = apply_mix(layers, MixSpec([0.0, 1.0, 2.0], 0.25))
        assert np.abs(decode_array(body["data"][0]["mix"]) - want).max() <= 1e-5

        assert c.delete("/v1/tasks/pos", headers=ADMIN).json()["deleted"] == "pos"
        assert c.get("/v1/tasks/pos").status_code == 404
        assert c.delete("/v1/tasks/pos", headers=ADMIN).status_code == 404

    # persisted: a new app (same store) still has "pd"
    with TestClient(_app(tiny_model_dir, tmp_path, **store)) as c:
        assert c.get("/v1/tasks/pd").json()["per_direction"] is True


def test_shipped_tasks_read_only_but_overridable(tiny_model_dir, tmp_path, store):
    with TestClient(_app(tiny_model_dir, tmp_path, **store)) as c:
        r = c.delete("/v1/tasks/shipped", headers=ADMIN)
        assert r.status_code == 409 and r.json()["code"] == "read_only"
        shipped = c.get("/v1/tasks/shipped").json()
        assert shipped["source"] == "model" and shipped["gamma"] == 0.7
        r = c.put("/v1/tasks/shipped", json={"weights": [1, 1, 1], "gamma": 2.0}, headers=ADMIN)
        assert r.status_code == 201 and r.json()["overrides_model"] is True
        assert c.get("/v1/tasks/shipped").json()["gamma"] == 2.0
        assert c.delete("/v1/tasks/shipped", headers=ADMIN).json()["model_task_visible"] is True
        assert c.get("/v1/tasks/shipped").json()["gamma"] == 0.7


def test_default_task_drives_default_mix_and_openai(tiny_model_dir, tmp_path):
    with TestClient(_app(tiny_model_dir, tmp_path)) as c:
        text = "Default mixes ."
        before = c.post("/v1/embeddings", json={"input": text, "model": "tiny"}).json()["data"][0][
            "embedding"
        ]
        assert (
            c.put("/v1/tasks/default", json={"weights": [5, 0, 0]}, headers=ADMIN).status_code
            == 201
        )
        after = c.post("/v1/embeddings", json={"input": text, "model": "tiny"}).json()["data"][0][
            "embedding"
        ]
        ref = Embedder.load(tiny_model_dir, threads=1)
        layers = ref.embed([text])[0].layers

        def unit(v):  # /v1/embeddings answers unit length, as OpenAI's API does
            return v / np.linalg.norm(v)

        want_before = unit(apply_mix(layers, MixSpec.average(3)).mean(0))
        assert np.abs(np.array(before) - want_before).max() <= 1e-5
        want_after = unit(apply_mix(layers, MixSpec([5, 0, 0])).mean(0))
        assert np.abs(np.array(after) - want_after).max() <= 1e-5
        body = c.post("/v1/embed", json={"sentences": [text], "output": "mix"}).json()
        assert body["task"] == "default"


def test_file_store_layout(tiny_model_dir, tmp_path):
    path = tmp_path / "t.json"
    with TestClient(_app(tiny_model_dir, tmp_path, tasks_file=path)) as c:
        c.put("/v1/tasks/a", json={"weights": [0, 0, 0]}, headers=ADMIN)
    data = json.loads(path.read_text())
    assert data["tiny"]["a"]["weights"] == [0.0, 0.0, 0.0]  # namespaced by model name


def test_redis_store_outage_answers_503_json(redis_server_factory, tiny_model_dir, tmp_path):
    server = redis_server_factory()
    with TestClient(_app(tiny_model_dir, tmp_path, redis_url=server.url)) as c:
        assert (
            c.put("/v1/tasks/keep", json={"weights": [0, 1, 0]}, headers=ADMIN).status_code == 201
        )
        assert c.post("/v1/embed", json={"sentences": ["x"], "task": "keep"}).status_code == 200
        server.stop()
        r = c.put("/v1/tasks/other", json={"weights": [0, 1, 0]}, headers=ADMIN)
        assert r.status_code == 503 and r.json()["code"] == "store_unavailable"
        # embedding with a task seen before, or with a shipped one, still works
        assert c.post("/v1/embed", json={"sentences": ["x"], "task": "keep"}).status_code == 200
        assert c.post("/v1/embed", json={"sentences": ["x"], "task": "shipped"}).status_code == 200
        assert c.get("/v1/tasks").status_code == 200


def test_task_stored_in_the_artifact_is_served_without_a_restart(tiny_model_dir, tmp_path):
    """`elmo-pretrain probe --store` writes MODEL/tasks/NAME.json while the server runs."""
    import shutil

    from elmo_service.artifact import write_task

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    data = tmp_path / "data"
    data.mkdir()
    with TestClient(_app(model, data)) as c:
        assert [t["name"] for t in c.get("/v1/tasks").json()["data"]] == ["shipped"]
        assert c.get("/v1/tasks/fresh").status_code == 404
        write_task(model, "fresh", MixSpec(weights=[0.0, 0.0, 5.0], gamma=2.0))
        listed = {t["name"]: t for t in c.get("/v1/tasks").json()["data"]}
        assert set(listed) == {"fresh", "shipped"}
        assert listed["fresh"]["source"] == "model" and listed["fresh"]["gamma"] == 2.0
        body = {"sentences": ["the cat sat"], "output": "mix", "task": "fresh"}
        r = c.post("/v1/embed", json=body)
        assert r.status_code == 200, r.text
        want = Embedder.load(model, threads=1).embed(["the cat sat"])[0]
        got = np.asarray(r.json()["data"][0]["mix"]["data"])
        ref = apply_mix(want.layers, MixSpec(weights=[0.0, 0.0, 5.0], gamma=2.0))
        assert np.allclose(got, ref, atol=1e-5)
        # a file that is not a valid task is skipped (logged), the others stay served
        (model / "tasks" / "broken.json").write_text('{"weights": [1.0]}')
        assert {t["name"] for t in c.get("/v1/tasks").json()["data"]} == {"fresh", "shipped"}
        (model / "tasks" / "fresh.json").unlink()
        assert c.get("/v1/tasks/fresh").status_code == 404
        r = c.post("/v1/embed", json=body)
        assert r.status_code in (404, 422) and r.json()["field"] == "task", r.text
