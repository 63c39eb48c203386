"""Pretraining jobs on a real Redis through rq: ``elmo-service worker`` processes run
them; a job runs to success, cancels with a checkpoint, and survives its worker being
SIGKILLed (alone, or with its work-horse) by resuming in the next worker."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from elmo_api.main import create_app
from elmo_jobs.state import RedisJobStore
from tests.jobs.test_jobs import (
    ADMIN,
    Workers,
    assert_resumed,
    dirs,
    http_get,
    job_body,
    settings_for,
    step_at_least,
    wait_job,
    worker_env,
)

pytestmark = pytest.mark.slow  # every test trains a job through rq workers


@pytest.fixture
def rq_api(tiny_model_dir, redis_server, tmp_path):
    """API + Redis; workers are started by each test (``c.workers``)."""
    # the Redis is shared by the session's tests: a queue and key prefix of our own
    tag = uuid.uuid4().hex[:8]
    queue, prefix = f"jobs-{tag}", f"elmo-{tag}"
    d = dirs(tmp_path)
    s = settings_for(
        tiny_model_dir, d, redis_url=redis_server.url, jobs_queue=queue, redis_prefix=prefix
    )
    env = worker_env(d, REDIS_URL=redis_server.url, ELMO_JOBS_QUEUE=queue, ELMO_REDIS_PREFIX=prefix)
    workers = Workers(env, tmp_path)
    try:
        with TestClient(create_app(s)) as c:
            c.dirs, c.workers, c.redis = d, workers, redis_server.client()
            c.store = RedisJobStore(c.redis, s.redis_prefix)
            yield c
    finally:
        workers.stop()


def test_rq_job_runs_to_success(rq_api):
    from rq.job import Job

    c = rq_api
    r = c.post("/v1/jobs", json=job_body(name="rq-tiny"), headers=ADMIN)
    assert r.status_code == 202 and r.json()["backend"] == "rq"
    job_id = r.json()["id"]
    # nothing runs it until a worker comes: queued in Redis, as an rq job
    time.sleep(0.5)
    assert http_get(c)(job_id)["state"] == "queued"
    assert Job.fetch(f"{job_id}-a1", connection=c.redis).get_status() == "queued"
    c.workers.start()
    rec = wait_job(http_get(c), job_id, lambda j: j["state"] == "succeeded", 90, "succeeded")
    assert rec["artifact"]["name"] == "rq-tiny" and rec["progress"]["step"] == 40
    assert (c.dirs["models"] / "rq-tiny" / "manifest.json").is_file()
    assert rec["runner"]["worker"].startswith("elmo-")  # an rq worker ran it
    deadline = time.monotonic() + 10
    while Job.fetch(f"{job_id}-a1", connection=c.redis).get_status() != "finished":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    r = c.post("/v1/models/rq-tiny/activate", headers=ADMIN)
    assert r.status_code == 200 and r.json()["activated"]["version"] == rec["artifact"]["version"]


def test_rq_cancel_queued_and_running(rq_api):
    c = rq_api
    queued = c.post("/v1/jobs", json=job_body(), headers=ADMIN).json()["id"]
    assert c.post(f"/v1/jobs/{queued}/cancel", headers=ADMIN).json()["state"] == "cancelled"
    job_id = c.post("/v1/jobs", json=job_body(steps=100_000), headers=ADMIN).json()["id"]
    c.workers.start()
    wait_job(http_get(c), job_id, step_at_least(10), 60, "training")
    assert c.post(f"/v1/jobs/{job_id}/cancel", headers=ADMIN).status_code == 200
    rec = wait_job(http_get(c), job_id, lambda j: j["state"] == "cancelled", 30, "cancelled")
    ck = rec["progress"]["checkpoint"]
    assert ck and (Path(rec["run_dir"]) / "train" / "checkpoints" / ck).is_file()
    assert int(ck[5:13]) >= rec["progress"]["step"] >= 10
    assert http_get(c)(queued)["events"][-1]["event"] == "cancelled"  # never ran
    assert not (Path(http_get(c)(queued)["run_dir"]) / "job.log").exists()


def test_rq_worker_sigkilled_mid_training_job_resumes(rq_api):
    """The worker dies; its work-horse gets SIGTERM (parent-death signal), stops the
    trainer with a checkpoint and re-queues the job; the next worker resumes it."""
    c = rq_api
    first = c.workers.start()
    job_id = c.post("/v1/jobs", json=job_body(steps=100), headers=ADMIN).json()["id"]
    wait_job(http_get(c), job_id, step_at_least(20), 60, "training")
    first.send_signal(signal.SIGKILL)
    first.wait()
    rec = wait_job(http_get(c), job_id, lambda j: j["attempt"] == 2, 30, "re-queued")
    assert rec["state"] == "queued" and "its worker died" in rec["events"][-1]["event"]
    c.workers.start()
    rec = wait_job(http_get(c), job_id, lambda j: j["state"] == "succeeded", 90, "succeeded")
    assert_resumed(rec, c.dirs)


def test_rq_worker_and_horse_sigkilled_job_requeued_by_next_worker(rq_api):
    """Worker and work-horse die at once (a crashed container): the record still says
    running; the next worker finds its runner dead on start and re-queues it."""
    c = rq_api
    first = c.workers.start()
    job_id = c.post("/v1/jobs", json=job_body(steps=100), headers=ADMIN).json()["id"]
    rec = wait_job(http_get(c), job_id, step_at_least(20), 60, "training")
    horse = rec["runner"]["pid"]
    assert horse != first.pid  # rq runs the job in a forked work-horse
    first.send_signal(signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(horse, signal.SIGKILL)
    first.wait()
    time.sleep(0.5)
    # read the record directly: a GET would let the API re-queue it (it can tell too)
    stale = c.store.get(job_id)
    assert stale.state == "running" and stale.attempt == 1
    c.workers.start()
    deadline = time.monotonic() + 30
    while c.store.get(job_id).attempt < 2:
        assert time.monotonic() < deadline, c.store.get(job_id)
        time.sleep(0.1)
    rec = wait_job(http_get(c), job_id, lambda j: j["state"] == "succeeded", 90, "succeeded")
    assert_resumed(rec, c.dirs)
    assert "its runner (pid" in " ".join(e["event"] for e in rec["events"])


def test_rq_worker_stopped_gracefully_requeues_its_job_at_once(rq_api):
    """SIGTERM (docker stop): the worker does not wait hours for the job; the trainer
    checkpoints, the job is re-queued (not counted as a loss) and the worker exits."""
    c = rq_api
    first = c.workers.start()
    job_id = c.post("/v1/jobs", json=job_body(steps=100), headers=ADMIN).json()["id"]
    wait_job(http_get(c), job_id, step_at_least(20), 60, "training")
    first.send_signal(signal.SIGTERM)
    first.wait(20)
    rec = http_get(c)(job_id)
    assert rec["state"] == "queued" and rec["attempt"] == 2 and rec["losses"] == 0
    assert "shutting down" in rec["events"][-1]["event"]
    c.workers.start()
    rec = wait_job(http_get(c), job_id, lambda j: j["state"] == "succeeded", 90, "succeeded")
    assert (
        rec["losses"] == 0
        and "resumed from step-" in (Path(rec["run_dir"]) / "job.log").read_text()
    )
