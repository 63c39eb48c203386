"""Serving another artifact of the models folder while the server runs (hot swap)."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from api.artifacts import resolve_artifact
from api.cache import CacheBackend
from api.holder import ModelHolder
from api.loading import load_served_model_async
from api.metrics import Metrics
from api.served import ServedModel
from api.settings import Settings
from elmo_service.artifact import read_manifest

log = logging.getLogger("api.activation")


async def activate_model(
    holder: ModelHolder,
    settings: Settings,
    backend: CacheBackend,
    io: ThreadPoolExecutor,
    metrics: Metrics | None,
    name: str,
) -> tuple[ServedModel, ServedModel | None]:
    """Load ``models_dir/name``, warm it, swap it in (no request fails). -> (new, old or None)."""
    path = await asyncio.to_thread(resolve_artifact, settings.models_dir, name)
    cur = holder.current
    if (
        cur is not None
        and cur.path.resolve() == path
        and (await asyncio.to_thread(read_manifest, path)).get("version") == cur.version
    ):
        return cur, None  # already served
    served = await load_served_model_async(settings, backend, io, metrics, path)
    try:
        old = await holder.swap(served)
    except BaseException:
        await asyncio.to_thread(served.close)
        raise
    log.info(
        "activated %s (version %s), replacing %s",
        served.name,
        served.version,
        f"{old.name} ({old.version})" if old else "nothing",
    )
    return served, old
