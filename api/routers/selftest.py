"""``GET /v1/selftest`` (admin): the served model on its artifact's stored sentences."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from elmo_api.deps import ModelDep, require_admin
from elmo_api.errors import ApiError
from elmo_api.schemas import ERROR_RESPONSES, SelfTestResult
from elmo_api.selftest import run_selftest

router = APIRouter(prefix="/v1", tags=["selftest"], dependencies=[Depends(require_admin)])


@router.get(
    "/selftest",
    response_model=SelfTestResult,
    responses=ERROR_RESPONSES,
    summary="Self-test: the served model on the sentences stored with its artifact",
    description=(
        "Runs the served model (not the cache) on the fixed sentences stored with the artifact "
        "at export, each alone and all batched, and answers the largest difference from the "
        "stored vectors and whether every value is within 1e-5 x max(1, |value|) (`ok`; null "
        "when the served precision is not fp32). 404 when the artifact stores no self-test."
    ),
)
async def selftest(served: ModelDep) -> dict[str, Any]:
    result = await run_selftest(served)  # refusals: api/errors.py's table
    if result["status"] == "absent":
        raise ApiError(404, "selftest_absent", result["error"], None)
    return result
