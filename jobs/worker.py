"""``elmo-service worker``: runs pretraining jobs.

With ``REDIS_URL``: an rq worker (:class:`JobWorker`) on queue ``ELMO_JOBS_QUEUE``.
Each job runs in rq's work-horse (a fork); the horse gets SIGTERM if this
process dies, so its trainer checkpoints and the job is re-queued. A warm
shutdown (SIGTERM/SIGINT, e.g. ``docker stop``) does the same instead of
waiting hours for the job to end. On start and between jobs it re-queues jobs
whose worker is gone (:meth:`elmo_jobs.backend.JobBackend.reconcile`).

Without Redis: a local loop over ``<runs_dir>/*/job.json`` that claims the
oldest queued job and runs it in this process (the trainer is a subprocess).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
from pathlib import Path

from elmo_jobs.backend import WORKERS_DIR, LocalBackend, RqBackend
from elmo_jobs.procs import die_with_parent
from elmo_jobs.runner import JobRunner
from elmo_jobs.settings import JobsSettings
from elmo_service.errors import ConfigError
from elmo_storage import RedisAuthError, check_auth

log = logging.getLogger("elmo_jobs.worker")

WORKER_STORE_TIMEOUT = 5  # workers' Redis timeouts: this many times the API's (they can wait)

# The settings of this worker process, for the job function below: rq forks each
# work-horse from this process, so the horse sees what run_rq_worker set here.
_settings: JobsSettings | None = None


def _make_rq_worker_class():
    import redis
    from rq import Worker

    class JobWorker(Worker):
        """An rq worker that re-queues lost jobs, stops jobs gracefully on shutdown, and
        rides out Redis outages: its own bookkeeping (heartbeats, state, registering its
        death) is skipped while Redis is away, so a running job's horse is never left
        behind and training goes on; :func:`run_rq_worker` re-enters the loop after."""

        backend: RqBackend
        shutting_down = False

        def _tolerate(self, what: str, fn, *args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except redis.RedisError as e:
                self.log.warning("Worker %s: %s skipped, Redis unavailable: %s", self.name, what, e)
                return None

        def handle_warm_shutdown_request(self) -> None:
            self.shutting_down = True
            super().handle_warm_shutdown_request()
            if self.horse_pid:  # the job checkpoints and goes back to the queue
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.horse_pid, signal.SIGTERM)

        def heartbeat(self, *args, **kwargs) -> None:
            self._tolerate("heartbeat", super().heartbeat, *args, **kwargs)

        def maintain_heartbeats(self, job, execution) -> None:
            # during a job: a failure here used to end the worker and kill the training
            self._tolerate("job heartbeat", super().maintain_heartbeats, job, execution)

        def set_state(self, state, pipeline=None) -> None:
            self._tolerate("state update", super().set_state, state, pipeline)

        def set_shutdown_requested_date(self) -> None:
            self._tolerate("shutdown date", super().set_shutdown_requested_date)

        def check_for_suspension(self, burst: bool) -> None:
            self._tolerate("suspension check", super().check_for_suspension, burst)

        def register_birth(self) -> None:
            # our name is ours alone (it holds the pid): a key left by an earlier pass
            # of the loop whose death could not be registered is not another worker
            self.connection.delete(self.key)
            super().register_birth()

        def register_death(self) -> None:
            self._tolerate("registering death", super().register_death)

        def unsubscribe(self) -> None:
            self._tolerate("unsubscribe", super().unsubscribe)

        def run_maintenance_tasks(self) -> None:
            self._tolerate("maintenance", super().run_maintenance_tasks)
            self._reconcile()

        def execute_job(self, job, queue) -> None:
            try:
                super().execute_job(job, queue)
            except redis.RedisError as e:  # rq's bookkeeping after the horse; our record is ours
                self.log.warning("Worker %s: job %s bookkeeping failed: %s", self.name, job.id, e)
            self._reconcile()  # a horse that died under its job is noticed at once

        def _reconcile(self) -> None:
            try:
                self.backend.reconcile()
            except Exception:  # never let bookkeeping take the worker down
                self.log.exception("job reconcile failed")

    return JobWorker


def rq_entry(job_id: str, attempt: int) -> str:
    """The rq job function: runs in the rq work-horse (a fork of the worker)."""
    die_with_parent(signal.SIGTERM)  # the worker died: stop the trainer with a checkpoint
    settings = _settings
    if settings is None:
        raise RuntimeError(
            "pretraining jobs run under `elmo-service worker`, not a plain rq worker"
        )
    backend = RqBackend(settings, timeout=WORKER_STORE_TIMEOUT * settings.jobs_store_timeout)
    runner = JobRunner(backend, settings, job_id, attempt, worker=os.environ.get("RQ_WORKER_ID"))
    old = signal.signal(signal.SIGTERM, lambda *_: runner.request_stop())
    try:
        return runner.run()
    finally:
        signal.signal(signal.SIGTERM, old)
        backend.close()


def run_rq_worker(settings: JobsSettings, burst: bool = False) -> int:
    import redis

    global _settings
    _settings = settings
    backend = RqBackend(settings, timeout=WORKER_STORE_TIMEOUT * settings.jobs_store_timeout)
    cls = _make_rq_worker_class()
    pause = 1.0
    while True:  # rq talks to Redis as it builds the worker: a Redis still away is waited for
        try:
            worker = cls(
                [backend.queue],
                connection=backend.redis,
                name=f"elmo-{socket.gethostname()}-{os.getpid()}",
                maintenance_interval=30,
                job_monitoring_interval=5,
            )
            break
        except redis.RedisError as e:
            log.warning("rq worker: Redis unavailable at start (%s); retrying in %.0fs", e, pause)
            time.sleep(pause)
            pause = min(pause * 2, 30.0)
    worker.backend = backend
    worker._reconcile()  # jobs whose worker died before we started
    pause = 1.0
    while True:
        try:
            worker.work(burst=burst, logging_level="INFO")
            pause = 1.0
        except redis.RedisError as e:  # at start (registering): Redis is not back yet
            log.warning("rq worker: Redis unavailable (%s)", e)
        if burst or worker.shutting_down:
            return 0
        # rq ends its loop on a Redis error it does not handle itself: start it again
        log.warning("rq worker: loop ended while Redis was away; re-entering in %.0fs", pause)
        time.sleep(pause)
        pause = min(pause * 2, 30.0)


class LocalWorker:
    """The no-Redis worker: one job at a time, in this process."""

    def __init__(self, settings: JobsSettings) -> None:
        self.settings = settings
        self.backend = LocalBackend(settings)
        self.name = f"local-{socket.gethostname()}-{os.getpid()}"
        self.runner: JobRunner | None = None
        self.stopping = False
        parent = os.environ.get("ELMO_JOBS_PARENT_PID")
        self.parent_pid = int(parent) if parent and parent.isdigit() else None

    def _on_signal(self, signum, frame) -> None:
        self.stopping = True
        if self.runner is not None:
            self.runner.request_stop()

    def _parent_gone(self) -> bool:
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    def _beat(self) -> None:
        """Touch ``<runs_dir>/.workers/<name>``: queued jobs tell how long ago a worker lived."""
        beat = Path(self.settings.runs_dir) / WORKERS_DIR / self.name
        with contextlib.suppress(OSError):
            beat.parent.mkdir(parents=True, exist_ok=True)
            beat.touch()

    def work(self, burst: bool = False) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        log.info("local job worker %s on %s", self.name, self.settings.runs_dir)
        last = 0.0
        while not self.stopping:
            self._beat()
            try:
                if time.monotonic() - last > 5:
                    last = time.monotonic()
                    self.backend.reconcile()
                rec = self.backend.next_queued()
                if rec is not None:
                    self._run(rec)
                    continue
            except Exception:  # noqa: BLE001 - one bad job or record never ends the worker
                log.exception("local job worker: error; going on")
            if burst or self._parent_gone():
                break
            time.sleep(self.settings.jobs_poll_interval)
        with contextlib.suppress(OSError):
            (Path(self.settings.runs_dir) / WORKERS_DIR / self.name).unlink()
        return 0

    def _run(self, rec) -> None:
        self.runner = JobRunner(self.backend, self.settings, rec.id, rec.attempt, worker=self.name)
        if self.stopping:
            return
        try:
            outcome = self.runner.run()
        finally:
            self.runner = None
        log.info("job %s attempt %d: %s", rec.id, rec.attempt, outcome)


def run_worker(settings: JobsSettings, burst: bool = False) -> int:
    """``elmo-service worker``: an rq worker with ``REDIS_URL``, else the local one."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if settings.redis_url:
        try:  # a refused password fails closed, in one line; an outage is ridden out
            check_auth(settings.redis_url, getattr(settings, "redis_password", None))
        except RedisAuthError as e:
            raise ConfigError(str(e), field="redis_password") from None
        return run_rq_worker(settings, burst)
    return LocalWorker(settings).work(burst)
