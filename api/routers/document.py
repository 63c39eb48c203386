"""``POST /v1/embed/document``: a whole document as one sequence, streamed chunk by chunk.

The library's ``Embedder.embed_document`` (``elmo_service/document.py``, docs/documents.md)
behind HTTP. The body is ``/v1/embed``'s output options with ``document`` (a string, or a
list of words) and ``chunk_tokens`` instead of ``sentences``. The answer is
``application/x-ndjson``: one line per chunk, shaped as one element of ``/v1/embed``'s
``data`` (``index`` 0: the one document) plus ``"chunk": k``; then
``{"done": true, "chunks": n, "tokens": T}`` (T: the positions the lines listed: the
document's tokens, or its words at word granularity; 0 when pooled, whose one line lists
none). Errors found before the first line (the
options, the document's size, an empty document, a word over the limit) are ordinary 4xx
JSON; one met later is a last line ``{"error": {code, message, field}}``.

Limits: the document's own (``ELMO_MAX_DOCUMENT_TOKENS``, ``ELMO_MAX_DOCUMENT_CHARS``;
the body guard's ``ELMO_MAX_BODY_BYTES`` first); each chunk is held to ``/v1/embed``'s
per-sentence token limit and answer-size bound (``chunk_tokens`` is what a 413 names).

Bounded (``elmo_api.documents``): the streams at once, their tokens in flight and their
spill bytes have settings; past one, a 429 with ``Retry-After`` before any work starts.
Pass 1 is batch-lane work of the model's runner (``elmo_api.document_rounds``): a round
at a time, computed on the batcher's model thread -- the server's only model caller --
together with the other documents' rounds in one batched step, never before queued
interactive sentences and taking turns with batch-lane ones; a round that waits over
``ELMO_REQUEST_TIMEOUT`` for the model ends the stream with a ``timeout`` error. The
document's own thread (it ends with the document) waits for the rounds and then reads
pass 2 from the spills; a bounded queue holds at most two chunks' lines ahead of the
client. A client that leaves stops the work within one round, in pass 1
too (the route watches for the disconnect), and its slot and spills are freed.

Timing: ``X-Tokenization-Time`` (and ``X-Total-Time`` so far) in the headers; the done
line's ``timings`` has the rest (``total_ms``, ``tokenization_ms``, ``contextualize_ms``:
pass 1 with its waits for the model, ``answer_ms``: pass 2 as the client read it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import StreamingResponse

from elmo_api import outputs
from elmo_api.deps import ServingDep
from elmo_api.document_rounds import ROUND_TOKENS, RoundTimeout
from elmo_api.documents import DocumentStreams, spill_bytes
from elmo_api.encoding import dumps
from elmo_api.errors import ApiError, answer_of, error_body
from elmo_api.lanes import BATCH
from elmo_api.responses import check_response_floats
from elmo_api.routers.embed import mix_cause, output_options
from elmo_api.schemas import ERROR_RESPONSES, REQUEST_CONFIG, Number, Sentence
from elmo_api.served import ModelTimeout
from elmo_api.timing import TIMING_KEY
from elmo_service.document import (
    DEFAULT_CHUNK_TOKENS,
    DocumentCancelled,
    DocumentRun,
    tokenize_document,
)
from elmo_service.outputs import positions as answer_positions

router = APIRouter(prefix="/v1", tags=["embed"])
log = logging.getLogger("api")

NDJSON = "application/x-ndjson"
_AHEAD = 2  # chunks' lines encoded ahead of the client
_WATCH_S = 0.2  # how often a running document asks whether its client is still there


class DocumentRequest(BaseModel):
    """``/v1/embed``'s output options, a ``document`` and its ``chunk_tokens``."""

    model_config = ConfigDict(
        **REQUEST_CONFIG,
        json_schema_extra={
            "examples": [
                {"document": "A long text. Its second sentence sees the first.", "output": "mix"},
                {"document": ["Pre", "tokenized", "words"], "chunk_tokens": 256},
            ]
        },
    )

    document: Sentence = Field(
        ..., description="The document: text (tokenized by the model) or a list of words."
    )
    chunk_tokens: int | None = Field(
        None,
        ge=1,
        description="Tokens per answer chunk (default: the per-sentence token limit, at most "
        f"{DEFAULT_CHUNK_TOKENS}); the vectors do not depend on it.",
    )
    output: Literal["layers", "mix", "both"] | None = None
    layers: list[int] | None = None
    task: str | None = None
    mix: list[Number] | None = None
    gamma: Number | None = None
    per_direction: bool | None = None
    layer_norm: bool | None = Field(
        None, description="Normalise each layer over the whole document before mixing."
    )
    granularity: Literal["token", "word"] = "token"
    pooling: Literal["none", "mean", "max"] = Field(
        "none", description="Pool over the whole document: one line with one vector."
    )
    encoding: Literal["json", "base64"] = "json"
    dtype: Literal["float32", "float16"] = "float32"
    priority: Literal["interactive", "batch"] = Field(
        "interactive",
        description="Accepted as /v1/embed's; a document's rounds are batch-lane work whatever "
        "it says (never before queued interactive sentences).",
    )


def _chunk_size(req: DocumentRequest, spec, served, settings) -> int:
    """The chunk size, held to /v1/embed's per-sentence limits (413 naming chunk_tokens)."""
    limit = served.max_tokens_per_sentence
    chunk = req.chunk_tokens or min(DEFAULT_CHUNK_TOKENS, limit)
    if chunk > limit:
        raise ApiError(
            413,
            "limit_exceeded",
            f"chunk_tokens {chunk} is over the per-sentence limit of {limit} tokens",
            "chunk_tokens",
        )
    per_position = (len(spec.layers) if spec.layers is not None else 0) + (spec.mix is not None)
    positions = 1 if spec.pooling != "none" else chunk
    detail = f"a chunk of {positions:,} positions x {per_position} outputs x {served.dim} dims"
    check_response_floats(
        positions * per_position * served.dim, settings.max_response_floats, "chunk_tokens", detail
    )
    return chunk


def _line(chunk, req: DocumentRequest, spec, cause: str | None, text: str) -> bytes:
    """One chunk as one element of /v1/embed's ``data``, plus ``chunk``."""
    out: dict[str, Any] = {"index": 0, "chunk": chunk.index}
    what = f"document, chunk {chunk.index}"
    if spec.granularity == "word":
        out["words"] = [
            {"start": w.start, "end": w.end, "text": w.text}
            for w in answer_positions(chunk.tokens, spec, text)
        ]
    else:
        out["tokens"] = [
            {"text": t.text, "start": t.start, "end": t.end, "word": t.word} for t in chunk.tokens
        ]
    if chunk.layers is not None:
        enc = outputs.encode_checked(chunk.layers, req.encoding, req.dtype, what=what, cause=None)
        out["layers"] = {**enc, "indices": list(spec.layers)}
    if chunk.mix is not None:
        out["mix"] = outputs.encode_checked(
            chunk.mix, req.encoding, req.dtype, what=what, cause=cause
        )
    return dumps(out) + b"\n"


@router.post(
    "/embed/document",
    responses={**ERROR_RESPONSES, 200: {"content": {NDJSON: {}}}},
    summary="Contextual embeddings of a whole document, streamed chunk by chunk",
    description=(
        "One sequence over the whole document (the forward LSTMs from its start, the backward "
        "ones from its end), the same vectors as one pass at any chunk size; NDJSON lines of "
        "/v1/embed's data entries plus 'chunk', then a 'done' line (docs/documents.md)."
    ),
)
async def embed_document(req: DocumentRequest, request: Request, ctx: ServingDep):
    served, settings = ctx.served, ctx.settings
    doc_in = req.document
    chars = len(doc_in) if isinstance(doc_in, str) else sum(map(len, doc_in)) + len(doc_in) - 1
    if chars > settings.max_document_chars:
        raise ApiError(
            413,
            "limit_exceeded",
            f"the document has {chars:,} characters; the limit is "
            f"{settings.max_document_chars:,} (ELMO_MAX_DOCUMENT_CHARS)",
            "document",
        )
    spec = await served.output_spec(**output_options(req))  # type: ignore[arg-type]
    chunk = _chunk_size(req, spec, served, settings)
    embedder, runner = served.embedder, served.runner
    timing = request.scope.get(TIMING_KEY)
    t0 = time.perf_counter()
    # tokenizing a long document takes a while: off the event loop; errors are 4xx here
    doc = await asyncio.to_thread(
        tokenize_document,
        embedder.tokenizer,
        doc_in,
        field="document",
        max_tokens=settings.max_document_tokens,
    )
    tokenization = time.perf_counter() - t0
    if timing is not None:  # X-Tokenization-Time now; the rest on the done line
        timing.lane, timing.tokenization, timing.used = BATCH, tokenization, True
    streams: DocumentStreams = request.app.state.documents
    cfg = embedder.cfg
    slot = streams.take(len(doc), spill_bytes(len(doc), embedder.n_layers, cfg.projection_dim))
    cause = mix_cause(req, spec.task)
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[bytes | None] = asyncio.Queue(_AHEAD)
    stop = threading.Event()

    def put(item: bytes | None) -> bool:
        """Hand a line to the event loop, waiting while the client is behind."""
        while not stop.is_set():
            fut = asyncio.run_coroutine_threadsafe(lines.put(item), loop)
            try:
                fut.result(timeout=1.0)
                return True
            except TimeoutError:
                fut.cancel()
        return False

    def work() -> None:
        n = positions = 0
        try:
            started = time.perf_counter()
            first = None
            # pass 1 a round at a time on the model thread, batched with other documents'
            # rounds (elmo_api.document_rounds); pass 2 reads the spills here
            run = DocumentRun(
                embedder, doc, spec, chunk, spill_dir=streams.spill_dir, round_tokens=ROUND_TOKENS
            )
            try:
                while not run.done:
                    try:
                        runner.rounds.wait_round(run, stop.is_set, served.request_timeout)
                    except RoundTimeout:
                        raise ModelTimeout(
                            f"a round of the document waited over {served.request_timeout:g}s "
                            "for the model; retry later"
                        ) from None
                for c in run.answer():
                    if stop.is_set():
                        return  # the client left
                    first = first or time.perf_counter()
                    if not put(_line(c, req, spec, cause, doc.text)):
                        return  # the client left
                    n += 1
                    positions += len(c.tokens)
            finally:
                run.close()  # the spill files go now (no round of it is in the model)
            # "tokens": the positions the chunk lines listed (a reader checks it against
            # what came): the document's tokens, its words at word granularity, 0 pooled
            done = {"done": True, "chunks": n, "tokens": positions}
            end = time.perf_counter()
            timings = {  # milliseconds; the headers went out before the work began
                "total_ms": (end - t0) * 1e3,
                "tokenization_ms": tokenization * 1e3,
                "contextualize_ms": ((first or end) - started) * 1e3,  # pass 1, waits included
                "answer_ms": (end - (first or end)) * 1e3,  # pass 2 and the client's reading
            }
            put(dumps({**done, "timings": {k: round(v, 3) for k, v in timings.items()}}) + b"\n")
        except DocumentCancelled:
            return  # the client left while pass 1 ran: nothing to say, nobody to say it to
        except Exception as e:  # noqa: BLE001 - the stream has begun: an error line, then the end
            status, code, message, field, _ = answer_of(e)  # api/errors.py's one table
            if status >= 500:
                log.exception("document stream failed after %d chunks", n)
            put(dumps({"error": {**error_body(code, message, field), "status": status}}) + b"\n")
        finally:
            put(None)
            # the slot frees when the work does (whether or not the answer was ever read)
            loop.call_soon_threadsafe(streams.give_back, slot)

    async def watch_client() -> None:
        """The client leaving stops the work within one round, before any line exists."""
        while not stop.is_set():
            if await request.is_disconnected():
                stop.set()
                return
            await asyncio.sleep(_WATCH_S)

    thread = threading.Thread(target=work, name="elmo-document", daemon=True)
    thread.start()
    watcher = asyncio.create_task(watch_client())

    async def body() -> AsyncIterator[bytes]:
        try:
            while (line := await lines.get()) is not None:
                yield line
        finally:
            stop.set()
            watcher.cancel()
            with contextlib.suppress(asyncio.QueueEmpty):
                while True:
                    lines.get_nowait()

    return StreamingResponse(body(), media_type=NDJSON)
