"""The jobs module's face to the HTTP layer: submit, list, read, cancel, retry.

All methods block (files, Redis): the router runs them on :attr:`JobService.executor`,
a small pool of this service's own, so a job store that hangs (each call bounded by
``ELMO_JOBS_STORE_TIMEOUT``) stalls ``/v1/jobs`` and nothing else.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from elmo_jobs.backend import JobBackend, make_backend
from elmo_jobs.memory import check_memory, memory_limit
from elmo_jobs.settings import JobsSettings
from elmo_jobs.spec import (
    JobIn,
    Limits,
    check_limits,
    resolve_corpus,
    resolve_train_config,
    softmax_size,
)
from elmo_jobs.state import JobRecord, Unreadable, name_holder_free, new_job_id
from elmo_service.errors import ElmoServiceError

log = logging.getLogger("jobs")

RECONCILE_EVERY = 2.0  # seconds; reads of the job list re-check lost jobs at most this often
EXECUTOR_THREADS = 4  # concurrent job-store calls from the API; more wait their turn


class JobNotFound(Exception):
    pass


class JobConflict(Exception):
    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message, self.field = message, field


class JobService:
    def __init__(self, settings: JobsSettings, backend: JobBackend | None = None) -> None:
        self.settings = settings
        self.backend = backend or make_backend(settings, embedded=True)
        self.limits = Limits.of_this_machine(
            settings.jobs_max_steps, settings.jobs_max_threads, settings.jobs_gpus
        )
        self.executor = ThreadPoolExecutor(EXECUTOR_THREADS, thread_name_prefix="jobs")

    @property
    def kind(self) -> str:
        return self.backend.kind

    @property
    def unreadable(self) -> dict[str, str]:
        """Records the last list skipped (id -> why)."""
        return dict(self.backend.store.unreadable)

    def start(self) -> None:
        """On API start: pick up what an earlier run left (lost or still queued jobs)."""
        self.backend.reconcile()
        self.backend.resume_pending()

    def _name_free(self, name: str, job_id: str, run_dir: str | None = None) -> None:
        """Reserve ``name`` for ``job_id`` (atomic: one of many racing submits wins)."""
        dest = Path(self.settings.models_dir) / name
        if dest.exists() and not (run_dir and _exported_from(dest, run_dir)):
            raise JobConflict(f"the models folder already holds a model named {name!r}", "name")
        store = self.backend.store
        holder = store.reserve(name, job_id, name_holder_free(store))
        if holder is not None:
            raise JobConflict(f"job {holder} already builds {name!r}", "name")

    def public(self, message: str) -> str:
        """``message`` with the server's folders named as the API names them (``models/x``,
        never ``/srv/.../models/x``): a caller learns nothing of the server's layout."""
        s = self.settings
        for folder, name in ((s.models_dir, "models"), (s.data_dir, "data"), (s.runs_dir, "runs")):
            for form in {str(Path(folder).resolve()), str(Path(folder).absolute())}:
                message = message.replace(form, name)
        return message

    def submit(self, job: JobIn) -> JobRecord:
        """Validate (422 errors name the field), reserve the name, record as queued, deliver."""
        try:
            corpus = resolve_corpus(self.settings.data_dir, job.corpus)
            train_config = resolve_train_config(job, self.settings.models_dir)
            check_limits(job, train_config, self.limits)
            s = self.settings
            vocab, vocab_field = softmax_size(corpus, job)
            limit = memory_limit(s.jobs_max_memory, s.jobs_memory_fraction)
            check_memory(train_config, vocab, limit, vocab_field)
        except ElmoServiceError as e:
            if self.public(e.message) == e.message:
                raise
            e.message = self.public(e.message)  # the same error, its paths made relative
            e.args = (e.message,)
            raise
        job_id = new_job_id()
        name = job.name or job_id
        self._name_free(name, job_id)
        rec = JobRecord(
            id=job_id,
            name=name,
            backend=self.backend.kind,  # type: ignore[arg-type]
            spec=job.model_dump(),
            train_config=train_config,
            run_dir=str(Path(self.settings.runs_dir).resolve() / job_id),
        )
        rec.progress.total_steps = train_config["train"]["steps"]
        rec.note("queued")
        self.backend.store.create(rec)
        self._deliver(rec)
        log.info("job %s (%s) queued", job_id, name)
        return rec

    def _deliver(self, rec: JobRecord) -> None:
        try:
            self.backend.deliver(rec)
        except Exception as e:
            why = f"could not be queued: {e}"
            self.backend.store.update(rec.id, lambda r: r.finish("failed", why) or True)
            raise

    def list(self, state: str | None = None, limit: int = 100) -> list[JobRecord]:
        self.backend.reconcile(RECONCILE_EVERY)
        recs = self.backend.store.list()
        if state:
            recs = [r for r in recs if r.state == state]
        out = recs[:limit]
        for r in out:
            self.backend.explain(r)
        return out

    def get(self, job_id: str) -> JobRecord:
        self.backend.reconcile(RECONCILE_EVERY)
        rec = self.backend.store.get(job_id)
        if rec is None:
            raise JobNotFound(job_id)
        self.backend.explain(rec)
        return rec

    def cancel(self, job_id: str) -> JobRecord:
        """Queued: cancelled at once. Running: the runner stops its phase (the trainer
        checkpoints) within a poll or two and marks it cancelled. Finished: conflict."""

        def fn(r: JobRecord) -> bool:
            if r.terminal or r.cancel_requested:
                return False
            if r.state == "queued":
                r.finish("cancelled")
            else:
                r.cancel_requested = True
                r.note("cancel requested")
            return True

        rec, _ = self.backend.store.update(job_id, fn)
        if rec is None:
            raise JobNotFound(job_id)
        if rec.state in ("succeeded", "failed"):
            raise JobConflict(f"job {job_id} already {rec.state}", "job_id")
        if rec.state == "cancelled":
            self.backend.undeliver(rec)
        return rec

    def retry(self, job_id: str) -> JobRecord:
        """A failed or cancelled job goes back to the queue as its next attempt and resumes
        from its run folder: the prepared corpus is reused, the trainer continues from
        its newest checkpoint (``--resume``). Its loss count starts again."""
        rec = self.backend.store.get(job_id)
        if rec is None:
            raise JobNotFound(job_id)
        if rec.state not in ("failed", "cancelled"):
            raise JobConflict(
                f"job {job_id} is {rec.state}; only a failed or cancelled job can be retried",
                "job_id",
            )
        self._name_free(rec.name, job_id, str(Path(rec.run_dir) / "train"))

        def fn(r: JobRecord) -> bool:
            if r.state not in ("failed", "cancelled"):
                return False
            r.state, r.attempt, r.losses = "queued", r.attempt + 1, 0
            r.error, r.cancel_requested, r.finished_at = None, False, None
            r.runner, r.heartbeat_at, r.phase = None, None, None
            r.note(f"retried as attempt {r.attempt}: resumes from its run folder")
            return True

        rec, written = self.backend.store.update(job_id, fn)
        if rec is None:
            raise JobNotFound(job_id)
        if not written:
            raise JobConflict(f"job {job_id} is {rec.state} (changed meanwhile)", "job_id")
        self._deliver(rec)
        log.info("job %s (%s) retried as attempt %d", job_id, rec.name, rec.attempt)
        return rec

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.backend.close()


def _exported_from(dest: Path, train_dir: str) -> bool:
    """Whether the model folder ``dest`` is this run's own export (a retry may keep it)."""
    from elmo_service.artifact import read_config

    try:
        return read_config(dest).get("provenance", {}).get("run") == str(Path(train_dir).resolve())
    except Exception:  # noqa: BLE001 - unreadable: not ours
        return False


__all__ = ["JobConflict", "JobNotFound", "JobService", "Unreadable"]
