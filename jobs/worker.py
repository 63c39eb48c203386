"""``elmo-service worker``: runs pretraining jobs.

With ``REDIS_URL``: an rq worker (:class:`JobWorker`) on queue ``ELMO_JOBS_QUEUE``.
Each job runs in rq's work-horse (a fork); the horse gets SIGTERM if this
process dies, so its trainer checkpoints and the job is re-queued. A warm
shutdown (SIGTERM/SIGINT, e.g. ``docker stop``) does the same instead of
waiting hours for the job to end. On start and between jobs it re-queues jobs
whose worker is gone (:meth:`jobs.backend.JobBackend.reconcile`).

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

from jobs.backend import LocalBackend, RqBackend
from jobs.procs import die_with_parent
from jobs.runner import JobRunner
from jobs.settings import JobsSettings

log = logging.getLogger("jobs.worker")

# The settings of this worker process, for the job function below: rq forks each
# work-horse from this process, so the horse sees what run_rq_worker set here.
_settings: JobsSettings | None = None


def _make_rq_worker_class():
    from rq import Worker

    class JobWorker(Worker):
        """An rq worker that re-queues lost jobs and stops jobs gracefully on shutdown."""

        backend: RqBackend

        def handle_warm_shutdown_request(self) -> None:
            super().handle_warm_shutdown_request()
            if self.horse_pid:  # the job checkpoints and goes back to the queue
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.horse_pid, signal.SIGTERM)

        def run_maintenance_tasks(self) -> None:
            super().run_maintenance_tasks()
            self._reconcile()

        def execute_job(self, job, queue) -> None:
            super().execute_job(job, queue)
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
    backend = RqBackend(settings)
    runner = JobRunner(backend, settings, job_id, attempt, worker=os.environ.get("RQ_WORKER_ID"))
    old = signal.signal(signal.SIGTERM, lambda *_: runner.request_stop())
    try:
        return runner.run()
    finally:
        signal.signal(signal.SIGTERM, old)
        backend.close()


def run_rq_worker(settings: JobsSettings, burst: bool = False) -> int:
    global _settings
    _settings = settings
    backend = RqBackend(settings)
    cls = _make_rq_worker_class()
    worker = cls(
        [backend.queue],
        connection=backend.redis,
        name=f"elmo-{socket.gethostname()}-{os.getpid()}",
        maintenance_interval=30,
        job_monitoring_interval=5,
    )
    worker.backend = backend
    backend.reconcile()  # jobs whose worker died before we started
    worker.work(burst=burst, logging_level="INFO")
    return 0


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

    def work(self, burst: bool = False) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        log.info("local job worker %s on %s", self.name, self.settings.runs_dir)
        last = 0.0
        while not self.stopping:
            if time.monotonic() - last > 5:
                self.backend.reconcile()
                last = time.monotonic()
            rec = self.backend.next_queued()
            if rec is not None:
                self.runner = JobRunner(
                    self.backend, self.settings, rec.id, rec.attempt, worker=self.name
                )
                if self.stopping:
                    break
                try:
                    outcome = self.runner.run()
                finally:
                    self.runner = None
                log.info("job %s attempt %d: %s", rec.id, rec.attempt, outcome)
                continue
            if burst or self._parent_gone():
                break
            time.sleep(self.settings.jobs_poll_interval)
        return 0


def run_worker(settings: JobsSettings, burst: bool = False) -> int:
    """``elmo-service worker``: an rq worker with ``REDIS_URL``, else the local one."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if settings.redis_url:
        return run_rq_worker(settings, burst)
    return LocalWorker(settings).work(burst)
