"""Pretraining jobs through the API, without Redis (the local worker process):
validation (corpus path, config fields, auth), a tiny job to success whose model is
then activated and served, cancel (with a checkpoint), and a SIGKILLed worker's
job resumed by the next worker. The rq path is in ``test_jobs_rq.py``; both use
the helpers here."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from elmo_api.main import create_app
from elmo_api.settings import load_settings

ADMIN = {"authorization": "Bearer admin"}
USER = {"authorization": "Bearer user"}
POLL = 0.2  # ELMO_JOBS_POLL_INTERVAL in these tests

# a configs/tiny.yaml-like network: a job of 40 steps takes a few seconds on one core
TINY_CONFIG: dict[str, Any] = {
    "model": {
        "char_dim": 4,
        "filters": [[1, 8], [2, 8]],
        "n_highway": 1,
        "projection_dim": 8,
        "lstm_dim": 16,
        "n_layers": 2,
        "dropout": 0.0,
        "max_sentence_tokens": 64,
    },
    "data": {"tokens_per_batch": 256, "max_tokens": 48, "pad_multiple": 8},
    "softmax": {"kind": "sampled", "n_samples": 32},
    "optim": {"lr": 0.01, "warmup_steps": 2},
    "train": {"precision": "fp32", "threads": 1, "log_every": 5, "eval_max_sentences": 50},
    "checkpoint": {"every_steps": 50, "every_minutes": 0, "keep": 2},
}
PREPARE = {"tokenizer": "word", "vocab_size": 100, "heldout_fraction": 0.05}

_SUBJ = ["the farmer", "a child", "every sailor", "the old dog", "my teacher", "a bird"]
_VERB = ["sees", "likes", "builds", "finds", "watches", "follows"]
_OBJ = ["the river", "a boat", "the bridge", "some fields", "the quiet town", "a red house"]
_TAIL = ["", " in the morning", " near the bank", " every day", " slowly"]


def write_corpus(path: Path, n: int = 600, seed: int = 0) -> Path:
    """Generated English-like text, a few sentences a line."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n // 2):
        sents = [
            f"{rng.choice(_SUBJ)} {rng.choice(_VERB)} {rng.choice(_OBJ)}{rng.choice(_TAIL)}."
            for _ in range(2)
        ]
        lines.append(" ".join(s[0].upper() + s[1:] for s in sents))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def job_body(steps: int = 40, **extra: Any) -> dict[str, Any]:
    return {
        "corpus": "corpora/book.txt",
        "config": TINY_CONFIG,
        "budget": {"steps": steps},
        "prepare": PREPARE,
        **extra,
    }


def dirs(tmp_path: Path) -> dict[str, Path]:
    d = {k: tmp_path / k for k in ("data", "runs", "models")}
    for p in d.values():
        p.mkdir(parents=True, exist_ok=True)
    write_corpus(d["data"] / "corpora" / "book.txt")
    return d


def settings_for(model_dir: Path, d: dict[str, Path], **kw: Any):
    kw.setdefault("jobs_poll_interval", POLL)
    return load_settings(
        model_path=model_dir,
        threads=1,
        data_dir=d["data"],
        runs_dir=d["runs"],
        models_dir=d["models"],
        api_keys="user",
        admin_keys="admin",
        warmup=False,
        **kw,
    )


def wait_job(get, job_id: str, until, timeout: float = 60.0, what: str = "") -> dict[str, Any]:
    """Poll ``get(job_id)`` (a record dict) until ``until(rec)``; fail with the record."""
    deadline = time.monotonic() + timeout
    rec: dict[str, Any] = {}
    while time.monotonic() < deadline:
        rec = get(job_id)
        if until(rec):
            return rec
        if rec.get("state") in ("succeeded", "failed", "cancelled") and not until(rec):
            break
        time.sleep(0.1)
    raise AssertionError(
        f"job {job_id}: not {what or 'there'}: state {rec.get('state')}, error {rec.get('error')}, "
        f"events {rec.get('events')}\nlog:\n" + "\n".join(rec.get("log_tail") or [])
    )


def http_get(client) -> Any:
    def get(job_id: str) -> dict[str, Any]:
        r = client.get(f"/v1/jobs/{job_id}", headers=ADMIN)
        assert r.status_code == 200, r.text
        return r.json()

    return get


def step_at_least(n: int):
    return lambda rec: rec["state"] == "running" and rec["progress"]["step"] >= n


def worker_env(d: dict[str, Path], **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELMO_") and k != "REDIS_URL"}
    env.update(
        ELMO_DATA_DIR=str(d["data"]),
        ELMO_RUNS_DIR=str(d["runs"]),
        ELMO_MODELS_DIR=str(d["models"]),
        ELMO_JOBS_POLL_INTERVAL=str(POLL),
        PYTHONUNBUFFERED="1",
        **extra,
    )
    return env


class Workers:
    """``elmo-service worker`` processes started by a test; all stopped at the end."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self.env, self.cwd, self.procs = env, cwd, []

    def start(self) -> subprocess.Popen:
        log = open(self.cwd / f"worker{len(self.procs)}.log", "ab")  # noqa: SIM115 - the process owns it
        p = subprocess.Popen(
            [sys.executable, "-m", "elmo_cli.main", "worker"],
            env=self.env,
            cwd=self.cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def assert_resumed(rec: dict[str, Any], d: dict[str, Path]) -> None:
    assert rec["state"] == "succeeded", rec
    assert rec["attempt"] == 2 and rec["losses"] == 1
    assert any("re-queued as attempt 2" in e["event"] for e in rec["events"]), rec["events"]
    log = (Path(rec["run_dir"]) / "job.log").read_text()
    assert "resumed from step-" in log  # the trainer continued from its checkpoint
    assert rec["progress"]["step"] == rec["progress"]["total_steps"]
    assert (d["models"] / rec["name"] / "manifest.json").is_file()


# ------------------------------------------------------------------ validation and auth


@pytest.fixture
def idle(tiny_model_dir, tmp_path):
    """An API whose jobs never run (no worker): for what is decided at submit time."""
    d = dirs(tmp_path)
    with TestClient(create_app(settings_for(tiny_model_dir, d, jobs_embedded_worker=False))) as c:
        c.dirs = d
        yield c


def _reject(c, body: dict[str, Any], status: int, field: str) -> dict[str, Any]:
    r = c.post("/v1/jobs", json=body, headers=ADMIN)
    assert r.status_code == status, r.text
    err = r.json()
    assert set(err) == {"code", "message", "field"} and err["field"] == field, err
    return err


def test_jobs_need_an_admin_key(idle, tiny_model_dir, tmp_path):
    assert idle.post("/v1/jobs", json=job_body()).status_code == 401
    assert idle.get("/v1/jobs").status_code == 401
    r = idle.post("/v1/jobs", json=job_body(), headers=USER)
    assert r.status_code == 403 and r.json()["field"] == "authorization"
    assert idle.get("/v1/jobs/jabcdefabcdef", headers=USER).status_code == 403
    assert idle.post("/v1/jobs/jabcdefabcdef/cancel", headers=USER).status_code == 403
    s = load_settings(model_path=tiny_model_dir, threads=1, warmup=False, runs_dir=tmp_path / "r")
    with TestClient(create_app(s)) as c:  # no admin keys configured: jobs are off
        r = c.post("/v1/jobs", json=job_body(), headers=ADMIN)
        assert r.status_code == 403 and r.json()["code"] == "forbidden"


def test_corpus_must_stay_inside_the_data_folder(idle, tmp_path):
    d = idle.dirs
    outside = tmp_path / "secret.txt"
    outside.write_text("top secret text for the model\n")
    (d["data"] / "escape.txt").symlink_to(outside)
    (d["data"] / "escape_dir").symlink_to(tmp_path)
    inner = d["data"] / "mixed"
    write_corpus(inner / "ok.txt")
    (inner / "sneaky.txt").symlink_to(outside)
    for corpus, words in [
        ("../secret.txt", "'..'"),
        ("corpora/../../secret.txt", "'..'"),
        (str(outside), "absolute"),
        ("/etc/passwd", "absolute"),
        ("escape.txt", "outside the data folder"),
        ("escape_dir/secret.txt", "outside the data folder"),
        ("mixed", "links outside the data folder"),
        ("corpora/*.txt", "glob"),
        ("corpora/missing.txt", "not found"),
        ("", "relative"),
    ]:
        err = _reject(idle, job_body(corpus=corpus), 422, "corpus")
        assert words in err["message"], (corpus, err)
    assert idle.get("/v1/jobs", headers=ADMIN).json()["data"] == []  # nothing was queued


def test_invalid_config_is_rejected_at_submit_naming_the_field(idle):
    bad = [
        ({"config": {"model": {"lstm_dimz": 16}}}, "config.model.lstm_dimz", "did you mean"),
        ({"config": {"model": {"lstm_dim": 0}}}, "config.model.lstm_dim", "positive"),
        ({"config": {"optim": {"lr": -1.0}}}, "config.optim.lr", "positive"),
        ({"config": {"optim": {"lr": "fast"}}}, "config.optim.lr", "float"),
        ({"config": {"softmax": {"kind": "hierarchical"}}}, "config.softmax.kind", "sampled"),
        ({"config": {"trainer": {}}}, "config.trainer", "unknown"),
        ({"config": {"data": {"path": "/elsewhere"}}}, "config.data.path", "set by the job"),
        ({"budget": {"steps": 0}}, "budget.steps", ""),
        ({"budget": {"hours": 3}}, "budget.hours", ""),
        ({"prepare": {"tokenizer": "bpe"}}, "prepare.tokenizer", ""),
        ({"name": "../evil"}, "name", ""),
        ({"priority": 1}, "priority", ""),
    ]
    for patch, field, words in bad:
        body = job_body()
        for k, v in patch.items():
            body[k] = {**body[k], **v} if k == "config" else v
        err = _reject(idle, body, 422, field)
        assert words in err["message"], (patch, err)
    r = idle.post("/v1/jobs", content=b"{", headers={**ADMIN, "content-type": "application/json"})
    assert r.status_code == 400


def test_the_typo_refusal_docs_jobs_md_quotes_is_the_real_one(idle):
    """docs/jobs.md shows a typo in a job's config and the answer: the answer is today's."""
    import json
    import re

    text = (Path(__file__).resolve().parents[2] / "docs" / "jobs.md").read_text()
    m = re.search(r"-d '(\{[^']*lstm_dimm[^']*\})'\n# (\d+) (\{.*\})\n", text)
    assert m, "docs/jobs.md no longer shows the typo example"
    sent, status, shown = json.loads(m.group(1)), int(m.group(2)), m.group(3)
    body = job_body()
    body["config"] = {**body["config"], **sent["config"]}
    r = idle.post("/v1/jobs", json=body, headers=ADMIN)
    assert r.status_code == status, r.text
    real = r.json()
    quoted = dict(re.findall(r'"(\w+)": "((?:[^"\\]|\\.)*)"', shown))
    assert quoted["code"] == real["code"] and quoted["field"] == real["field"], (quoted, real)
    head = quoted["message"].split("...")[0]  # the docs shorten the list of known keys
    assert real["message"].startswith(head), (head, real["message"])


def test_queued_job_lists_cancels_and_names_are_unique(idle):
    c = idle
    (c.dirs["models"] / "taken").mkdir()
    _reject(c, job_body(name="taken"), 409, "name")
    r = c.post("/v1/jobs", json=job_body(name="mine"), headers=ADMIN)
    assert r.status_code == 202 and r.headers["location"] == f"/v1/jobs/{r.json()['id']}"
    rec = r.json()
    assert rec["state"] == "queued" and rec["backend"] == "local" and rec["name"] == "mine"
    assert rec["progress"]["total_steps"] == 40 and rec["train_config"]["model"]["lstm_dim"] == 16
    _reject(c, job_body(name="mine"), 409, "name")  # one live job per model name
    listed = c.get("/v1/jobs", headers=ADMIN).json()
    assert listed["backend"] == "local" and [j["id"] for j in listed["data"]] == [rec["id"]]
    assert c.get("/v1/jobs?state=running", headers=ADMIN).json()["data"] == []
    r = c.post(f"/v1/jobs/{rec['id']}/cancel", headers=ADMIN)
    assert r.status_code == 200 and r.json()["state"] == "cancelled"
    assert c.post(f"/v1/jobs/{rec['id']}/cancel", headers=ADMIN).json()["state"] == "cancelled"
    for bad_id in ("jffffffffffff", "..x", "%2e%2e"):
        r = c.get(f"/v1/jobs/{bad_id}", headers=ADMIN)
        assert r.status_code == 404 and r.json()["field"] == "job_id", bad_id
    # a cancelled job frees its name
    assert c.post("/v1/jobs", json=job_body(name="mine"), headers=ADMIN).status_code == 202


# ------------------------------------------------------------------ running jobs (local worker)


@pytest.fixture
def local_api(tiny_model_dir, tmp_path):
    """The API with its embedded local worker process (the no-Redis default)."""
    d = dirs(tmp_path)
    with TestClient(create_app(settings_for(tiny_model_dir, d))) as c:
        c.dirs = d
        yield c


@pytest.mark.slow
def test_job_runs_to_success_and_its_model_is_activated_and_served(local_api):
    c = local_api
    r = c.post("/v1/jobs", json=job_body(name="tiny-lm"), headers=ADMIN)
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    rec = wait_job(http_get(c), job_id, lambda j: j["state"] == "succeeded", 90, "succeeded")
    p = rec["progress"]
    assert p["step"] == p["total_steps"] == 40 and p["tokens_seen"] > 0
    assert p["loss"] > 0 and p["perplexity"] > 1 and p["tokens_per_s"] > 0 and p["eta_s"] == 0
    assert p["heldout"]["avg_ppl"] > 1 and p["checkpoint"] == "step-00000040.pt"
    art = rec["artifact"]
    assert art["name"] == "tiny-lm" and art["step"] == 40 and art["heldout"]["avg_ppl"] > 1
    assert any("phase train" in line for line in rec["log_tail"])
    assert rec["phase"] is None and rec["error"] is None and rec["attempt"] == 1

    # ?full=true: the whole provenance (the default list summarises it)
    models = c.get("/v1/models", params={"full": "true"}, headers=USER).json()
    listed = {a["id"]: a for a in models["artifacts"]}
    assert listed["tiny-lm"]["version"] == art["version"] and not listed["tiny-lm"]["served"]
    prov = listed["tiny-lm"]["provenance"]
    assert prov["trainer"] == "elmo-pretrain" and prov["step"] == 40
    assert prov["training_config"]["model"]["lstm_dim"] == 16

    r = c.post("/v1/models/tiny-lm/activate", headers=ADMIN)
    assert r.status_code == 200, r.text
    assert r.json()["activated"]["version"] == art["version"]
    r = c.post("/v1/embed", json={"sentences": ["The farmer sees the river."]}, headers=USER)
    assert r.status_code == 200 and r.json()["model"] == {
        "id": "tiny-lm",
        "version": art["version"],
    }
    assert r.json()["data"][0]["layers"]["shape"][0] == 3
    # a second job cannot export over the served model's name
    assert c.post("/v1/jobs", json=job_body(name="tiny-lm"), headers=ADMIN).status_code == 409


@pytest.mark.slow
def test_cancel_stops_training_after_a_checkpoint(local_api):
    c = local_api
    job_id = c.post("/v1/jobs", json=job_body(steps=100_000), headers=ADMIN).json()["id"]
    wait_job(http_get(c), job_id, step_at_least(10), 60, "training")
    r = c.post(f"/v1/jobs/{job_id}/cancel", headers=ADMIN)
    assert r.status_code == 200 and r.json()["cancel_requested"] is True
    # no wall-clock bound (load would break it): a job that ignored the cancel would train on
    # toward 100000 steps and never read "cancelled" here
    rec = wait_job(http_get(c), job_id, lambda j: j["state"] == "cancelled", 120, "cancelled")
    ck = rec["progress"]["checkpoint"]
    assert ck is not None and (Path(rec["run_dir"]) / "train" / "checkpoints" / ck).is_file()
    assert int(ck[5:13]) >= rec["progress"]["step"] >= 10  # written at the stop, not before
    assert rec["artifact"] is None and not (c.dirs["models"] / job_id).exists()
    r = c.post(f"/v1/jobs/{job_id}/cancel", headers=ADMIN)
    assert r.status_code == 200 and r.json()["state"] == "cancelled"


@pytest.mark.slow
def test_killed_local_worker_job_resumes_in_the_next_worker(tiny_model_dir, tmp_path):
    d = dirs(tmp_path)
    s = settings_for(tiny_model_dir, d, jobs_embedded_worker=False)
    workers = Workers(worker_env(d), tmp_path)
    try:
        with TestClient(create_app(s)) as c:
            first = workers.start()
            job_id = c.post("/v1/jobs", json=job_body(steps=100), headers=ADMIN).json()["id"]
            rec = wait_job(http_get(c), job_id, step_at_least(20), 60, "training")
            assert rec["runner"]["pid"] == first.pid  # the local worker runs jobs itself
            first.send_signal(signal.SIGKILL)
            first.wait()
            workers.start()  # on start it finds the job's runner dead and re-queues it
            rec = wait_job(http_get(c), job_id, lambda j: j["state"] == "succeeded", 90, "done")
        assert_resumed(rec, d)
        assert "its runner (pid" in " ".join(e["event"] for e in rec["events"])
    finally:
        workers.stop()
