"""Helpers shared by the embedding routes: limits, running work, client disconnects."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from starlette.requests import Request

from elmo_api.errors import ApiError
from elmo_api.middleware import TICKET_KEY
from elmo_api.served import Embedded, ServedModel
from elmo_api.settings import Settings
from elmo_api.timing import TIMING_KEY
from elmo_service.outputs import OutputSpec

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected while its request waited."""


def check_request_limits(
    sentences: Sequence[str | Sequence[str]], settings: Settings, field: str
) -> None:
    """Sentences per request and characters per request (before any tokenization)."""
    if not sentences:
        raise ApiError(422, "invalid_input", f"{field} must hold at least one sentence", field)
    if len(sentences) > settings.max_sentences:
        raise ApiError(
            413,
            "limit_exceeded",
            f"{len(sentences)} sentences in one request; the limit is {settings.max_sentences}",
            field,
        )
    chars = 0
    for s in sentences:
        chars += len(s) if isinstance(s, str) else sum(map(len, s)) + max(len(s) - 1, 0)
    if chars > settings.max_chars:
        raise ApiError(
            413,
            "limit_exceeded",
            f"{chars} characters in one request; the limit is {settings.max_chars}",
            field,
        )


def check_dimensions(dimensions: int | None, served: ServedModel, hint: str = "") -> None:
    """OpenAI's and TEI's ``dimensions``: this model's vector size, or omitted (no Matryoshka
    truncation: an ELMo vector cut short is not a smaller embedding)."""
    if dimensions is not None and dimensions != served.dim:
        raise ApiError(
            422,
            "invalid_input",
            f"dimensions={dimensions} is not supported: this model's vectors have "
            f"{served.dim} dimensions{hint}",
            "dimensions",
        )


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_guarded(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it (its queued
    sentences are then dropped before the model) and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise ClientGone()


async def embed_request(
    request: Request,
    served: ServedModel,
    sentences: list,
    field: str,
    spec: OutputSpec | None = None,
    max_floats: int | None = None,
    priority: str = "interactive",
    tokens: list | None = None,
) -> Embedded:
    """:meth:`ServedModel.embed` with the request's ticket, cancelled when the client goes
    (ClientGone). ``priority``: the batcher's lane; ``tokens``: the sentences' tokens, when
    the route already has them; the request's timing (``X-*-Time``, left
    in the scope by the TimingMiddleware) is filled in on the way. Its refusals (queue full,
    timeout, too large) are answered by ``api/errors.py``'s table."""
    ticket = request.scope.get(TICKET_KEY)
    timing = request.scope.get(TIMING_KEY)
    work = served.embed(
        sentences,
        field=field,
        ticket=ticket,
        spec=spec,
        max_floats=max_floats,
        lane=priority,
        timing=timing,
        tokens=tokens,
    )
    return await run_guarded(request, work)
