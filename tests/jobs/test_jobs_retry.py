"""A job whose trainer alone is killed by a signal (what the kernel's OOM killer does) is
retried from its checkpoint like a lost worker: bounded by ELMO_JOBS_MAX_ATTEMPTS, with
the reason in the record."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from elmo_api.main import create_app
from elmo_jobs.lifecycle import requeue
from elmo_jobs.state import FileJobStore, JobRecord
from tests.jobs.test_jobs import (
    ADMIN,
    TINY_CONFIG,
    dirs,
    http_get,
    job_body,
    settings_for,
    step_at_least,
    wait_job,
)
from tests.support.procs import pids_of


def trainer_pids(run_dir: str) -> list[int]:
    """Pids of ``python -m elmo_pretrain.cli train`` processes working in ``run_dir``."""
    return pids_of("elmo_pretrain.cli", "train", containing=run_dir)


@pytest.mark.slow
def test_trainer_killed_by_sigkill_is_retried_from_its_checkpoint(tiny_model_dir, tmp_path):
    d = dirs(tmp_path)
    body = job_body(steps=120)
    body["config"] = {**TINY_CONFIG, "checkpoint": {"every_steps": 10, "every_minutes": 0}}
    with TestClient(create_app(settings_for(tiny_model_dir, d))) as c:
        job_id = c.post("/v1/jobs", json=body, headers=ADMIN).json()["id"]
        rec = wait_job(http_get(c), job_id, step_at_least(25), 60, "training")
        assert rec["progress"]["checkpoint"] is not None
        worker = rec["runner"]["pid"]
        deadline = time.monotonic() + 10
        while not (pids := trainer_pids(rec["run_dir"])) and time.monotonic() < deadline:
            time.sleep(0.05)
        (pid,) = pids
        os.kill(pid, signal.SIGKILL)  # the trainer alone, as the OOM killer would
        rec = wait_job(http_get(c), job_id, lambda j: j["state"] == "succeeded", 90, "done")
    assert rec["attempt"] == 2 and rec["losses"] == 1, rec["events"]
    assert "train process" in rec["last_loss"] and "SIGKILL" in rec["last_loss"]
    events = " | ".join(e["event"] for e in rec["events"])
    assert "re-queued as attempt 2: its train process" in events
    assert rec["runner"] is None or rec["runner"]["pid"] == worker  # same worker ran attempt 2
    log = (Path(rec["run_dir"]) / "job.log").read_text()
    assert "resumed from step-" in log and "killed by SIGKILL" in log
    assert rec["progress"]["step"] == rec["progress"]["total_steps"] == 120


def _running(store: FileJobStore, job_id: str) -> None:
    def fn(r: JobRecord) -> bool:
        r.state = "running"
        return True

    store.update(job_id, fn)


def test_signal_retries_are_bounded_and_the_reason_is_kept(tmp_path):
    store = FileJobStore(tmp_path)
    rec = JobRecord(
        id="j0123456789ab", name="x", backend="local", spec={}, train_config={}, run_dir="/r"
    )
    store.create(rec)
    backend = SimpleNamespace(store=store, settings=SimpleNamespace(jobs_max_attempts=2))
    why = "its train process (pid 42) was killed by SIGKILL (out of memory?)"
    _running(store, rec.id)
    got = requeue(backend, rec.id, 1, why, lost=True)
    assert got.state == "queued" and got.attempt == 2 and got.losses == 1
    assert got.last_loss == why and got.events[-1].event == f"re-queued as attempt 2: {why}"
    assert requeue(backend, rec.id, 1, why, lost=True) is None  # a stale attempt changes nothing
    _running(store, rec.id)
    got = requeue(backend, rec.id, 2, why, lost=True)
    assert got.state == "failed" and got.losses == 2
    assert got.error == f"lost 2 times (worker died or trainer killed); last: {why}"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSEGV])
def test_signal_names_in_the_reason(sig):
    from elmo_jobs.runner import _signame

    name = _signame(int(sig))
    assert name.startswith(signal.Signals(sig).name)
    assert ("out of memory" in name) == (sig == signal.SIGKILL)


def test_the_runner_reads_why_training_stopped_from_the_metrics_log(tmp_path):
    """The trainer's stop record (not its log line) tells the runner why it stopped;
    progress ignores it, and a record from an earlier attempt is told apart."""
    from elmo_jobs.runner import MetricsReader
    from elmo_pretrain.tracking import stop_record

    path = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 5, "epoch": 0, "tokens_seen": 50, "loss": 3.0, "ppl": 20.0, "elapsed_s": 1.0},
        stop_record("signal", 5, 50, "signal SIGTERM"),
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    reader = MetricsReader(path, total_steps=10)
    p = reader.read()
    assert reader.stop is not None and reader.stop["reason"] == "signal"
    assert p.step == 5 and p.loss == 3.0
    reader.stop = None  # a new attempt: only its own record counts
    with open(path, "a") as f:
        f.write(json.dumps(stop_record("finished", 10, 100, "done")) + "\n")
        f.write('{"step": 11, "lo')  # a line still being written is not read
    reader.read()
    assert reader.stop["reason"] == "finished" and reader.stop["step"] == 10
    with pytest.raises(ValueError):
        stop_record("bored", 1, 1, "?")
