"""``AsyncClient``: ``Client``'s surface with ``await``, on httpx's async client."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import httpx

from elmo_service.client import ops
from elmo_service.client.errors import ServiceError, ServiceUnreachable
from elmo_service.client.sync import Connection
from elmo_service.client.wire import (
    Call,
    Http,
    Limits,
    Many,
    Sleep,
    attempts,
    stops_the_rest,
)


class AsyncClient(Connection):
    """``Client`` for asyncio: the same parameters, methods and answers, each awaited
    (``await client.embed(...)``, ``await client.tasks.list()``, ``await client.jobs.wait(job)``)."""

    _http_class = httpx.AsyncClient

    async def embed(
        self,
        sentences: Sequence[str | Sequence[str]],
        *,
        mix: Any = None,
        granularity: str = "token",
        output: str | None = None,
        pooling: str = "none",
    ) -> ops.EmbedResult:
        """See :meth:`Client.embed`."""
        return await self._run(
            ops.embed(
                self._session, sentences, mix=mix, granularity=granularity,
                output=output, pooling=pooling,
            )
        )  # fmt: skip

    async def limits(self, refresh: bool = False) -> Limits:
        return await self._run(ops.limits(self._session, refresh))

    async def ready(self) -> dict[str, Any]:
        return await self._run(ops.one(Call("GET", "/readyz")))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- the driver (Client._run's, awaited) ----------------------------------
    async def _run(self, op: ops.Op) -> Any:
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                step = op.send(value) if error is None else op.throw(error)
            except StopIteration as stop:
                return stop.value
            value, error = None, None
            try:
                if isinstance(step, Http):
                    value = await self._attempt(step.call)
                elif isinstance(step, Call):
                    value = await self._send(step)
                elif isinstance(step, Many):
                    value = await self._many(step.calls)
                elif isinstance(step, Sleep):
                    await asyncio.sleep(step.seconds)
                else:
                    raise TypeError(f"unknown step {step!r}")
            except Exception as e:
                error = e

    async def _send(self, call: Call) -> Any:
        return await self._run(attempts(call, self.retry, self.base_url))

    async def _attempt(self, call: Call) -> tuple[int, str | None, bytes]:
        try:
            r = await self._http.request(
                call.method, call.path, content=call.body(), params=call.params
            )
        except (httpx.TransportError, httpx.InvalidURL) as e:
            raise ServiceUnreachable(self.base_url + call.path, e) from None
        return r.status_code, r.headers.get("retry-after"), r.content

    async def _many(self, calls: list[Call]) -> list[Any]:
        gate = asyncio.Semaphore(self.max_in_flight)
        stop = asyncio.Event()

        async def one(call: Call) -> Any:
            async with gate:
                if stop.is_set():
                    return None
                try:
                    return await self._send(call)
                except ServiceError as e:
                    if stops_the_rest(e):
                        stop.set()
                    return e
                except BaseException:
                    stop.set()
                    raise

        results = await asyncio.gather(*(one(c) for c in calls), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, ServiceError):
                raise r
        return results
