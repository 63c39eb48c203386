"""``POST /v1/embeddings``: OpenAI-compatible, one pooled vector per input.

The vector is the **mean over the input's tokens of the default mix**: the task named
``default`` (stored, or shipped in the artifact) when there is one, else the plain average
of all biLM layers (equal weights, gamma 1), **unit length** as OpenAI's are
(``ELMO_OPENAI_NORMALIZE``; /v1/embed is never normalised). Its width is the model's ``dim``
(2 x projection); ``dimensions`` may only repeat it. ``base64`` is little-endian float32, as
OpenAI's clients expect.

As the SDK and the frameworks call it: up to 2,048 inputs (``ELMO_OPENAI_MAX_INPUTS``),
embedded a few hundred at a time (memory bounded; a request larger than one such part runs
in the batch lane), and token-id input (LangChain's default) decoded with tiktoken
(``api/token_ids.py``). Errors come in OpenAI's body (``api/dialects.py``), so the SDK raises
its own exception types.
"""

from __future__ import annotations

import asyncio

import numpy as np
from fastapi import APIRouter, Request
from starlette.responses import Response

from elmo_api import outputs, token_ids
from elmo_api.deps import ServingDep
from elmo_api.encoding import JSONBytesResponse, dumps
from elmo_api.errors import ApiError
from elmo_api.routers.common import ClientGone, check_dimensions, embed_request
from elmo_api.schemas import OPENAI_ERROR_RESPONSES, EmbeddingsRequest, EmbeddingsResponse
from elmo_api.served import ServedModel
from elmo_service.outputs import render

router = APIRouter(prefix="/v1", tags=["openai"])


def model_matches(name: str, served: ServedModel) -> bool:
    return name in (served.name, served.version, f"{served.name}@{served.version}")


@router.post(
    "/embeddings",
    response_model=EmbeddingsResponse,
    responses=OPENAI_ERROR_RESPONSES,
    summary="OpenAI-compatible embeddings (one pooled vector per input)",
    description=__doc__,
)
async def embeddings(
    req: EmbeddingsRequest,
    request: Request,
    ctx: ServingDep,
) -> Response:
    served, settings = ctx.served, ctx.settings
    if not model_matches(req.model, served):
        raise ApiError(
            404,
            "model_not_found",
            f"model {req.model!r} is not served; this server serves {served.name!r}",
            "model",
        )
    check_dimensions(req.dimensions, served, f" (omit dimensions, or pass {served.dim})")
    if isinstance(req.input, str):
        inputs: list = [req.input]
    elif req.input and isinstance(req.input[0], list):  # token ids (the schema checked them)
        inputs = token_ids.decode(req.input, req.model, settings.openai_token_encoding)
    else:
        inputs = list(req.input)
    check_openai_limits(inputs, settings)
    spec = await served.output_spec(output="mix", pooling="mean")  # the default mix, pooled
    part = settings.max_sentences
    tokens = None
    if len(inputs) > part:
        # errors name input[i] of the whole request, whichever part it falls in, before any
        # part runs; the parts take their tokens from here (one part tokenizes itself, its
        # errors named the same way, before the model runs)
        tokens = await asyncio.to_thread(served.tokenize, inputs, "input")
    lane = req.priority if len(inputs) <= part else "batch"
    fmt = "base64" if req.encoding_format == "base64" else "json"
    data, n_tokens = [], 0
    for lo in range(0, len(inputs), part):
        try:
            embedded = await embed_request(
                request,
                served,
                inputs[lo : lo + part],
                "input",
                spec,
                settings.max_response_floats,
                priority=lane,
                tokens=None if tokens is None else tokens[lo : lo + part],
            )
        except ClientGone:
            return Response(status_code=499)
        for j, layers in enumerate(embedded.layers):
            i = lo + j
            _, vec = render(layers, embedded.tokens[j], spec)
            if settings.openai_normalize:
                vec = unit(vec)
            enc = outputs.encode_checked(
                vec,
                fmt,
                "float32",
                what=f"input[{i}]",
                cause=None if spec.task is None else "task",
            )
            data.append({"object": "embedding", "index": i, "embedding": enc["data"]})
        n_tokens += sum(len(t) for t in embedded.tokens)
        del embedded  # one part's layers at a time
    return JSONBytesResponse(
        dumps(
            {
                "object": "list",
                "data": data,
                "model": served.name,
                "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
            }
        )
    )


def unit(v: np.ndarray) -> np.ndarray:
    """``v`` scaled to unit length (a zero vector, e.g. an empty input's, stays zero)."""
    n = float(np.linalg.norm(v.astype(np.float64)))
    return (v / n).astype(np.float32) if n > 0 else v


def check_openai_limits(inputs: list, settings) -> None:
    """OpenAI's own limits: inputs per request and characters, before any tokenization."""
    if not inputs:
        raise ApiError(422, "invalid_input", "input must hold at least one input", "input")
    if len(inputs) > settings.openai_max_inputs:
        raise ApiError(
            413,
            "limit_exceeded",
            f"{len(inputs)} inputs in one request; the limit is {settings.openai_max_inputs} "
            "(ELMO_OPENAI_MAX_INPUTS)",
            "input",
        )
    chars = sum(len(s) if isinstance(s, str) else sum(map(len, s)) for s in inputs)
    if chars > settings.openai_max_chars:
        raise ApiError(
            413,
            "limit_exceeded",
            f"{chars} characters in one request; the limit is {settings.openai_max_chars} "
            "(ELMO_OPENAI_MAX_CHARS)",
            "input",
        )
