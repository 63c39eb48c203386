"""Dependencies: settings, the model holder, metrics and API-key auth.

Routes take them through the ``Annotated`` aliases (``ModelDep``, ``SettingsDep``,
``HolderDep``, ``MetricsDep``, ``ServingDep``), as the FastAPI template does.

Everything hangs off ``app.state`` (set by the factory and lifespan), so two
apps in one process -- tests, a future hot swap -- never share state.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from elmo_api.errors import ApiError
from elmo_api.holder import ModelHolder
from elmo_api.metrics import Metrics
from elmo_api.served import SERVED_KEY, ServedModel
from elmo_api.settings import Settings

bearer = HTTPBearer(auto_error=False, description="API key: `Authorization: Bearer <key>`")


async def get_settings(request: Request) -> Settings:
    settings = getattr(request.app.state, "settings", None)
    if settings is None:
        raise ApiError(503, "not_ready", "the service is starting")
    return settings


async def get_holder(request: Request) -> ModelHolder:
    return request.app.state.holder


async def get_metrics(request: Request) -> Metrics | None:
    return getattr(request.app.state, "metrics", None)


SettingsDep = Annotated[Settings, Depends(get_settings)]
HolderDep = Annotated[ModelHolder, Depends(get_holder)]
MetricsDep = Annotated[Metrics | None, Depends(get_metrics)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


async def get_model(holder: HolderDep) -> ServedModel:
    served = holder.current
    if served is None or not served.warmed:
        raise ApiError(503, "not_ready", "the model is loading", headers={"Retry-After": "5"})
    return served


def _matches(token: str, keys: list[str]) -> bool:
    ok = False
    for k in keys:  # compare with every key: no early exit timing
        ok |= hmac.compare_digest(token.encode(), k.encode())
    return ok


def _unauthorized(message: str) -> ApiError:
    return ApiError(
        401, "unauthorized", message, "authorization", headers={"WWW-Authenticate": "Bearer"}
    )


ModelDep = Annotated[ServedModel, Depends(get_model)]


async def require_key(creds: Credentials, settings: SettingsDep) -> str | None:
    """When ELMO_API_KEYS is set, every /v1 route needs an API key or an admin key."""
    if not settings.api_keys:
        return None
    if creds is None:
        raise _unauthorized("an API key is required: Authorization: Bearer <key>")
    if not _matches(creds.credentials, settings.api_keys + settings.admin_keys):
        raise _unauthorized("invalid API key")
    return creds.credentials


async def require_admin(creds: Credentials, settings: SettingsDep) -> str:
    """Writes need an admin key (ELMO_ADMIN_KEYS); with none configured, writes are refused."""
    if not settings.admin_keys:
        raise ApiError(
            403, "forbidden", "writes are disabled: no admin keys configured (ELMO_ADMIN_KEYS)"
        )
    if creds is None:
        raise _unauthorized("an admin API key is required: Authorization: Bearer <key>")
    if not _matches(creds.credentials, settings.admin_keys):
        if _matches(creds.credentials, settings.api_keys):
            raise ApiError(
                403,
                "forbidden",
                "this API key may not write; an admin key is required",
                "authorization",
            )
        raise _unauthorized("invalid API key")
    return creds.credentials


class Serving:
    """What an embedding route needs, resolved by one dependency (the hot path)."""

    __slots__ = ("served", "settings")

    def __init__(self, served: ServedModel, settings: Settings) -> None:
        self.served, self.settings = served, settings


async def serving(request: Request, creds: Credentials) -> Serving:
    """Auth (as ``require_key``) + settings + the current model, in one step."""
    settings = await get_settings(request)
    await require_key(creds, settings)
    served = await get_model(request.app.state.holder)
    request.scope[SERVED_KEY] = served  # the version that answers: X-Model-Version
    return Serving(served, settings)


ServingDep = Annotated[Serving, Depends(serving)]
