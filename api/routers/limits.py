"""``GET /v1/limits``: the bounds one request must stay under, so that a client can split
a large input into requests the server accepts (the Python client, ``elmo_client``, reads it).

Read-only, behind the same key as the embedding routes; the values are the settings
the routes check (``api/routers/common.py``, ``api/responses.py``, the body guard).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends

from elmo_api.deps import ModelDep, SettingsDep, require_key
from elmo_api.schemas import ERROR_RESPONSES, Limits

router = APIRouter(prefix="/v1", tags=["models"], dependencies=[Depends(require_key)])


@router.get(
    "/limits",
    response_model=Limits,
    responses=ERROR_RESPONSES,
    summary="Per-request limits (sentences, characters, body bytes, answer floats, tokens)",
)
async def limits(served: ModelDep, settings: SettingsDep) -> dict[str, Any]:
    return {
        "max_sentences": settings.max_sentences,
        "max_chars": settings.max_chars,
        "max_body_bytes": settings.max_body_bytes,
        "max_response_floats": settings.max_response_floats,
        "max_tokens_per_sentence": served.max_tokens_per_sentence,
        "max_queue": settings.max_queue,
        "request_timeout": settings.request_timeout,
        "model": {"id": served.name, "version": served.version},
        "n_layers": served.n_layers,
        "dim": served.dim,
    }
