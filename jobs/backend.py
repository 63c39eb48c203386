"""How jobs reach a worker: rq on Redis, or a local worker process without Redis.

Both backends share the job-state model (:mod:`elmo_jobs.state`) and differ in
delivery only:

* :class:`RqBackend`: records in Redis; each attempt is an rq job
  (``<id>-a<attempt>``) on queue ``ELMO_JOBS_QUEUE``, run by ``elmo-service
  worker`` (:class:`elmo_jobs.worker.JobWorker`, an ``rq.Worker``; the job function is
  :func:`elmo_jobs.worker.rq_entry`).
* :class:`LocalBackend`: records in ``<runs_dir>/<id>/job.json``; a local
  worker process (``elmo-service worker`` without REDIS_URL, or the one the API
  starts itself) claims the oldest queued record.

:meth:`JobBackend.reconcile` is how a job is never silently lost: a running
job whose runner is gone (its process is dead on this host, rq failed its
execution, or its heartbeat stopped) goes back to the queue as the next
attempt and resumes from its checkpoint (or fails, with the reason, after
``ELMO_JOBS_MAX_ATTEMPTS`` losses; a trainer killed by a signal under a live
runner counts the same way, :mod:`elmo_jobs.runner`); a queued job whose delivery vanished is
delivered again. Workers run it at start and between jobs; the API runs it
when jobs are listed or read.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from elmo_jobs.lifecycle import requeue
from elmo_jobs.procs import runner_alive
from elmo_jobs.settings import JobsSettings
from elmo_jobs.state import (
    JOB_ID,
    FileJobStore,
    JobRecord,
    JobStore,
    RedisJobStore,
    StoreUnavailable,
    name_holder_free,
    store_errors,
)
from elmo_storage import connect

log = logging.getLogger("jobs")

QUEUED_GRACE = 30.0  # a queued record younger than this may still be being enqueued
WORKER_SEEN = 30.0  # seconds without a sign of a worker before a queued job says so
WORKERS_DIR = ".workers"  # <runs_dir>/.workers/<name>: a local worker's heartbeat (mtime)


class JobBackend:
    kind: str = ""
    store: JobStore

    def __init__(self, settings: JobsSettings) -> None:
        self.settings = settings
        self._reconciled = 0.0
        self._reconcile_lock = threading.Lock()

    def deliver(self, rec: JobRecord) -> None:
        """Make a queued record reach a worker."""
        raise NotImplementedError

    def undeliver(self, rec: JobRecord) -> None:
        """Best effort: drop a cancelled queued job's delivery."""

    def resume_pending(self) -> None:
        """After a restart: make sure queued jobs will be picked up."""

    def execution_lost(self, rec: JobRecord) -> str | None:
        """Backend-specific evidence that a running record's execution is gone."""
        return None

    def delivery_lost(self, rec: JobRecord) -> bool:
        """A queued record that no worker will ever see."""
        return False

    def lost_reason(self, rec: JobRecord, now: float) -> str | None:
        """Why a running record's attempt is lost, or None while it may still be alive.

        A runner we can see alive is never lost, whatever the backend says (after a
        Redis blip rq may have failed or forgotten an execution whose horse still runs);
        nor is one whose heartbeat is fresh. Only then does the backend's evidence count.
        """
        r = rec.runner
        alive = runner_alive(r) if r is not None else None
        if alive is False:
            return f"its runner (pid {r.pid} on {r.host}) is gone"
        if alive:
            return None
        beat = rec.heartbeat_at or rec.started_at or rec.updated_at
        if now - beat < self.fresh_beat:
            return None
        found = self.execution_lost(rec)
        if found:
            return found
        if now - beat > self.settings.jobs_heartbeat_timeout:
            return f"no heartbeat for {now - beat:.0f}s"
        return None

    @property
    def fresh_beat(self) -> float:
        """A heartbeat younger than this (runners beat every 2 polls) outweighs what the
        backend says about the execution: long enough to span a store blip's recovery."""
        s = self.settings
        return min(s.jobs_heartbeat_timeout / 2, max(15.0, 10 * s.jobs_poll_interval))

    def reconcile(self, min_interval: float = 0.0) -> list[str]:
        """Re-queue lost running jobs, re-deliver lost queued ones. Returns the ids touched.

        One record that cannot be handled (unreadable: skipped by the store; a failure
        while re-queueing it) is logged and passed over; the others are still handled.
        A store that cannot be reached raises StoreUnavailable."""
        if not self._reconcile_lock.acquire(blocking=False):
            return []
        try:
            now = time.time()
            if now - self._reconciled < min_interval:
                return []
            self._reconciled = now
            self.adopt_orphans()
            touched = []
            for rec in self.store.list():
                try:
                    if self._reconcile_one(rec, now):
                        touched.append(rec.id)
                except StoreUnavailable:
                    raise
                except Exception:  # noqa: BLE001 - one bad record never stops the loop
                    log.exception("job %s: reconcile failed; skipped this time", rec.id)
            return touched
        finally:
            self._reconcile_lock.release()

    def _reconcile_one(self, rec: JobRecord, now: float) -> bool:
        if rec.state == "running":
            reason = self.lost_reason(rec, now)
            if reason is None:
                return False
            log.warning("job %s attempt %d lost: %s", rec.id, rec.attempt, reason)
            changed = requeue(self, rec.id, rec.attempt, reason, lost=True)
            if changed is None:
                return False
            if changed.state == "queued":
                self.deliver(changed)
            return True
        if (
            rec.state == "queued"
            and now - rec.updated_at > QUEUED_GRACE
            and self.delivery_lost(rec)
        ):
            log.warning("job %s attempt %d: re-delivering", rec.id, rec.attempt)
            self.deliver(rec)
            return True
        return False

    def adopt_orphans(self) -> list[str]:
        """Records the store lost but a run folder still holds (a Redis restarted empty)."""
        return []

    def workers_seen(self) -> float | None:
        """Seconds since a worker last showed life (0: one is up now); None: never seen."""
        return 0.0

    def explain(self, rec: JobRecord) -> None:
        """Say why a queued job does not start when no worker is there to run it."""
        if rec.state != "queued":
            return
        try:
            seen = self.workers_seen()
        except Exception:  # noqa: BLE001 - a hint only
            return
        if seen is None:
            rec.hint = "no worker is running: start `elmo-service worker`"
        elif seen > WORKER_SEEN:
            rec.hint = f"no worker has been seen for {seen:.0f} s: start `elmo-service worker`"

    def close(self) -> None:
        self.store.close()


# ---------------------------------------------------------------- rq


def rq_job_id(rec: JobRecord) -> str:
    return f"{rec.id}-a{rec.attempt}"


class RqBackend(JobBackend):
    kind = "rq"

    def __init__(self, settings: JobsSettings, timeout: float | None = None) -> None:
        """``timeout``: socket timeouts, seconds (default ``ELMO_JOBS_STORE_TIMEOUT``: short,
        for the API; workers pass a longer one)."""
        from rq import Queue

        super().__init__(settings)
        assert settings.redis_url
        timeout = timeout or settings.jobs_store_timeout
        self.redis = connect(  # rq's client too: it honours the password
            settings.redis_url,
            password=getattr(settings, "redis_password", None),
            timeout=timeout,
            connect_timeout=min(timeout, 5.0),
            retries=None,  # redis-py's own retries, as rq expects
            health_check_interval=30,  # a connection that died during a blip is replaced
        )
        self.store = RedisJobStore(self.redis, settings.redis_prefix)
        self.queue = Queue(settings.jobs_queue, connection=self.redis)
        self._workers_checked: tuple[float, float | None] = (0.0, None)

    def adopt_orphans(self) -> list[str]:
        """Refill the store from the run folders' copies of records it no longer has (a
        Redis restarted without its data). A queued one is then delivered again by the
        reconcile pass, a running one whose runner is gone re-queued; a live runner
        re-creates its own record at its next heartbeat (:mod:`elmo_jobs.runner`)."""
        runs = Path(self.settings.runs_dir)
        if not runs.is_dir():
            return []
        known = self.store.ids()
        adopted = []
        for copy in runs.glob("j*/job.json"):
            job_id = copy.parent.name
            if job_id in known or not JOB_ID.match(job_id):
                continue
            try:
                rec = JobRecord.model_validate_json(copy.read_bytes())
            except (OSError, ValueError) as e:
                log.error("job %s: the job store lost it and its run-folder copy is unreadable "
                          "(%s); left in %s", job_id, e, copy.parent)  # fmt: skip
                continue
            rec.note("adopted from its run folder: the job store had lost its record")
            if rec.state == "running":  # the copy's heartbeat is its claim's: give the
                rec.heartbeat_at = time.time()  # runner (maybe on another host) time to beat
            if self.store.create_if_absent(rec):
                log.warning("job %s (%s): adopted from %s", job_id, rec.state, copy.parent)
                adopted.append(job_id)
                if rec.state not in ("failed", "cancelled"):  # its model name comes back too
                    holder = self.store.reserve(rec.name, rec.id, name_holder_free(self.store))
                    if holder is not None:
                        log.error("job %s: its name %r is now taken by job %s; it will fail "
                                  "at export", job_id, rec.name, holder)  # fmt: skip
        return adopted

    def workers_seen(self) -> float | None:
        from rq import Worker

        at, seen = self._workers_checked
        if at and time.monotonic() - at < 2.0:
            return seen
        # rq workers register with a TTL: any on our queue is alive (or was, a minute ago)
        with store_errors():
            seen = 0.0 if Worker.count(queue=self.queue) else None
        self._workers_checked = (time.monotonic(), seen)
        return seen

    def deliver(self, rec: JobRecord) -> None:
        with store_errors():  # rq parses Redis's replies: nonsense fails inside it
            self.queue.enqueue(
                "elmo_jobs.worker.rq_entry",  # by name: rq imports it in the work-horse
                rec.id,
                rec.attempt,
                job_id=rq_job_id(rec),
                job_timeout=-1,  # the training budget (steps / max_minutes) bounds a job, not rq
                result_ttl=7 * 24 * 3600,
                failure_ttl=30 * 24 * 3600,
                description=f"pretrain {rec.name} ({rec.id}, attempt {rec.attempt})",
            )

    def _rq_job(self, rec: JobRecord) -> Any:
        from rq.exceptions import NoSuchJobError
        from rq.job import Job

        try:
            with store_errors():
                return Job.fetch(rq_job_id(rec), connection=self.redis)
        except NoSuchJobError:
            return None

    def undeliver(self, rec: JobRecord) -> None:
        with contextlib.suppress(Exception):
            job = self._rq_job(rec)
            if job is not None:
                job.cancel()

    def execution_lost(self, rec: JobRecord) -> str | None:
        job = self._rq_job(rec)
        if job is None:
            return "its rq job is gone"
        status = job.get_status(refresh=False)
        if status in ("failed", "stopped", "canceled"):
            with store_errors():
                result = job.latest_result()
            why = (result.exc_string or "").strip().splitlines() if result else []
            return f"rq marked its execution {status}" + (f" ({why[-1]})" if why else "")
        return None

    def delivery_lost(self, rec: JobRecord) -> bool:
        job = self._rq_job(rec)
        return job is None or job.get_status(refresh=False) in (
            "failed",
            "stopped",
            "canceled",
            "finished",
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.redis.close()


# ---------------------------------------------------------------- local


class LocalBackend(JobBackend):
    """Jobs as files under the runs folder; ``embedded``: the API starts the worker itself."""

    kind = "local"

    def __init__(self, settings: JobsSettings, embedded: bool = False) -> None:
        super().__init__(settings)
        self.store = FileJobStore(Path(settings.runs_dir))
        self.embedded = embedded
        self._proc: subprocess.Popen | None = None
        self._proc_lock = threading.Lock()

    def deliver(self, rec: JobRecord) -> None:
        if self.embedded:
            self.ensure_worker()

    def resume_pending(self) -> None:
        if self.embedded and self.next_queued() is not None:
            self.ensure_worker()

    def workers_seen(self) -> float | None:
        if self.worker_pid is not None:
            return 0.0
        beats = Path(self.settings.runs_dir) / WORKERS_DIR
        times = [p.stat().st_mtime for p in beats.iterdir()] if beats.is_dir() else []
        return time.time() - max(times) if times else None

    def next_queued(self) -> JobRecord | None:
        queued = [r for r in self.store.list() if r.state == "queued"]
        return min(queued, key=lambda r: r.created_at) if queued else None

    def worker_env(self) -> dict[str, str]:
        s = self.settings
        env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "ELMO_REDIS_URL")}
        env.update(
            ELMO_RUNS_DIR=str(Path(s.runs_dir).resolve()),
            ELMO_DATA_DIR=str(Path(s.data_dir).resolve()),
            ELMO_MODELS_DIR=str(Path(s.models_dir).resolve()),
            ELMO_JOBS_MAX_ATTEMPTS=str(s.jobs_max_attempts),
            ELMO_JOBS_HEARTBEAT_TIMEOUT=str(s.jobs_heartbeat_timeout),
            ELMO_JOBS_STOP_TIMEOUT=str(s.jobs_stop_timeout),
            ELMO_JOBS_POLL_INTERVAL=str(s.jobs_poll_interval),
            ELMO_JOBS_PARENT_PID=str(os.getpid()),  # the worker stops when we are gone
            PYTHONUNBUFFERED="1",
        )
        if s.threads:
            env["ELMO_THREADS"] = str(s.threads)
        env["ELMO_JOBS_MEMORY_FRACTION"] = str(s.jobs_memory_fraction)
        if s.jobs_max_memory:
            env["ELMO_JOBS_MAX_MEMORY"] = str(int(s.jobs_max_memory))
        return env

    def ensure_worker(self) -> int:
        """Start the embedded worker process unless it is running. Returns its pid."""
        with self._proc_lock:
            if self._proc is not None and self._proc.poll() is None:
                return self._proc.pid
            runs = Path(self.settings.runs_dir)
            runs.mkdir(parents=True, exist_ok=True)
            with open(runs / "worker.log", "ab") as out:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "elmo_cli.main", "worker"],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=self.worker_env(),
                )
            log.info("started the local job worker (pid %d)", self._proc.pid)
            return self._proc.pid

    @property
    def worker_pid(self) -> int | None:
        p = self._proc
        return p.pid if p is not None and p.poll() is None else None

    def close(self, timeout: float = 10.0) -> None:
        """Stop the embedded worker: its job checkpoints and goes back to the queue."""
        with self._proc_lock:
            p, self._proc = self._proc, None
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("local job worker %d still stopping; leaving it to finish", p.pid)


def make_backend(settings: JobsSettings, embedded: bool = False) -> JobBackend:
    if settings.redis_url:
        return RqBackend(settings)
    return LocalBackend(settings, embedded=embedded and settings.jobs_embedded_worker)
