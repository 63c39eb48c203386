"""``POST /v1/embed``: contextual vectors per token (or word, or pooled), any layers or mix."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import Response

from api import outputs
from api.deps import ServingDep
from api.encoding import JSONBytesResponse, dumps
from api.errors import ApiError
from api.responses import check_response_floats, streamed_json
from api.routers.common import ClientGone, check_request_limits, embed_request
from api.schemas import ERROR_RESPONSES, EmbedRequest, EmbedResponse
from api.served import ServedModel
from api.tasks_store import StoreUnavailable
from elmo_service.outputs import OutputSpec, plan_output, render
from elmo_service.scalar_mix import MixSpec

router = APIRouter(prefix="/v1", tags=["embed"])

# answers with more floats than this are built off the event loop and streamed
_STREAM_FLOATS = 200_000


async def resolve_output(req: EmbedRequest, served: ServedModel) -> OutputSpec:
    """The request's output spec (``elmo_service.outputs``), its task looked up off the loop."""
    inline_extras = {
        "gamma": req.gamma,
        "per_direction": req.per_direction,
        "layer_norm": req.layer_norm,
    }
    if req.mix is None:
        for name, value in inline_extras.items():
            if value is not None:
                raise ApiError(
                    422,
                    "invalid_input",
                    f"{name} applies to an inline mix: give mix weights too",
                    name,
                )
    inline = None
    if req.mix is not None:
        inline = MixSpec(
            weights=list(req.mix),
            gamma=1.0 if req.gamma is None else req.gamma,
            per_direction=bool(req.per_direction),
            layer_norm=bool(req.layer_norm),
        )
    spec = plan_output(
        served.n_layers,
        output=req.output,
        layers=req.layers,
        mix=inline,
        task=req.task,
        granularity=req.granularity,
        pooling=req.pooling,
    )
    if spec.pending is None:
        return spec
    if spec.wants_default:
        return spec.using(*await served.default_mix_async())
    loop = asyncio.get_running_loop()
    try:
        found = await loop.run_in_executor(served.io, served.tasks.spec, spec.pending)
    except StoreUnavailable as e:
        raise ApiError(503, "store_unavailable", str(e), "task", {"Retry-After": "5"}) from e
    if found is None:
        listed = await loop.run_in_executor(served.io, _safe_list, served)
        known = ", ".join(t["name"] for t in listed) or "none"
        raise ApiError(
            422, "unknown_task", f"unknown task {spec.pending!r} (known: {known})", "task"
        )
    return spec.with_mix(found[0])


def _safe_list(served: ServedModel) -> list[dict[str, Any]]:
    try:
        return served.tasks.list()
    except StoreUnavailable:
        return []


def mix_cause(req: EmbedRequest, task: str | None) -> str | None:
    """The request field that chose the mix's scale: what a non-finite mix is blamed on."""
    if req.mix is not None:
        return "gamma" if req.gamma not in (None, 1.0) else "mix"
    return "task" if task is not None else None


def build_sentence(
    index: int,
    text: str,
    tokens: list,
    layers: np.ndarray,
    req: EmbedRequest,
    spec: OutputSpec,
    cause: str | None = None,
) -> dict[str, Any]:
    """One ``data`` entry. ``cause``: the request field a non-finite mix would come from."""
    out: dict[str, Any] = {"index": index}
    what = f"sentences[{index}]"
    if spec.granularity == "word":
        out["words"] = outputs.words_meta(tokens, text)
    else:
        out["tokens"] = [
            {"text": t.text, "start": t.start, "end": t.end, "word": t.word} for t in tokens
        ]
    x, m = render(layers, tokens, spec)
    if x is not None:
        enc = outputs.encode_checked(x, req.encoding, req.dtype, what=what, cause=None)
        out["layers"] = {**enc, "indices": list(spec.layers)}
    if m is not None:
        out["mix"] = outputs.encode_checked(m, req.encoding, req.dtype, what=what, cause=cause)
    return out


def build_parts(
    served: ServedModel,
    req: EmbedRequest,
    texts: list[str],
    token_lists: list,
    arrays: list[np.ndarray],
    spec: OutputSpec,
    hits: int,
    misses: int,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The answer without its ``data``, and its ``data`` entries (every check done)."""
    cause = mix_cause(req, spec.task)
    data = [
        build_sentence(i, texts[i], token_lists[i], arrays[i], req, spec, cause)
        for i in range(len(arrays))
    ]
    head = {
        "object": "embed_result",
        "model": {"id": served.name, "version": served.version},
        "task": spec.task,
        "usage": {
            "sentences": len(arrays),
            "tokens": sum(len(t) for t in token_lists),
            "cache_hits": hits,
            "cache_misses": misses,
        },
    }
    return head, data


def build_body(*args: Any) -> bytes:
    head, data = build_parts(*args)
    return dumps({**head, "data": data})


def response_floats(token_lists: list, spec: OutputSpec, dim: int) -> tuple[int, str]:
    """The floats the answer will carry, and how (for the 413), from the request alone."""
    outputs_per_position = (len(spec.layers) if spec.layers is not None else 0) + (
        spec.mix is not None
    )
    if spec.pooling != "none":
        positions = len(token_lists)
        what = "pooled"
    elif spec.granularity == "word":
        positions = sum(len({t.word for t in toks}) for toks in token_lists)
        what = "words"
    else:
        positions = sum(len(toks) for toks in token_lists)
        what = "tokens"
    detail = (
        f"{len(token_lists)} sentences, {positions:,} {what} x {outputs_per_position} "
        f"output layers x {dim} dims"
    )
    return positions * outputs_per_position * dim, detail


@router.post(
    "/embed",
    response_model=EmbedResponse,
    responses=ERROR_RESPONSES,
    summary="Contextual embeddings of sentences",
    description=(
        "Per-token (or per-word, or pooled) vectors: any subset of the biLM's layers, a scalar mix "
        "(a registered task, inline weights, or by default the 'default' task / the layer average), or both. "
        "Identical sentences give identical vectors whether alone, batched with others, cached or not."
    ),
)
async def embed(
    req: EmbedRequest,
    request: Request,
    ctx: ServingDep,
) -> Response:
    served, settings = ctx.served, ctx.settings
    check_request_limits(req.sentences, settings, "sentences")
    spec = await resolve_output(req, served)

    size = [0]  # the answer's floats, counted once by the check below

    def bound(token_lists: list) -> None:  # before any work: the answer's size, from the request
        size[0], detail = response_floats(token_lists, spec, served.dim)
        check_response_floats(size[0], settings, "sentences", detail)

    try:
        embedded = await embed_request(
            request, served, req.sentences, "sentences", check=bound, priority=req.priority
        )
    except ClientGone:
        return Response(status_code=499)
    token_lists, arrays = embedded.tokens, embedded.layers
    hits, misses = embedded.hits, embedded.misses
    n_floats = size[0]
    texts = [s if isinstance(s, str) else " ".join(s) for s in req.sentences]
    args = (served, req, texts, token_lists, arrays, spec, hits, misses)
    if n_floats <= _STREAM_FLOATS:
        return JSONBytesResponse(build_body(*args))
    # checked (finite, in range) before the status line goes out; then encoded and sent
    # a sentence at a time, off the event loop
    head, data = await asyncio.to_thread(build_parts, *args)
    del arrays, args
    return streamed_json(head, "data", data)
