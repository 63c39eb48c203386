"""``GET /v1/models``: what is served, by this replica and by the fleet, and every artifact
in the models folder; ``POST /v1/models/{name}/activate`` (admin): serve another artifact,
with no failed requests (with Redis: on every replica, see api/fleet.py).

``data`` stays OpenAI-compatible (the model(s) ``/v1/embeddings`` accepts: the
served one); ``artifacts`` lists every artifact in ``ELMO_MODELS_DIR`` with its
version and a provenance summary (``?full=true``: the whole record), ``served: true``
on the one being served; ``fleet`` shows which replica serves what, and whether they agree.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Path, Query, Request

from elmo_api.activation import activate_in_fleet, activate_model
from elmo_api.artifacts import list_artifacts
from elmo_api.deps import HolderDep, ModelDep, SettingsDep, require_admin, require_key
from elmo_api.errors import ApiError, activation_error
from elmo_api.fleet import FleetAgent, default_replica_id, standalone_view
from elmo_api.schemas import ERROR_RESPONSES, Activated, ModelInfo, ModelList

router = APIRouter(prefix="/v1", tags=["models"], dependencies=[Depends(require_key)])

FULL = Query(False, description="Whole provenance records (a corpus manifest can be KBs).")


@router.get(
    "/models",
    response_model=ModelList,
    response_model_exclude_unset=True,  # an unreadable artifact lists its error, not nulls
    responses=ERROR_RESPONSES,
    summary="Served model (OpenAI-style list), the fleet, and every artifact in the models folder",
)
async def list_models(
    request: Request, served: ModelDep, settings: SettingsDep, full: bool = FULL
) -> dict[str, Any]:
    agent: FleetAgent | None = request.app.state.fleet
    artifacts = await asyncio.to_thread(list_artifacts, settings.models_dir, served, full)
    if agent is not None:
        fleet = await agent.view()
    else:
        fleet = standalone_view(
            request.app.state.holder, settings.replica_id or default_replica_id()
        )
    return {
        "object": "list",
        "data": [served.info(full=full)],
        "served": {"id": served.name, "version": served.version},
        "models_dir": settings.models_dir.name,  # its name, not the server's absolute path
        "artifacts": artifacts,
        "fleet": fleet,
    }


@router.get(
    "/models/{model_id}",
    response_model=ModelInfo,
    responses=ERROR_RESPONSES,
    summary="One served model, with its whole provenance",
)
async def get_model_info(model_id: str, served: ModelDep) -> dict[str, Any]:
    if model_id not in (served.name, served.version):
        raise ApiError(404, "not_found", f"model {model_id!r} is not served", "model_id")
    return served.info()


@router.post(
    "/models/{name}/activate",
    response_model=Activated,
    responses={
        **ERROR_RESPONSES,
        404: ERROR_RESPONSES[401] | {"description": "No such artifact"},
    },
    summary="Serve another artifact of the models folder (admin); in-flight requests finish. "
    "With Redis: recorded as the fleet's model, which every replica converges to",
    dependencies=[Depends(require_admin)],
)
async def activate(
    request: Request,
    holder: HolderDep,
    settings: SettingsDep,
    name: str = Path(..., description="Artifact folder name in the models folder"),
) -> dict[str, Any]:
    state = request.app.state
    if holder.current is None:
        raise ApiError(503, "not_ready", "the model is loading", None, {"Retry-After": "5"})
    fleet = None
    try:
        if state.fleet is not None:
            new, old, fleet = await activate_in_fleet(
                state.fleet, settings, state.cache_backend, state.io, state.metrics, name
            )
        else:
            new, old = await activate_model(
                holder, settings, state.cache_backend, state.io, state.metrics, name
            )
    except Exception as e:
        answer = activation_error(e, name)  # api/errors.py: what each refusal answers
        if answer is None:
            raise
        raise answer from e
    return {
        "activated": new.info(),
        "previous": {"id": old.name, "version": old.version} if old is not None else None,
        "changed": old is not None,
        "fleet": fleet,
    }
