"""Job-record transitions shared by the runner and the backends (no import between them)."""

from __future__ import annotations

from typing import Protocol

from elmo_jobs.settings import JobsSettings
from elmo_jobs.state import JobRecord, JobStore


class Backend(Protocol):
    """What the runner needs of a backend (:class:`elmo_jobs.backend.JobBackend`)."""

    store: JobStore
    settings: JobsSettings

    def deliver(self, rec: JobRecord) -> None: ...


def requeue(
    backend: Backend, job_id: str, attempt: int, reason: str, *, lost: bool
) -> JobRecord | None:
    """Move a running job (at ``attempt``) back to the queue as ``attempt + 1``.

    ``lost``: its worker died or its trainer was killed (counts towards
    ``jobs_max_attempts``; past it the job fails with the reason, which is also kept
    in ``last_loss``). A job with a pending cancel is cancelled instead.
    Returns the record if this call changed it (the caller then delivers it).
    """
    max_losses = backend.settings.jobs_max_attempts

    def fn(r: JobRecord) -> bool:
        if r.attempt != attempt or r.state != "running":
            return False
        r.runner, r.heartbeat_at = None, None
        if lost:
            r.losses += 1
            r.last_loss = reason
        if r.cancel_requested:
            r.finish("cancelled", None)
        elif lost and r.losses >= max_losses:
            r.finish(
                "failed", f"lost {r.losses} times (worker died or trainer killed); last: {reason}"
            )
        else:
            r.state, r.attempt = "queued", r.attempt + 1
            r.note(f"re-queued as attempt {r.attempt}: {reason}")
        return True

    rec, written = backend.store.update(job_id, fn)
    return rec if written else None
