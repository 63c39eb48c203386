"""The jobs service through Redis faults, with real processes: a Redis that hangs (a
black hole) stalls only /v1/jobs; a Redis that pauses or restarts empty under a running
job neither kills the rq worker nor fails the job; a run folder whose record the store
lost is adopted; a cancelled job retried resumes from its checkpoint."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from elmo_api.main import create_app
from tests.jobs.test_jobs import (
    ADMIN,
    TINY_CONFIG,
    USER,
    Workers,
    dirs,
    http_get,
    job_body,
    settings_for,
    step_at_least,
    wait_job,
    worker_env,
)
from tests.support.blackhole import BlackHole
from tests.support.live_server import LiveServer

torch.set_num_threads(1)


HANG_S = 8.0


def test_a_hanging_redis_stalls_only_the_jobs_routes(tiny_model_dir, tmp_path):
    """Eight clients poll /v1/jobs against a Redis that accepts and never answers; the
    embedding and model routes stay fast (they used to share the default executor)."""
    d = dirs(tmp_path)
    with BlackHole() as hole:
        # a long hang (HANG_S), so a route that waited behind it is told apart from a slow
        # machine by a wide margin, not by a tight bound on an answer's time
        s = settings_for(tiny_model_dir, d, redis_url=hole.url, jobs_store_timeout=HANG_S,
                         jobs_embedded_worker=False)  # fmt: skip
        with LiveServer(create_app(s)) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
            for _ in range(2):  # warm: the first embed compiles, and opens the cache's breaker
                c.post("/v1/embed", json={"sentences": ["a b c"]}, headers=USER)
                c.get("/v1/models", headers=USER)
            stop = threading.Event()
            jobs_codes: list[int] = []

            def poll() -> None:
                with httpx.Client(base_url=srv.url, timeout=60) as own:
                    while not stop.is_set():
                        jobs_codes.append(own.get("/v1/jobs", headers=ADMIN).status_code)

            pollers = [threading.Thread(target=poll) for _ in range(8)]
            for t in pollers:
                t.start()
            time.sleep(1.0)  # the pollers are all waiting on the black hole now
            slowest: dict[str, float] = {"models": 0.0, "embed": 0.0}
            for _ in range(8):
                for route, call in (
                    ("models", lambda: c.get("/v1/models", headers=USER)),
                    ("embed", lambda: c.post("/v1/embed", json={"sentences": ["a b c"]},
                                             headers=USER)),
                ):  # fmt: skip
                    t0 = time.monotonic()
                    r = call()
                    slowest[route] = max(slowest[route], time.monotonic() - t0)
                    assert r.status_code == 200, r.text
            stop.set()
            hole.__exit__()  # the hanging calls end now (connection reset), not after HANG_S
            for t in pollers:
                t.join(30)
    assert jobs_codes and set(jobs_codes) == {503}, jobs_codes  # never a 500, never a hang
    assert max(slowest.values()) < HANG_S / 2, slowest


def _tolerant_get(c) -> Any:
    """GET a job, retrying through the 503s of a Redis outage."""

    def get(job_id: str) -> dict[str, Any]:
        for _ in range(200):
            r = c.get(f"/v1/jobs/{job_id}", headers=ADMIN)
            if r.status_code == 200:
                return r.json()
            assert r.status_code == 503, r.text
            time.sleep(0.2)
        raise AssertionError("the job store stayed unavailable")

    return get


@pytest.mark.slow
@pytest.mark.heavy  # ~110 s: make test-all (docs/testing.md)
def test_redis_pauses_and_restarts_empty_under_a_running_rq_job(
    tiny_model_dir, tmp_path, redis_server_factory
):
    """A 6 s hang (SIGSTOP) and a 7 s outage after which Redis comes back empty, both
    while a job trains: the worker lives, the job succeeds on its first attempt with no
    loss counted, its record re-created from the runner's or the run folder's copy; the
    worker then runs a second job."""
    redis = redis_server_factory()
    tag = uuid.uuid4().hex[:8]
    d = dirs(tmp_path)
    s = settings_for(tiny_model_dir, d, redis_url=redis.url, jobs_queue=f"q-{tag}",
                     redis_prefix=f"elmo-{tag}", jobs_store_timeout=1.0)  # fmt: skip
    env = worker_env(d, REDIS_URL=redis.url, ELMO_JOBS_QUEUE=f"q-{tag}",
                     ELMO_REDIS_PREFIX=f"elmo-{tag}", ELMO_JOBS_STORE_TIMEOUT="1")  # fmt: skip
    workers = Workers(env, tmp_path)
    # long enough that both outages fall inside training on a quiet machine too
    body = job_body(steps=1000)
    body["config"] = {**TINY_CONFIG, "checkpoint": {"every_steps": 20, "every_minutes": 0}}
    try:
        with TestClient(create_app(s)) as c:
            worker = workers.start()
            get = _tolerant_get(c)
            job_id = c.post("/v1/jobs", json=body, headers=ADMIN).json()["id"]
            wait_job(get, job_id, step_at_least(20), 90, "training")
            os.kill(redis.proc.pid, signal.SIGSTOP)  # a hang: connections open, no answers
            time.sleep(6)
            os.kill(redis.proc.pid, signal.SIGCONT)
            step = wait_job(get, job_id, lambda j: j["progress"]["step"] >= 40, 60, "")
            redis.stop()  # an outage longer than rq's job monitoring interval (5 s), and
            time.sleep(7)  # Redis comes back without its data
            redis.start()
            assert worker.poll() is None, "the worker died in the outage"
            rec = wait_job(get, job_id, lambda j: j["state"] == "succeeded", 180, "succeeded")
            assert rec["attempt"] == 1 and rec["losses"] == 0, rec["events"]
            assert rec["progress"]["step"] == 1000 > step["progress"]["step"]
            events = " | ".join(e["event"] for e in rec["events"])
            # whoever noticed first put the record back: its runner, or a reconcile pass
            assert "re-created by its runner" in events or "adopted from its run" in events
            assert (d["models"] / rec["name"] / "manifest.json").is_file()
            assert worker.poll() is None
            second = c.post("/v1/jobs", json=job_body(steps=20), headers=ADMIN).json()["id"]
            wait_job(get, second, lambda j: j["state"] == "succeeded", 90, "succeeded")
    finally:
        workers.stop()


def test_a_run_folder_whose_record_redis_lost_is_adopted(tiny_model_dir, tmp_path, redis_server):
    tag = uuid.uuid4().hex[:8]
    d = dirs(tmp_path)
    s = settings_for(tiny_model_dir, d, redis_url=redis_server.url, jobs_queue=f"q-{tag}",
                     redis_prefix=f"elmo-{tag}")  # fmt: skip
    r = redis_server.client()
    with TestClient(create_app(s)) as c:
        queued = c.post("/v1/jobs", json=job_body(name="kept"), headers=ADMIN).json()
        cancelled = c.post("/v1/jobs", json=job_body(), headers=ADMIN).json()
        c.post(f"/v1/jobs/{cancelled['id']}/cancel", headers=ADMIN)
        assert (Path(queued["run_dir"]) / "job.json").is_file()  # the run folder's copy
        for key in r.scan_iter(f"elmo-{tag}:*"):  # the store loses everything
            r.delete(key)
        time.sleep(2.1)  # the list re-checks at most every 2 s
        listed = {j["id"]: j for j in c.get("/v1/jobs", headers=ADMIN).json()["data"]}
        assert set(listed) == {queued["id"], cancelled["id"]}
        assert listed[cancelled["id"]]["state"] == "cancelled"
        assert listed[queued["id"]]["state"] == "queued"
        assert "adopted from its run folder" in listed[queued["id"]]["events"][-1]["event"]
        assert "no worker is running" in listed[queued["id"]]["hint"]  # no rq worker listens
        # the name came back with it: a second job cannot take it
        r2 = c.post("/v1/jobs", json=job_body(name="kept"), headers=ADMIN)
        assert r2.status_code == 409 and r2.json()["field"] == "name", r2.text
        assert c.post(f"/v1/jobs/{cancelled['id']}/retry", headers=ADMIN).status_code == 202


@pytest.mark.slow
def test_a_cancelled_job_retried_resumes_from_its_checkpoint(tiny_model_dir, tmp_path):
    d = dirs(tmp_path)
    body = job_body(steps=100, name="resumed")
    body["config"] = {**TINY_CONFIG, "checkpoint": {"every_steps": 20, "every_minutes": 0}}
    with TestClient(create_app(settings_for(tiny_model_dir, d))) as c:
        job_id = c.post("/v1/jobs", json=body, headers=ADMIN).json()["id"]
        wait_job(http_get(c), job_id, step_at_least(20), 60, "training")
        c.post(f"/v1/jobs/{job_id}/cancel", headers=ADMIN)
        rec = wait_job(http_get(c), job_id, lambda j: j["state"] == "cancelled", 30, "cancelled")
        stopped_at = rec["progress"]["step"]
        r = c.post(f"/v1/jobs/{job_id}/retry", headers=ADMIN)
        assert r.status_code == 202 and r.json()["attempt"] == 2, r.text
        rec = wait_job(http_get(c), job_id, lambda j: j["state"] == "succeeded", 90, "succeeded")
    assert rec["attempt"] == 2 and rec["progress"]["step"] == 100
    log = (Path(rec["run_dir"]) / "job.log").read_text()
    assert f"resumed from step-{stopped_at:08d}" in log or "resumed from step-" in log, log[-2000:]
    assert log.count("phase prepare") == 1  # the prepared corpus was reused
    assert (d["models"] / "resumed" / "manifest.json").is_file()


def test_an_adopted_running_job_on_another_host_is_not_requeued(tmp_path, redis_server):
    """After Redis comes back empty the API adopts a running job from its run folder; its
    runner is on another host (another container), so only its heartbeat can vouch for it:
    the adoption gives it time to beat instead of re-queueing it at once."""
    from types import SimpleNamespace

    from elmo_jobs.backend import RqBackend
    from elmo_jobs.procs import runner_info
    from elmo_jobs.state import JobRecord, RedisJobStore

    tag = uuid.uuid4().hex[:8]
    runs = tmp_path / "runs"
    settings = SimpleNamespace(redis_url=redis_server.url, redis_prefix=f"elmo-{tag}",
                               jobs_queue=f"q-{tag}", runs_dir=runs, jobs_store_timeout=2.0,
                               jobs_heartbeat_timeout=60.0, jobs_poll_interval=0.5,
                               jobs_max_attempts=3)  # fmt: skip
    backend = RqBackend(settings)  # type: ignore[arg-type]
    rec = JobRecord(id="j00000000abcd", name="far", backend="rq", spec={}, train_config={},
                    run_dir=str(runs / "j00000000abcd"), state="running", attempt=1,
                    heartbeat_at=time.time() - 600,
                    runner=runner_info().model_copy(update={"host": "worker-2"}))  # fmt: skip
    runs.mkdir()
    RedisJobStore(redis_server.client(), "unused").create(rec)  # only its run-folder copy
    assert (runs / rec.id / "job.json").is_file()
    backend.reconcile()
    got = backend.store.get(rec.id)
    assert got is not None and got.state == "running" and got.attempt == 1 and got.losses == 0
    assert "adopted from its run folder" in got.events[-1].event
    backend.close()


def test_a_worker_started_while_redis_is_away_waits_for_it(tmp_path, redis_server_factory):
    """rq talks to Redis as the worker is built: a worker started during an outage (a
    restart, a blip) waits for Redis instead of dying with a traceback."""
    import subprocess
    import sys

    redis = redis_server_factory()
    redis.stop()  # the port stays ours: the worker meets a refused connection
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1",
           "REDIS_URL": redis.url, "ELMO_RUNS_DIR": str(tmp_path), "ELMO_DATA_DIR": str(tmp_path),
           "ELMO_REDIS_PREFIX": f"w{uuid.uuid4().hex[:6]}"}  # fmt: skip
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "elmo_cli.main", "worker", "--burst"], env=env, cwd=root,
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120  # imports are slow on a busy machine
        while "Redis unavailable at start" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text()[-2000:]  # waiting, not dead
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        time.sleep(1.5)  # it retries, still alive
        assert proc.poll() is None, log.read_text()[-2000:]
        redis.start()
        proc.wait(timeout=90)  # burst: registers, finds no job, exits
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = log.read_text(errors="replace")
    assert proc.returncode == 0, out[-2000:]
    assert "Traceback" not in out
