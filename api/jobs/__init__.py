"""Pretraining jobs: submitted through the API, run by ``elmo-service worker``.

* :mod:`api.jobs.spec`: the request body and its validation (corpus path, config);
* :mod:`api.jobs.state`: the job record and its stores (a JSON file per job, or Redis);
* :mod:`api.jobs.backend`: delivery (rq, or a local worker process) and lost-job recovery;
* :mod:`api.jobs.runner`: running one job: prepare -> train -> export subprocesses;
* :mod:`api.jobs.service`: what the HTTP layer calls.
"""

from api.jobs.service import JobConflict, JobNotFound, JobService
from api.jobs.spec import JobIn
from api.jobs.state import JobRecord, StoreUnavailable

__all__ = ["JobConflict", "JobIn", "JobNotFound", "JobRecord", "JobService", "StoreUnavailable"]
