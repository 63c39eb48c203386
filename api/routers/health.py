"""Liveness, readiness and Prometheus metrics (never behind auth)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import PlainTextResponse, Response

from elmo_api.cache import RedisCache
from elmo_api.deps import HolderDep, MetricsDep
from elmo_api.encoding import JSONBytesResponse
from elmo_api.errors import error_body
from elmo_api.schemas import Health, NotReady, Ready
from elmo_api.selftest import ensure_selftest, summarize

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="Liveness: the process answers")
async def healthz() -> dict[str, Any]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    response_model=Ready,
    responses={
        503: {
            "model": NotReady,
            "description": "Loading or warming up; or, with Redis, the fleet's state never "
            "read since start (unjoined); or (ELMO_FLEET_STALE_READY=unready) unread for "
            "over ELMO_FLEET_TTL; or (ELMO_READY_REQUIRES_SELFTEST=true) the served model's "
            "self-test did not pass",
        }
    },
    summary="Readiness: model loaded and warmed; cache backend state",
)
async def readyz(request: Request, holder: HolderDep) -> Response:
    served = holder.current
    if not holder.ready or served is None:
        body = error_body(
            "not_ready", "the model is loading" if served is None else "the model is warming up"
        )
        return JSONBytesResponse(
            {**body, "status": "starting"}, status_code=503, headers={"Retry-After": "5"}
        )
    fleet = request.app.state.fleet
    health = None
    if fleet is not None:
        health = {"stale": fleet.stale, "state_age": fleet.state_age(), "error": fleet.redis_error}
        if not fleet.joined:  # whatever ELMO_FLEET_STALE_READY says: it never was in the fleet
            body = error_body("fleet_unjoined", fleet.unjoined_message())
            return JSONBytesResponse(
                {**body, "status": "unjoined", "fleet": health},
                status_code=503,
                headers={"Retry-After": "5"},
            )
        if fleet.stale and request.app.state.settings.fleet_stale_ready == "unready":
            body = error_body(
                "fleet_stale",
                f"the fleet's state unread for {health['state_age']:.0f}s "
                f"({fleet.redis_error or 'no answer'}): out of rotation (ELMO_FLEET_STALE_READY)",
            )
            return JSONBytesResponse(
                {**body, "status": "stale", "fleet": health},
                status_code=503,
                headers={"Retry-After": "5"},
            )
    selftest = None
    if request.app.state.settings.ready_requires_selftest:
        result = await ensure_selftest(served)
        selftest = summarize(result)
        if result["ok"] is not True:
            body = error_body(
                "selftest_failed",
                f"the served model's self-test did not pass ({result['status']}"
                + (f": {result['error']}" if result.get("error") else "")
                + "): out of rotation (ELMO_READY_REQUIRES_SELFTEST)",
            )
            return JSONBytesResponse(
                {**body, "status": "selftest_failed", "selftest": selftest},
                status_code=503,
                headers={"Retry-After": "30"},
            )
    cache = served.cache.state()
    backend = served.cache.backend
    if isinstance(backend, RedisCache):
        cache["reachable"] = await asyncio.get_running_loop().run_in_executor(
            served.io, backend.ping
        )
    return JSONBytesResponse(
        {
            "status": "ready",
            "model": {"id": served.name, "version": served.version},
            "queue_depth": served.runner.depth,
            "cache": cache,
            "tasks_store": served.tasks.store.kind,
            "fleet": health,
            "selftest": selftest,
        }
    )


@router.get(
    "/metrics",
    summary="Prometheus metrics (text exposition format)",
    response_class=PlainTextResponse,
)
async def metrics(m: MetricsDep) -> Response:
    if m is None:
        return Response(status_code=503)
    data, content_type = m.render()
    return Response(data, media_type=content_type)
