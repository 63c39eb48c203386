"""Pretraining jobs (admin key required): submit, list, read, cancel, retry.

The router only translates HTTP to :class:`jobs.JobService` calls and its exceptions
to ``{code, message, field}`` errors. The calls run on the service's own executor, not
the event loop's default one (which response encoding and artifact listing share), and
each is bounded: a job store that hangs answers 503 here and slows nothing else.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from fastapi import APIRouter, Depends, Path, Query, Request
from pydantic import BaseModel, Field
from starlette.responses import Response

from elmo_api.deps import require_admin
from elmo_api.encoding import JSONBytesResponse
from elmo_api.errors import ApiError
from elmo_api.schemas import ERROR_RESPONSES
from elmo_jobs import (
    JobIn,
    JobRecord,
    JobService,
    StoreUnavailable,
)

router = APIRouter(prefix="/v1", tags=["jobs"], dependencies=[Depends(require_admin)])

T = TypeVar("T")
JobIdPath = Path(
    ..., description="Job id, as returned by POST /v1/jobs", examples=["j1a2b3c4d5e6f"]
)
RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES,
    403: ERROR_RESPONSES[401] | {"description": "Not an admin key, or no admin keys configured"},
    404: ERROR_RESPONSES[401] | {"description": "No such job"},
    409: ERROR_RESPONSES[401]
    | {"description": "Conflict (name taken, job already finished, record unreadable)"},
}


class UnreadableRecord(BaseModel):
    id: str
    error: str


class JobList(BaseModel):
    object: Literal["list"] = "list"
    backend: Literal["rq", "local"]
    data: list[JobRecord]
    unreadable: list[UnreadableRecord] = Field(
        default_factory=list,
        description="Stored records that could not be read, skipped (also logged).",
    )


def get_jobs(request: Request) -> JobService:
    jobs = getattr(request.app.state, "jobs", None)
    if jobs is None:
        raise ApiError(503, "not_ready", "the job service is starting", None, {"Retry-After": "5"})
    return jobs


async def _call(jobs: JobService, fn: Callable[..., T], *args: Any) -> T:
    loop = asyncio.get_running_loop()
    # the store's own timeouts bound each call; this bounds a queue of calls behind them
    deadline = max(10.0, 5 * jobs.settings.jobs_store_timeout)
    try:  # the jobs' own errors (not found, conflict, store down) map in api/errors.py
        return await asyncio.wait_for(
            loop.run_in_executor(jobs.executor, functools.partial(fn, *args)), deadline
        )
    except TimeoutError as e:
        raise StoreUnavailable(f"the job store did not answer within {deadline:.0f}s") from e


def _out(rec: JobRecord) -> dict[str, Any]:
    return rec.model_dump(mode="json")


@router.post(
    "/jobs",
    status_code=202,
    responses={**RESPONSES, 202: {"model": JobRecord, "description": "Queued"}},
    summary="Submit a pretraining job (admin)",
)
async def submit_job(body: JobIn, jobs: JobService = Depends(get_jobs)) -> Response:
    rec = await _call(jobs, jobs.submit, body)
    return JSONBytesResponse(_out(rec), status_code=202, headers={"Location": f"/v1/jobs/{rec.id}"})


@router.get(
    "/jobs",
    response_model=JobList,
    responses=RESPONSES,
    summary="List jobs, newest first (admin)",
)
async def list_jobs(
    state: Literal["queued", "running", "succeeded", "failed", "cancelled"] | None = Query(None),
    limit: int = Query(100, ge=1, le=1000),
    jobs: JobService = Depends(get_jobs),
) -> dict[str, Any]:
    recs = await _call(jobs, jobs.list, state, limit)
    bad = [{"id": i, "error": why} for i, why in sorted(jobs.unreadable.items())]
    return {
        "object": "list",
        "backend": jobs.kind,
        "data": [_out(r) for r in recs],
        "unreadable": bad,
    }


@router.get(
    "/jobs/{job_id}",
    response_model=JobRecord,
    responses=RESPONSES,
    summary="A job: state, progress, log tail, artifact (admin)",
)
async def get_job(job_id: str = JobIdPath, jobs: JobService = Depends(get_jobs)) -> dict[str, Any]:
    return _out(await _call(jobs, jobs.get, job_id))


@router.post(
    "/jobs/{job_id}/cancel",
    response_model=JobRecord,
    responses=RESPONSES,
    summary="Cancel a job; a running trainer checkpoints first (admin)",
)
async def cancel_job(
    job_id: str = JobIdPath, jobs: JobService = Depends(get_jobs)
) -> dict[str, Any]:
    return _out(await _call(jobs, jobs.cancel, job_id))


@router.post(
    "/jobs/{job_id}/retry",
    status_code=202,
    responses={**RESPONSES, 202: {"model": JobRecord, "description": "Queued again"}},
    summary="Retry a failed or cancelled job; it resumes from its run folder (admin)",
)
async def retry_job(job_id: str = JobIdPath, jobs: JobService = Depends(get_jobs)) -> Response:
    rec = await _call(jobs, jobs.retry, job_id)
    return JSONBytesResponse(_out(rec), status_code=202, headers={"Location": f"/v1/jobs/{rec.id}"})
