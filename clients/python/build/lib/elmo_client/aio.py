"""``AsyncClient``: ``Client``'s surface with ``await``, on httpx's async client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx

from elmo_client import ops
from elmo_client.document import document_call
from elmo_client.errors import ServiceError
from elmo_client.shared import EmbeddedSentence
from elmo_client.sync import Connection, reply_of, unreachable
from elmo_client.wire import (
    Call,
    Http,
    Limits,
    Many,
    Open,
    Reply,
    Sleep,
    attempts,
    opening,
    stops_the_rest,
)


class AsyncClient(Connection):
    """``Client`` for asyncio: the same parameters, methods and answers, each awaited
    (``await client.embed(...)``, ``await client.tasks.list()``, ``await client.jobs.wait(job)``,
    ``async for chunk in client.embed_document(text)``)."""

    def _make_http(self, **kw: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(**kw)

    async def embed(
        self,
        sentences: Sequence[str | Sequence[str]],
        *,
        mix: Any = None,
        granularity: str = "token",
        output: str | None = None,
        pooling: str = "none",
        priority: str | None = None,
        model_version: str | None = None,
    ) -> ops.EmbedResult:
        """See :meth:`Client.embed`."""
        return await self._run(
            ops.embed(
                self._session, sentences, mix=mix, granularity=granularity, output=output,
                pooling=pooling, priority=priority, model_version=model_version,
            )
        )  # fmt: skip

    async def embed_document(
        self,
        document: str | Sequence[str],
        chunk_tokens: int | None = None,
        *,
        mix: Any = None,
        granularity: str = "token",
        output: str | None = None,
        pooling: str = "none",
        priority: str | None = None,
    ) -> AsyncIterator[EmbeddedSentence]:
        """See :meth:`Client.embed_document` (``async for``)."""
        call, reader = document_call(
            self.base_url, document, chunk_tokens, mix=mix, granularity=granularity,
            output=output, pooling=pooling, priority=priority,
        )  # fmt: skip
        r = await self._run(opening(call, self.retry, self.base_url))
        try:
            lines = r.aiter_lines()
            while True:
                try:
                    async with asyncio.timeout(self.timeout):
                        line = await anext(lines)
                except StopAsyncIteration:
                    break
                except (httpx.TransportError, httpx.StreamError, TimeoutError) as e:
                    raise reader.cut(e) from None
                got = reader.feed(line)
                if got is not None:
                    yield got
            reader.finish()
        finally:
            await r.aclose()

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
                elif isinstance(step, Open):
                    value = await self._open(step.call)
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

    async def _attempt(self, call: Call) -> Reply:
        url = self.base_url + call.path
        try:
            # the whole request's deadline (httpx's own timeout is per read)
            async with asyncio.timeout(self.timeout):
                r = await self._http.request(
                    call.method, call.path, content=call.body(), params=call.params
                )
        except (httpx.TransportError, httpx.InvalidURL, TimeoutError) as e:
            raise unreachable(url, e) from None
        return reply_of(r, url, r.content)

    async def _open(self, call: Call) -> tuple[Reply, httpx.Response | None]:
        url = self.base_url + call.path
        try:
            async with asyncio.timeout(self.timeout):
                req = self._http.build_request(
                    call.method, call.path, content=call.body(), params=call.params
                )
                r = await self._http.send(req, stream=True)
                if r.status_code < 400:
                    return reply_of(r, url, b""), r
                try:
                    return reply_of(r, url, await r.aread()), None
                finally:
                    await r.aclose()
        except (httpx.TransportError, httpx.InvalidURL, TimeoutError) as e:
            raise unreachable(url, e) from None

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
