"""The holder of the served model: what routes get through a dependency, and the swap.

``swap`` replaces the model atomically: requests in flight keep the ServedModel
they started with; the old batcher drains before it is closed.
"""

from __future__ import annotations

import asyncio
import logging
import time

from elmo_api.served import ServedModel

log = logging.getLogger("elmo_api.holder")


class ModelHolder:
    """Holds the served model; routes get it via ``elmo_api.deps.ModelDep``, never a global."""

    def __init__(self) -> None:
        self._current: ServedModel | None = None
        self._swap_lock = asyncio.Lock()

    @property
    def current(self) -> ServedModel | None:
        return self._current

    @property
    def ready(self) -> bool:
        return self._current is not None and self._current.warmed and self._current.runner.alive

    async def swap(
        self, new: ServedModel, *, warm: bool = True, drain_timeout: float | None = None
    ) -> ServedModel | None:
        """Warm ``new``, make it current, let the old one finish its requests, close it.

        No request fails because of a swap: a request pinned the model it started
        with (its announcement to that model's batcher), so the old model is closed
        only once nothing is announced, queued or running there any more, bounded
        by ``drain_timeout`` (default: the old model's request timeout + 5 s).
        Swaps are serialised, so a request never sees its model closed under it.
        """
        async with self._swap_lock:
            if warm and not new.warmed:
                await new.warm_up()
            old, self._current = self._current, new
            if old is not None:
                timeout = drain_timeout if drain_timeout is not None else old.request_timeout + 5
                await self._drain(old, timeout)
                await asyncio.to_thread(old.close)
                if old.metrics is not None:
                    old.metrics.model_info.labels(old.name, old.version).set(0)
        return old

    @staticmethod
    async def _drain(old: ServedModel, timeout: float) -> None:
        quiet_for = old.runner.quiet_for
        deadline = time.monotonic() + timeout
        quiet_since: float | None = None
        while time.monotonic() < deadline:
            now = time.monotonic()
            if old.runner.idle:
                quiet_since = quiet_since or now
                if now - quiet_since >= quiet_for:
                    return
            else:
                quiet_since = None
            await asyncio.sleep(0.01)
        log.warning(
            "model %s still busy after %.0fs; closing it (draining its queue)", old.name, timeout
        )

    async def close(self) -> None:
        cur, self._current = self._current, None
        if cur is not None:
            await asyncio.to_thread(cur.close)
