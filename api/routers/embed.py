"""``POST /v1/embed``: contextual vectors per token (or word, or pooled), any layers or mix."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import Response

from elmo_api import outputs
from elmo_api.deps import ServingDep
from elmo_api.encoding import JSONBytesResponse, dumps
from elmo_api.errors import ApiError
from elmo_api.responses import streamed_json
from elmo_api.routers.common import ClientGone, check_request_limits, embed_request
from elmo_api.schemas import ERROR_RESPONSES, EmbedRequest, EmbedResponse
from elmo_api.served import ServedModel
from elmo_service.outputs import OutputSpec, positions, render
from elmo_service.scalar_mix import MixSpec

router = APIRouter(prefix="/v1", tags=["embed"])

# answers with more floats than this are built off the event loop and streamed
_STREAM_FLOATS = 200_000


def output_options(req: EmbedRequest) -> dict[str, Any]:
    """The request's output options (``ServedModel.output_spec``); ``gamma`` and friends
    without ``mix`` weights are a 422 naming them."""
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
    return {
        "output": req.output,
        "layers": req.layers,
        "mix": inline,
        "task": req.task,
        "granularity": req.granularity,
        "pooling": req.pooling,
    }


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
        out["words"] = [
            {"start": w.start, "end": w.end, "text": w.text} for w in positions(tokens, spec, text)
        ]
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
    spec = await served.output_spec(**output_options(req))
    try:
        embedded = await embed_request(
            request,
            served,
            req.sentences,
            "sentences",
            spec,
            settings.max_response_floats,
            priority=req.priority,
        )
    except ClientGone:
        return Response(status_code=499)
    token_lists, arrays = embedded.tokens, embedded.layers
    hits, misses = embedded.hits, embedded.misses
    n_floats = embedded.floats
    texts = [s if isinstance(s, str) else " ".join(s) for s in req.sentences]
    args = (served, req, texts, token_lists, arrays, spec, hits, misses)
    if n_floats <= _STREAM_FLOATS:
        return JSONBytesResponse(build_body(*args))
    # checked (finite, in range) before the status line goes out; then encoded and sent
    # a sentence at a time, off the event loop
    head, data = await asyncio.to_thread(build_parts, *args)
    return streamed_json(head, "data", data)
