"""``GET /v1/models``: what is served and every artifact in the models folder;
``POST /v1/models/{name}/activate`` (admin): serve another artifact, with no failed requests.

``data`` stays OpenAI-compatible (the model(s) ``/v1/embeddings`` accepts: the
served one); ``artifacts`` lists every artifact in ``ELMO_MODELS_DIR`` with its
version and provenance, ``served: true`` on the one being served.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Path, Request

from api.activation import activate_model
from api.artifacts import list_artifacts
from api.deps import HolderDep, ModelDep, SettingsDep, require_admin, require_key
from api.errors import ApiError
from api.schemas import ERROR_RESPONSES, Activated, ModelInfo, ModelList
from elmo_service.errors import ArtifactError

router = APIRouter(prefix="/v1", tags=["models"], dependencies=[Depends(require_key)])


@router.get(
    "/models",
    response_model=ModelList,
    response_model_exclude_unset=True,  # an unreadable artifact lists its error, not nulls
    responses=ERROR_RESPONSES,
    summary="Served model (OpenAI-style list) and every artifact in the models folder",
)
async def list_models(served: ModelDep, settings: SettingsDep) -> dict[str, Any]:
    artifacts = await asyncio.to_thread(list_artifacts, settings.models_dir, served)
    return {
        "object": "list",
        "data": [served.info()],
        "served": {"id": served.name, "version": served.version},
        "models_dir": str(settings.models_dir),
        "artifacts": artifacts,
    }


@router.get(
    "/models/{model_id}",
    response_model=ModelInfo,
    responses=ERROR_RESPONSES,
    summary="One served model",
)
async def get_model_info(model_id: str, served: ModelDep) -> dict[str, Any]:
    if model_id not in (served.name, served.version):
        raise ApiError(404, "not_found", f"model {model_id!r} is not served", "model_id")
    return served.info()


@router.post(
    "/models/{name}/activate",
    response_model=Activated,
    responses={**ERROR_RESPONSES, 404: ERROR_RESPONSES[401] | {"description": "No such artifact"}},
    summary="Serve another artifact of the models folder (admin); in-flight requests finish",
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
    try:
        new, old = await activate_model(
            holder, settings, state.cache_backend, state.io, state.metrics, name
        )
    except LookupError as e:
        raise ApiError(404, "not_found", f"no model {name!r} in the models folder", "name") from e
    except ArtifactError as e:  # still being written, or broken: the served model stays
        raise ApiError(
            422, "bad_artifact", f"model {name!r} cannot be loaded: {e.message}", "name"
        ) from e
    return {
        "activated": new.info(),
        "previous": {"id": old.name, "version": old.version} if old is not None else None,
        "changed": old is not None,
    }
