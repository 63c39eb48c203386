"""#28 item 8: the served artifact's folder replaced (``export --overwrite``) or deleted
under a running server. The server keeps the weights it loaded, so it keeps their shipped
tasks too (never the new folder's, labelled with the old version); ``/v1/models``
describes what is served and says what the folder holds now; #32 item 11: the listing
carries provenance summaries, the whole records behind ``?full=true``. Every embedding
answer names the version that computed it (``X-Model-Version``)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from elmo_api.main import create_app
from elmo_api.settings import load_settings
from elmo_service.artifact import read_manifest, save_artifact
from elmo_service.embedder import Embedder, apply_mix
from elmo_service.scalar_mix import MixSpec
from elmo_service.tokenizers import WordTokenizer
from tests.support.core_fixtures import tiny_model

torch.set_num_threads(1)

OLD_TASK = MixSpec(weights=[0.5, 1.0, -0.5], gamma=0.7)
NEW_TASK = MixSpec(weights=[0.0, 0.0, 5.0], gamma=2.0)
BIG_PROVENANCE = {
    "run": "r1",
    "step": 12,
    "heldout": {"avg_ppl": 85.9, "sentences": 2530},
    "corpus": {"params_hash": "ecba", "sources": [{"name": f"s{i}", "sha256": "0" * 64} for i in range(200)]},
    "training_config": {"optim": {"lr": 0.1}, "train": {"steps": 10}},
}  # fmt: skip


@pytest.fixture
def models(tmp_path):
    root = tmp_path / "models"
    save_artifact(tiny_model(0), WordTokenizer(), root / "m", BIG_PROVENANCE, {"mix": OLD_TASK})
    return root


def _client(models, tmp_path):
    settings = load_settings(
        models_dir=models, model="m", threads=1, data_dir=tmp_path / "data", admin_keys="admin"
    )
    return TestClient(create_app(settings))


def _mix(c, task: str) -> np.ndarray:
    r = c.post("/v1/embed", json={"sentences": ["the cat sat"], "output": "mix", "task": task})
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["data"][0]["mix"]["data"])


def test_a_replaced_folder_lends_neither_its_tasks_nor_its_description(models, tmp_path):
    old_version = read_manifest(models / "m")["version"]
    ref = Embedder.load(models / "m", threads=1).embed(["the cat sat"])[0].layers
    with _client(models, tmp_path) as c:
        assert np.allclose(_mix(c, "mix"), apply_mix(ref, OLD_TASK), atol=1e-5)
        # the documented `export --overwrite` into the served folder, then `probe --store`
        save_artifact(
            tiny_model(1, projection_dim=4),
            WordTokenizer(),
            models / "m",
            {"run": "r2"},
            {"mix": NEW_TASK, "extra": NEW_TASK},
            overwrite=True,
        )
        new_version = read_manifest(models / "m")["version"]
        assert new_version != old_version
        tasks = {t["name"] for t in c.get("/v1/tasks").json()["data"]}
        assert tasks == {"mix"}  # not the new folder's "extra"
        assert np.allclose(_mix(c, "mix"), apply_mix(ref, OLD_TASK), atol=1e-5)

        body = c.get("/v1/models").json()
        (entry,) = [a for a in body["artifacts"] if a["served"]]
        assert entry["version"] == old_version == body["served"]["version"]
        assert entry["dim"] == 16 and entry["provenance"]["run"] == "r1"  # as loaded
        assert entry["disk_version"] == new_version  # ... and what the folder holds now

        shutil.rmtree(models / "m")  # deleting the served folder
        assert {t["name"] for t in c.get("/v1/tasks").json()["data"]} == {"mix"}
        assert np.allclose(_mix(c, "mix"), apply_mix(ref, OLD_TASK), atol=1e-5)
        (entry,) = c.get("/v1/models").json()["artifacts"]
        assert entry["served"] and entry["version"] == old_version and entry["disk_error"]


def test_models_listing_summarises_provenance_and_full_gives_it_whole(models, tmp_path):
    with _client(models, tmp_path) as c:
        r = c.get("/v1/models")
        assert r.status_code == 200
        (entry,) = r.json()["artifacts"]
        prov = entry["provenance"]
        assert prov == {
            "run": "r1",
            "step": 12,
            "heldout": {"avg_ppl": 85.9, "sentences": 2530},
            "corpus": {"params_hash": "ecba"},
        }
        assert r.json()["data"][0]["provenance"] == prov
        full = c.get("/v1/models", params={"full": "true"})
        assert full.json()["artifacts"][0]["provenance"] == BIG_PROVENANCE
        assert full.json()["data"][0]["provenance"] == BIG_PROVENANCE
        assert len(r.content) * 3 < len(full.content)
        assert c.get("/v1/models/m").json()["provenance"] == BIG_PROVENANCE
        fleet = r.json()["fleet"]  # no Redis: a fleet of one
        assert not fleet["shared"] and fleet["agree"] and fleet["replicas_total"] == 1


def test_every_embedding_answer_names_the_version_that_computed_it(models, tmp_path):
    version = read_manifest(models / "m")["version"]
    with _client(models, tmp_path) as c:
        r = c.post("/v1/embed", json={"sentences": ["a b"]})
        assert r.headers["x-model-version"] == version == r.json()["model"]["version"]
        assert r.headers["x-model-id"] == "m"
        r = c.post("/v1/embeddings", json={"model": "m", "input": "a b"})
        assert r.status_code == 200 and r.headers["x-model-version"] == version
        assert "x-model-version" not in c.get("/healthz").headers
        json.dumps(r.json())  # a plain JSON body
