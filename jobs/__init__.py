"""Pretraining jobs: submitted through the API, run by ``elmo-service worker``.

* :mod:`jobs.spec`: the request body and its validation (corpus path, config);
* :mod:`jobs.state`: the job record and its stores (a JSON file per job, or Redis);
* :mod:`jobs.backend`: delivery (rq, or a local worker process) and lost-job recovery;
* :mod:`jobs.runner`: running one job: prepare -> train -> export subprocesses;
* :mod:`jobs.lifecycle`: record transitions both share (re-queue a lost attempt);
* :mod:`jobs.procs`: a runner's identity and liveness, the parent-death signal;
* :mod:`jobs.service`: what the HTTP layer calls;
* :mod:`jobs.worker`: ``elmo-service worker`` (rq, or the local loop);
* :mod:`jobs.settings`: the service settings this package reads.

It may import ``pretrain`` and ``elmo_service``; ``api`` imports only what is
exported here (``tests/test_boundaries.py`` holds both).
"""

from jobs.service import JobConflict, JobNotFound, JobService
from jobs.settings import JobsSettings
from jobs.spec import JobIn
from jobs.state import JobRecord, StoreUnavailable, Unreadable
from jobs.worker import run_worker

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
