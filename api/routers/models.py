"""``GET /v1/models``: the served model's config, version and provenance."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from api.deps import get_model, require_key
from api.errors import ApiError
from api.schemas import ERROR_RESPONSES
from api.service import ServedModel

router = APIRouter(prefix="/v1", tags=["models"], dependencies=[Depends(require_key)])


@router.get("/models", responses=ERROR_RESPONSES, summary="Served models (OpenAI-style list)")
async def list_models(served: ServedModel = Depends(get_model)) -> dict[str, Any]:
    return {"object": "list", "data": [served.info()]}


@router.get("/models/{model_id}", responses=ERROR_RESPONSES, summary="One served model")
async def get_model_info(model_id: str, served: ServedModel = Depends(get_model)) -> dict[str, Any]:
    if model_id not in (served.name, served.version):
        raise ApiError(404, "not_found", f"model {model_id!r} is not served", "model_id")
    return served.info()
