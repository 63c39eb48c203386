"""Serving another artifact of the models folder while the server runs (hot swap).

Without Redis, :func:`activate_model` swaps this process's model. With Redis,
:func:`activate_in_fleet` also records the artifact as the fleet's desired state,
which every replica's :class:`elmo_api.fleet.FleetAgent` converges to.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from elmo_api.artifacts import resolve_artifact
from elmo_api.cache import CacheBackend
from elmo_api.fleet import FleetAgent
from elmo_api.holder import ModelHolder
from elmo_api.loading import load_served_model_async
from elmo_api.metrics import Metrics
from elmo_api.served import ServedModel
from elmo_api.settings import Settings
from elmo_service.artifact import read_manifest

log = logging.getLogger("elmo_api.activation")


async def load_warm(
    settings: Settings,
    backend: CacheBackend,
    io: ThreadPoolExecutor,
    metrics: Metrics | None,
    path: Path,
) -> ServedModel:
    """Load ``path`` and warm it up, ready to swap in; closed again if warming fails."""
    served = await load_served_model_async(settings, backend, io, metrics, path)
    try:
        await served.warm_up()
    except BaseException:
        await asyncio.to_thread(served.close)
        raise
    return served


async def _is_served(cur: ServedModel | None, path: Path) -> bool:
    return (
        cur is not None
        and cur.path.resolve() == path
        and (await asyncio.to_thread(read_manifest, path)).get("version") == cur.version
    )


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
    if await _is_served(cur, path):
        return cur, None  # type: ignore[return-value]  # already served
    served = await load_warm(settings, backend, io, metrics, path)
    try:
        old = await holder.swap(served)
    except BaseException:
        await asyncio.to_thread(served.close)
        raise
    _log_swap(served, old)
    return served, old


async def activate_in_fleet(
    agent: FleetAgent,
    settings: Settings,
    backend: CacheBackend,
    io: ThreadPoolExecutor,
    metrics: Metrics | None,
    name: str,
) -> tuple[ServedModel, ServedModel | None, dict[str, Any]]:
    """Load and warm ``name`` here, record it as the fleet's desired model, swap it in.

    -> (new, old or None, the fleet view just after, with ``recorded``: this call's record;
    ``desired`` may already be a newer one). Nothing is recorded unless this
    replica could load it (LookupError, ArtifactError); a record that Redis did not take
    (NotRecorded) or whose outcome is unknown (OutcomeUnknown: it may land later, and the
    fleet converges on it then) swaps nothing here. Activating the fleet's model again is a
    no-op, so a retry is safe. The other replicas converge on their own.
    """
    path = await asyncio.to_thread(resolve_artifact, settings.models_dir, name)
    async with agent.lock:  # one load-and-swap at a time on this replica
        cur = agent.holder.current
        same = await _is_served(cur, path)
        served = cur if same else await load_warm(settings, backend, io, metrics, path)
        assert served is not None
        try:
            recorded = await agent.record(name, served.version)
        except BaseException:
            if not same:
                await asyncio.to_thread(served.close)
            raise
        old = None if same else await agent.swap(served)
    agent.wake()  # a newer record may have come in meanwhile
    await agent.beat()
    if old is not None:
        _log_swap(served, old)
    view = await agent.view()
    view["recorded"] = recorded.ref()
    return served, old, view


def _log_swap(new: ServedModel, old: ServedModel | None) -> None:
    log.info(
        "activated %s (version %s), replacing %s",
        new.name,
        new.version,
        f"{old.name} ({old.version})" if old else "nothing",
    )
