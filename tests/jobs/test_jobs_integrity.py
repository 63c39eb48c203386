"""One bad record never takes the jobs API down; every numeric job field is bounded;
names are reserved atomically; a corpus path the filesystem cannot take is a 422; a
diverged run fails with its reason and exports nothing; failed jobs can be retried.
(Redis outages under a running job: ``test_jobs_outages.py``.)"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from elmo_api.main import create_app
from elmo_jobs.backend import LocalBackend
from elmo_jobs.memory import estimate
from elmo_jobs.procs import runner_info
from elmo_jobs.runner import JobRunner, MetricsReader
from elmo_jobs.state import FileJobStore, JobRecord, RedisJobStore, new_job_id
from elmo_pretrain.config import TrainConfig
from tests.jobs.test_jobs import ADMIN, PREPARE, TINY_CONFIG, dirs, job_body, settings_for

torch.set_num_threads(1)

NAN = float("nan")


@pytest.fixture
def idle(tiny_model_dir, tmp_path):
    """An API whose jobs never run (no worker), one CPU worker's limits."""
    d = dirs(tmp_path)
    s = settings_for(tiny_model_dir, d, jobs_embedded_worker=False, jobs_gpus=0,
                     jobs_max_threads=2, jobs_max_steps=1_000_000)  # fmt: skip
    with TestClient(create_app(s)) as c:
        c.dirs = d
        yield c


def record(run_root: Path, **kw: Any) -> JobRecord:
    job_id = kw.pop("id", None) or new_job_id()
    kw.setdefault("name", job_id)
    kw.setdefault("spec", {})
    kw.setdefault("train_config", {})
    return JobRecord(id=job_id, backend="local", run_dir=str(run_root / job_id), **kw)


def diverged(run_root: Path, **kw: Any) -> JobRecord:
    """A record as a diverged run leaves it: non-finite figures everywhere."""
    rec = record(run_root, state="failed", **kw)
    rec.progress.loss, rec.progress.perplexity, rec.progress.lr = NAN, math.inf, 1e30
    rec.progress.heldout = {"avg_ppl": NAN, "fwd_ppl": -math.inf, "bwd_ppl": 3.0}
    return rec


def plant_bad_records(root: Path) -> dict[str, str]:
    """Three ways a stored record can be unreadable, written as files into the store."""
    bad = {new_job_id(): '{"id": "j', new_job_id(): "[]", new_job_id(): "\x00\xff garbage"}
    ids = list(bad)
    bad[ids[1]] = json.dumps({"id": ids[1], "state": "exploded"})  # valid JSON, wrong shape
    for job_id, text in bad.items():
        (root / job_id).mkdir(parents=True)
        (root / job_id / "job.json").write_text(text)
    return bad


# ------------------------------------------------------------------ bad records


def test_nan_figures_round_trip_as_null(tmp_path):
    store = FileJobStore(tmp_path)
    rec = diverged(tmp_path)
    store.create(rec)
    text = (tmp_path / rec.id / "job.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    got = store.get(rec.id)
    assert got.progress.loss is None and got.progress.perplexity is None
    assert got.progress.heldout == {"avg_ppl": None, "fwd_ppl": None, "bwd_ppl": 3.0}
    # a bare NaN literal written by something else reads as null too
    raw = json.loads(text)
    raw["progress"]["loss"] = NAN
    (tmp_path / rec.id / "job.json").write_text(json.dumps(raw))  # json writes NaN
    assert "NaN" in (tmp_path / rec.id / "job.json").read_text()
    assert store.get(rec.id).progress.loss is None


def test_nan_and_unreadable_records_do_not_fail_list_submit_or_get(idle):
    c = idle
    runs = c.dirs["runs"]
    store = FileJobStore(runs)
    nan_rec = diverged(runs)
    store.create(nan_rec)
    raw = json.loads((runs / nan_rec.id / "job.json").read_text())
    raw["progress"]["tokens_per_s"] = NAN
    (runs / nan_rec.id / "job.json").write_text(json.dumps(raw))  # a bare NaN literal
    bad = plant_bad_records(runs)

    r = c.get("/v1/jobs", headers=ADMIN)
    assert r.status_code == 200, r.text
    listed = r.json()
    assert [j["id"] for j in listed["data"]] == [nan_rec.id]
    assert listed["data"][0]["progress"]["loss"] is None
    assert listed["data"][0]["progress"]["heldout"]["avg_ppl"] is None
    assert {u["id"] for u in listed["unreadable"]} == set(bad)
    assert all(u["error"] for u in listed["unreadable"])

    r = c.post("/v1/jobs", json=job_body(name="after-bad"), headers=ADMIN)
    assert r.status_code == 202, r.text
    assert c.get(f"/v1/jobs/{nan_rec.id}", headers=ADMIN).status_code == 200
    for job_id in bad:
        r = c.get(f"/v1/jobs/{job_id}", headers=ADMIN)
        assert r.status_code == 409 and r.json()["field"] == "job_id", r.text
        assert "unreadable" in r.json()["message"]
        r = c.post(f"/v1/jobs/{job_id}/cancel", headers=ADMIN)
        assert r.status_code == 409, r.text
    assert len(c.get("/v1/jobs", headers=ADMIN).json()["data"]) == 2


def test_nan_and_unreadable_records_in_redis(tiny_model_dir, tmp_path, redis_server):
    import uuid

    d = dirs(tmp_path)
    prefix = f"elmo-{uuid.uuid4().hex[:8]}"
    s = settings_for(tiny_model_dir, d, redis_url=redis_server.url, redis_prefix=prefix,
                     jobs_queue=f"q-{prefix}")  # fmt: skip
    r = redis_server.client()
    store = RedisJobStore(r, prefix)
    nan_rec = diverged(d["runs"])
    store.create(nan_rec)
    broken = new_job_id()
    r.set(f"{prefix}:job:{broken}", b'{"id": "' + broken.encode() + b'", "progress": 7}')
    r.zadd(f"{prefix}:jobs", {broken: time.time()})
    with TestClient(create_app(s)) as c:
        listed = c.get("/v1/jobs", headers=ADMIN).json()
        assert [j["id"] for j in listed["data"]] == [nan_rec.id]
        assert [u["id"] for u in listed["unreadable"]] == [broken]
        assert c.post("/v1/jobs", json=job_body(), headers=ADMIN).status_code == 202
        assert c.get(f"/v1/jobs/{broken}", headers=ADMIN).status_code == 409


def test_reconcile_handles_the_good_records_beside_a_bad_one(tmp_path):
    """The recovery loop re-queues a lost job although an unreadable record sits beside it."""
    settings = SimpleNamespace(runs_dir=tmp_path, jobs_max_attempts=3, jobs_poll_interval=0.1,
                               jobs_heartbeat_timeout=60.0, jobs_embedded_worker=False)  # fmt: skip
    backend = LocalBackend(settings)  # type: ignore[arg-type]
    plant_bad_records(tmp_path)
    lost = record(tmp_path, state="running")
    gone = runner_info()  # this process, as if it had died: another start time
    lost.runner = gone.model_copy(update={"pid_start": "0"})
    backend.store.create(lost)
    assert backend.reconcile() == [lost.id]
    got = backend.store.get(lost.id)
    assert got.state == "queued" and got.attempt == 2
    assert len(backend.store.unreadable) == 3 and backend.store.unreadable_seen == 3


def test_metrics_with_nan_figures_give_null_progress(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        '{"step": 5, "tokens_seen": 50, "loss": NaN, "ppl": Infinity, "lr": 1e30, "elapsed_s": 1}',
        '{"heldout": {"avg_ppl": NaN, "protocol": "x", "fwd_ppl": 4.0}}',
        '{"step": "six", "loss": 1}',  # unusable: skipped, not fatal
        '["not", "a", "record"]',
    ]
    path.write_text("\n".join(lines) + "\n")
    p = MetricsReader(path, total_steps=10).read()
    assert p.step == 5 and p.loss is None and p.perplexity is None and p.lr == 1e30
    assert p.heldout == {"avg_ppl": None, "fwd_ppl": 4.0}
    assert "NaN" not in p.model_dump_json()


# ------------------------------------------------------------------ divergence


def _diverged_job(tmp_path: Path, monkeypatch, stop: dict[str, Any]) -> JobRecord:
    """A job whose trainer ends with ``stop`` (exit 2), run by a real JobRunner."""
    d = dirs(tmp_path)
    settings = SimpleNamespace(runs_dir=d["runs"], data_dir=d["data"], models_dir=d["models"],
                               threads=1, jobs_max_attempts=3, jobs_poll_interval=0.05,
                               jobs_heartbeat_timeout=60.0, jobs_stop_timeout=5.0,
                               jobs_max_memory=2**40, jobs_memory_fraction=0.5,
                               jobs_embedded_worker=False)  # fmt: skip
    backend = LocalBackend(settings)  # type: ignore[arg-type]
    cfg = TrainConfig.model_validate({**TINY_CONFIG, "data": {**TINY_CONFIG["data"], "path": "x"}})
    rec = record(d["runs"], name="nan-lm", train_config=cfg.to_dict())
    rec.spec = {"corpus": "corpora/book.txt"}
    backend.store.create(rec)
    runner = JobRunner(backend, settings, rec.id, 1)  # type: ignore[arg-type]
    monkeypatch.setattr(runner, "_prepare", lambda: tmp_path)
    exported = []
    monkeypatch.setattr(runner, "_export", lambda: exported.append(1))

    def fake_train(args: list[str]) -> tuple[int, str]:
        train_dir = Path(args[3])
        train_dir.mkdir(parents=True, exist_ok=True)
        lines = ['{"step": 15, "loss": 3.5, "ppl": 33.1}', json.dumps(stop)]
        (train_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        return 2, ""

    monkeypatch.setattr(runner, "_run_phase", fake_train)
    assert runner.run() == "failed"
    got = backend.store.get(rec.id)
    assert got.state == "failed" and exported == []
    assert not (d["models"] / "nan-lm").exists()
    return got


def test_a_diverged_run_fails_with_its_reason_and_exports_nothing(tmp_path, monkeypatch):
    """The trainer's divergence stop (exit 2, a stop record) fails the job in one line."""
    stop = {"event": "stop", "reason": "diverged", "step": 17, "tokens_seen": 170,
            "detail": "non-finite loss nan at step 17 (exit 2)\nsecond line"}  # fmt: skip
    got = _diverged_job(tmp_path, monkeypatch, stop)
    assert got.error == (
        "training diverged at step 17: non-finite loss nan at step 17 (exit 2); "
        "no model exported (its checkpoints are the last finite ones)"
    )
    assert any("failed: training diverged at step 17" in x for x in got.log_tail)


def test_a_real_divergence_is_named_once(tmp_path, monkeypatch):
    """The trainer's own stop record (its detail already says "training diverged at step
    N: ...") becomes the job's error as it is, not wrapped in a second "diverged at"."""
    from elmo_pretrain.prepare import PrepareOptions, prepare
    from elmo_pretrain.train import TrainingDiverged, run_training
    from tests.jobs.test_jobs import write_corpus

    text = write_corpus(tmp_path / "book.txt", 200)
    prepare([str(text)], tmp_path / "prep", PrepareOptions(**PREPARE), progress=False,
            log=lambda *_: None)  # fmt: skip
    raw = {**TINY_CONFIG, "data": {**TINY_CONFIG["data"], "path": str(tmp_path / "prep")}}
    raw["optim"] = {"name": "sgd", "lr": 1e30, "clip_norm": 0.0}
    raw["train"] = {**TINY_CONFIG["train"], "steps": 20, "progress": False}
    with pytest.raises(TrainingDiverged) as e:
        run_training(TrainConfig.model_validate(raw), tmp_path / "run", log=lambda *_: None)
    stop = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert stop["reason"] == "diverged"
    got = _diverged_job(tmp_path / "job", monkeypatch, stop)
    assert got.error.count("diverged") == 1, got.error
    assert got.error.startswith(e.value.message.splitlines()[0][:60])
    assert got.error.endswith("; no model exported (its checkpoints are the last finite ones)")


# ------------------------------------------------------------------ bounds


def with_config(**sections: dict[str, Any]) -> dict[str, Any]:
    body = job_body()
    body["config"] = {k: {**v, **sections.get(k, {})} for k, v in TINY_CONFIG.items()}
    for k, v in sections.items():
        body["config"].setdefault(k, v)
    return body


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        (with_config(train={"threads": 100_000}), "config.train.threads", "2 cores"),
        (job_body(steps=10**12), "budget.steps", "quota of 1000000"),
        (with_config(train={"steps": 10**12}) | {"budget": {}}, "config.train.steps", "quota"),
        (with_config(checkpoint={"every_steps": -5}), "config.checkpoint.every_steps", ">= 0"),
        (with_config(checkpoint={"every_minutes": -1}), "config.checkpoint.every_minutes", ">= 0"),
        (with_config(train={"eval_max_sentences": -1}), "config.train.eval_max_sentences", ">= 0"),
        (with_config(train={"eval_every": -3}), "config.train.eval_every", ">= 0"),
        (with_config(train={"max_minutes": -2}), "config.train.max_minutes", ">= 0"),
        (with_config(train={"device": "cuda:7"}), "config.train.device", "no CUDA device"),
        (with_config(train={"device": "cuda"}), "config.train.device", "no CUDA device"),
        (with_config(train={"device": "tpu"}), "config.train.device", "auto, cpu, cuda"),
        (with_config(model={"max_sentence_tokens": 10**7}), "config.model.max_sentence_tokens",
         "<= 8192"),
        (with_config(data={"mode": "stream", "rows": 100, "unroll": 1_000_000}),
         "config.data.unroll", "GiB of memory"),
        (with_config(data={"mode": "stream", "rows": 1_000_000, "unroll": 20}),
         "config.data.rows", "GiB of memory"),
    ],
)  # fmt: skip
def test_every_numeric_job_field_is_bounded(idle, body, field, words):
    r = idle.post("/v1/jobs", json=body, headers=ADMIN)
    assert r.status_code == 422, r.text
    err = r.json()
    assert err["field"] == field and words in err["message"], err
    assert idle.get("/v1/jobs", headers=ADMIN).json()["data"] == []


def test_within_bounds_is_accepted(idle):
    body = with_config(train={"threads": 2, "device": "cpu", "eval_max_sentences": 1},
                       checkpoint={"every_steps": 0}, data={"mode": "stream", "rows": 4,
                                                            "unroll": 10})  # fmt: skip
    r = idle.post("/v1/jobs", json=body, headers=ADMIN)
    assert r.status_code == 202, r.text


def test_the_memory_estimate_counts_stream_batches():
    """Stream mode's batch is rows x unroll tokens (it ignored them: 0.503 GiB whatever)."""
    base = TrainConfig().to_dict()
    vocab = 16000

    def stream(rows: int, unroll: int) -> int:
        cfg = {**base, "data": {**base["data"], "mode": "stream", "rows": rows, "unroll": unroll}}
        return estimate(cfg, vocab).total

    assert stream(20, 20) < stream(200, 20) < stream(200, 200) < stream(2000, 200)
    # past the vocabulary (the char CNN's distinct tokens), linear in rows x unroll
    assert stream(1200, 100) - stream(800, 100) == stream(800, 100) - stream(400, 100) > 0
    assert stream(400, 100) == stream(100, 400)
    # the sentence-mode knob does not move a stream estimate
    cfg = {**base, "data": {**base["data"], "mode": "stream", "tokens_per_batch": 10**7}}
    assert estimate(cfg, vocab).total == stream(20, 20)


# ------------------------------------------------------------------ corpus paths


def test_a_corpus_path_the_filesystem_cannot_take_is_a_422(idle):
    d = idle.dirs["data"]
    (d / "loop").symlink_to(d / "loop")  # resolves to itself: ELOOP
    for corpus, words in [
        ("a" * 256, "longer than 255 bytes"),
        ("corpora/" + "é" * 128, "longer than 255 bytes"),  # 256 bytes in UTF-8
        ("/".join(["d" * 200] * 21), "longer than 4096 bytes"),
        ("loop", ""),
        ("loop/x.txt", ""),
    ]:
        r = idle.post("/v1/jobs", json=job_body(corpus=corpus), headers=ADMIN)
        assert r.status_code == 422, (corpus[:40], r.text)
        assert r.json()["field"] == "corpus" and words in r.json()["message"], r.json()
    r = idle.post("/v1/jobs", json=job_body(corpus="c" * 255), headers=ADMIN)
    assert r.status_code == 422 and "not found" in r.json()["message"]  # 255 is a legal name


# ------------------------------------------------------------------ names and retry


def race_submits(c, name: str, n: int = 8) -> list[Any]:
    barrier = threading.Barrier(n)
    out: list[Any] = [None] * n

    def go(i: int) -> None:
        barrier.wait()
        out[i] = c.post("/v1/jobs", json=job_body(name=name), headers=ADMIN)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def assert_one_won(replies: list[Any]) -> None:
    codes = sorted(r.status_code for r in replies)
    assert codes == [202] + [409] * (len(replies) - 1), [r.text for r in replies]
    for r in replies:
        if r.status_code == 409:
            assert r.json()["field"] == "name" and "already builds" in r.json()["message"]


def test_concurrent_same_name_submits_one_wins(idle):
    assert_one_won(race_submits(idle, "racy"))
    assert [j["name"] for j in idle.get("/v1/jobs", headers=ADMIN).json()["data"]] == ["racy"]


def test_concurrent_same_name_submits_one_wins_on_redis(tiny_model_dir, tmp_path, redis_server):
    import uuid

    d = dirs(tmp_path)
    prefix = f"elmo-{uuid.uuid4().hex[:8]}"
    s = settings_for(tiny_model_dir, d, redis_url=redis_server.url, redis_prefix=prefix,
                     jobs_queue=f"q-{prefix}")  # fmt: skip
    with TestClient(create_app(s)) as c:
        assert_one_won(race_submits(c, "racy"))
        assert len(c.get("/v1/jobs", headers=ADMIN).json()["data"]) == 1


def test_retry_rules(idle):
    c = idle
    job_id = c.post("/v1/jobs", json=job_body(name="again"), headers=ADMIN).json()["id"]
    r = c.post(f"/v1/jobs/{job_id}/retry", headers=ADMIN)
    assert r.status_code == 409 and "only a failed or cancelled" in r.json()["message"]
    c.post(f"/v1/jobs/{job_id}/cancel", headers=ADMIN)
    other = c.post("/v1/jobs", json=job_body(name="again"), headers=ADMIN)  # the name is free
    assert other.status_code == 202
    r = c.post(f"/v1/jobs/{job_id}/retry", headers=ADMIN)  # ... and taken again
    assert r.status_code == 409 and r.json()["field"] == "name", r.text
    c.post(f"/v1/jobs/{other.json()['id']}/cancel", headers=ADMIN)
    r = c.post(f"/v1/jobs/{job_id}/retry", headers=ADMIN)
    assert r.status_code == 202, r.text
    rec = r.json()
    assert rec["state"] == "queued" and rec["attempt"] == 2 and rec["losses"] == 0
    assert rec["error"] is None and "retried as attempt 2" in rec["events"][-1]["event"]
    assert c.post("/v1/jobs/jffffffffffff/retry", headers=ADMIN).status_code == 404


def test_a_queued_job_says_why_it_does_not_start(idle):
    rec = idle.post("/v1/jobs", json=job_body(), headers=ADMIN).json()
    got = idle.get(f"/v1/jobs/{rec['id']}", headers=ADMIN).json()
    assert got["state"] == "queued" and "no worker is running" in got["hint"]
    beats = idle.dirs["runs"] / ".workers"
    beats.mkdir()
    (beats / "local-x-1").touch()
    import os

    old = time.time() - 300
    os.utime(beats / "local-x-1", (old, old))
    got = idle.get(f"/v1/jobs/{rec['id']}", headers=ADMIN).json()
    assert "no worker has been seen for 30" in got["hint"]
    (beats / "local-x-1").touch()
    assert idle.get(f"/v1/jobs/{rec['id']}", headers=ADMIN).json()["hint"] is None
    stored = json.loads((idle.dirs["runs"] / rec["id"] / "job.json").read_text())
    assert stored["hint"] is None  # said on reading, never stored


def test_a_live_runner_is_never_counted_lost_whatever_rq_says(tmp_path):
    """After a Redis blip rq may report an execution failed or gone while its horse still
    trains: a runner seen alive, or with a fresh heartbeat, is not lost."""
    from elmo_jobs.backend import JobBackend

    class Forgetful(JobBackend):
        def execution_lost(self, rec: JobRecord) -> str | None:
            return "its rq job is gone"

    settings = SimpleNamespace(jobs_heartbeat_timeout=60.0, jobs_poll_interval=0.5)
    backend = Forgetful(settings)  # type: ignore[arg-type]
    now = time.time()
    here = record(tmp_path, state="running", heartbeat_at=now - 30)
    here.runner = runner_info()  # this very process: alive
    assert backend.lost_reason(here, now) is None
    remote = record(tmp_path, state="running", heartbeat_at=now - 1)
    remote.runner = runner_info().model_copy(update={"host": "elsewhere"})
    assert backend.lost_reason(remote, now) is None  # fresh heartbeat
    remote.heartbeat_at = now - 30
    assert backend.lost_reason(remote, now) == "its rq job is gone"
    dead = record(tmp_path, state="running", heartbeat_at=now)
    dead.runner = runner_info().model_copy(update={"pid_start": "0"})
    assert "is gone" in backend.lost_reason(dead, now)
