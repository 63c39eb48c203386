"""Pretraining jobs: submitted through the API, run by ``elmo-service worker``.

* :mod:`elmo_jobs.spec`: the request body and its validation (corpus path, config);
* :mod:`elmo_jobs.state`: the job record and its stores (a JSON file per job, or Redis);
* :mod:`elmo_jobs.backend`: delivery (rq, or a local worker process) and lost-job recovery;
* :mod:`elmo_jobs.runner`: running one job: prepare -> train -> export subprocesses;
* :mod:`elmo_jobs.lifecycle`: record transitions both share (re-queue a lost attempt);
* :mod:`elmo_jobs.procs`: a runner's identity and liveness, the parent-death signal;
* :mod:`elmo_jobs.service`: what the HTTP layer calls;
* :mod:`elmo_jobs.worker`: ``elmo-service worker`` (rq, or the local loop);
* :mod:`elmo_jobs.settings`: the service settings this package reads.

It may import ``pretrain`` and ``elmo_service``; ``api`` imports only what is
exported here (``tests/test_boundaries.py`` holds both).
"""

from elmo_jobs.service import JobConflict, JobNotFound, JobService
from elmo_jobs.settings import JobsSettings
from elmo_jobs.spec import JobIn
from elmo_jobs.state import JobRecord, StoreUnavailable, Unreadable
from elmo_jobs.worker import run_worker

__all__ = [
    "JobConflict",
    "JobIn",
    "JobNotFound",
    "JobRecord",
    "JobService",
    "JobsSettings",
    "StoreUnavailable",
    "Unreadable",
    "run_worker",
]
