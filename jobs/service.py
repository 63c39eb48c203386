"""The jobs module's face to the HTTP layer: submit, list, read, cancel.

All methods block (files, Redis): the router calls them off the event loop.
"""

from __future__ import annotations

import logging
from pathlib import Path

from jobs.backend import JobBackend, make_backend
from jobs.memory import check_memory, memory_limit
from jobs.settings import JobsSettings
from jobs.spec import JobIn, resolve_corpus, resolve_train_config, softmax_size
from jobs.state import JobRecord, new_job_id

log = logging.getLogger("jobs")

RECONCILE_EVERY = 2.0  # seconds; reads of the job list re-check lost jobs at most this often


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

    @property
    def kind(self) -> str:
        return self.backend.kind

    def start(self) -> None:
        """On API start: pick up what an earlier run left (lost or still queued jobs)."""
        self.backend.reconcile()
        self.backend.resume_pending()

    def submit(self, job: JobIn) -> JobRecord:
        """Validate (422 errors name the field), record as queued, deliver."""
        corpus = resolve_corpus(self.settings.data_dir, job.corpus)
        train_config = resolve_train_config(job)
        s = self.settings
        vocab, vocab_field = softmax_size(corpus, job)
        limit = memory_limit(s.jobs_max_memory, s.jobs_memory_fraction)
        check_memory(train_config, vocab, limit, vocab_field)
        job_id = new_job_id()
        name = job.name or job_id
        if (Path(self.settings.models_dir) / name).exists():
            raise JobConflict(f"the models folder already holds a model named {name!r}", "name")
        for other in self.backend.store.list():
            if other.name == name and other.state not in ("failed", "cancelled"):
                raise JobConflict(f"job {other.id} ({other.state}) already builds {name!r}", "name")
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
        try:
            self.backend.deliver(rec)
        except Exception as e:
            why = f"could not be queued: {e}"
            self.backend.store.update(job_id, lambda r: r.finish("failed", why) or True)
            raise
        log.info("job %s (%s) queued", job_id, name)
        return rec

    def list(self, state: str | None = None, limit: int = 100) -> list[JobRecord]:
        self.backend.reconcile(RECONCILE_EVERY)
        recs = self.backend.store.list()
        if state:
            recs = [r for r in recs if r.state == state]
        return recs[:limit]

    def get(self, job_id: str) -> JobRecord:
        self.backend.reconcile(RECONCILE_EVERY)
        rec = self.backend.store.get(job_id)
        if rec is None:
            raise JobNotFound(job_id)
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

    def close(self) -> None:
        self.backend.close()
