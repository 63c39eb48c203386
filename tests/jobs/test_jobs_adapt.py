"""A job that starts from a model (``base_model``): `elmo-pretrain adapt` under the jobs API,
with the progress, cancel, retry and activation of a training job; its submit checks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from elmo_api.main import create_app
from tests.jobs.test_jobs import (
    ADMIN,
    USER,
    dirs,
    http_get,
    settings_for,
    step_at_least,
    wait_job,
)

ADAPT = {"lr": 3e-3, "warmup_steps": 2, "tokens_per_batch": 256, "n_samples": 32, "threads": 1}


def adapt_body(steps: int = 20, **extra: Any) -> dict[str, Any]:
    return {
        "corpus": "corpora/book.txt",
        "base_model": "base",
        "budget": {"steps": steps},
        "adapt": {**ADAPT, "split": "lines"},
        **extra,
    }


@pytest.fixture
def api(tiny_model_dir, tmp_path):
    """The API with its local worker; models/base: a word-tokenized artifact, no softmax."""
    d = dirs(tmp_path)
    shutil.copytree(tiny_model_dir, d["models"] / "base")
    with TestClient(create_app(settings_for(tiny_model_dir, d))) as c:
        c.dirs = d
        yield c


def _reject(c, body: dict[str, Any], field: str, words: str, tmp: Path | None = None) -> None:
    r = c.post("/v1/jobs", json=body, headers=ADMIN)
    assert r.status_code == 422, r.text
    err = r.json()
    assert err["field"] == field and words in err["message"], err
    if tmp is not None:  # #50: a 422 never names the server's folders
        assert str(tmp) not in r.text and str(tmp.resolve()) not in r.text, err


def test_an_adapt_job_is_checked_at_submit(tiny_model_dir, tmp_path):
    d = dirs(tmp_path)
    shutil.copytree(tiny_model_dir, d["models"] / "base")
    s = settings_for(tiny_model_dir, d, jobs_embedded_worker=False)
    with TestClient(create_app(s)) as c:
        _reject(c, adapt_body(base_model="nope"), "base_model", "no model 'nope'", tmp_path)
        # a folder that is not a model: the reason, with the folder relative to models/
        (d["models"] / "empty").mkdir()
        _reject(c, adapt_body(base_model="empty"), "base_model", "models/empty", tmp_path)
        _reject(c, adapt_body(config={"optim": {"lr": 1.0}}), "config", "base_model")
        _reject(c, adapt_body(prepare={"vocab_size": 50}), "prepare", "base_model")
        _reject(c, adapt_body(adapt={"lr": -1}), "adapt.lr", "")
        _reject(c, adapt_body(adapt={"work_dir": "/tmp"}), "adapt.work_dir", "")
        r = c.post("/v1/jobs", json=adapt_body(name="mine"), headers=ADMIN)
        assert r.status_code == 202, r.text
        rec = r.json()
        # the base model's shape, the adaptation's optimizer: what the worker will run
        assert rec["train_config"]["model"]["lstm_dim"] == 16  # tests/support/configs.py
        assert rec["train_config"]["optim"]["lr"] == ADAPT["lr"]
        assert rec["progress"]["total_steps"] == 20


@pytest.mark.slow
def test_an_adapt_job_runs_reports_progress_and_its_model_is_activated(api):
    c = api
    r = c.post("/v1/jobs", json=adapt_body(name="adapted"), headers=ADMIN)
    assert r.status_code == 202, r.text
    rec = wait_job(http_get(c), r.json()["id"], lambda j: j["state"] == "succeeded", 120)
    p = rec["progress"]
    assert p["step"] == p["total_steps"] == 20 and p["tokens_seen"] > 0 and p["loss"] > 0
    art = rec["artifact"]
    assert art["name"] == "adapted" and art["step"] == 20 and art["heldout"]["avg_ppl"] > 1
    assert any("phase train: elmo-pretrain adapt" in x for x in rec["log_tail"]), rec["log_tail"]
    prov = json.loads((c.dirs["models"] / "adapted" / "config.json").read_text())["provenance"]
    before, after = prov["adapt"]["heldout_before"]["avg_ppl"], prov["heldout"]["avg_ppl"]
    assert after < before and prov["adapt"]["from"]["model"] == "base"
    r = c.post("/v1/models/adapted/activate", headers=ADMIN)
    assert r.status_code == 200, r.text
    r = c.post("/v1/embed", json={"sentences": ["The farmer sees the river."]}, headers=USER)
    assert r.status_code == 200 and r.json()["model"]["id"] == "adapted"


@pytest.mark.slow
def test_an_adapt_job_cancels_with_a_checkpoint_and_a_retry_resumes_it(api):
    c = api
    get = http_get(c)
    job_id = c.post("/v1/jobs", json=adapt_body(steps=100_000), headers=ADMIN).json()["id"]
    wait_job(get, job_id, step_at_least(5), 90, "adapting")
    assert c.post(f"/v1/jobs/{job_id}/cancel", headers=ADMIN).status_code == 200
    # no wall-clock bound: ignoring the cancel would adapt on toward 100000 steps instead
    rec = wait_job(get, job_id, lambda j: j["state"] == "cancelled", 120, "cancelled")
    ck = rec["progress"]["checkpoint"]
    assert ck and (Path(rec["run_dir"]) / "adapt" / "run" / "checkpoints" / ck).is_file()
    assert not (c.dirs["models"] / job_id).exists()
    stopped_at = rec["progress"]["step"]
    r = c.post(f"/v1/jobs/{job_id}/retry", headers=ADMIN)
    assert r.status_code == 202, r.text
    rec = wait_job(get, job_id, step_at_least(stopped_at + 3), 90, "adapting again")
    assert rec["attempt"] == 2
    log = (Path(rec["run_dir"]) / "job.log").read_text()
    assert f"resumed from {ck}" in log and "adapt" in log and "--resume" in log
    assert c.post(f"/v1/jobs/{job_id}/cancel", headers=ADMIN).status_code == 200
    wait_job(get, job_id, lambda j: j["state"] == "cancelled", 30, "cancelled again")
