"""``POST /v1/embeddings``: OpenAI-compatible, one pooled vector per input.

The vector is the **mean over the input's tokens of the default mix**: the
task named ``default`` (stored, or shipped in the artifact) when there is
one, else the plain average of all biLM layers (equal weights, gamma 1).
Its width is the model's ``dim`` (2 x projection); ``dimensions`` may only
repeat it. ``base64`` is little-endian float32, as OpenAI's clients expect.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from elmo_api import outputs
from elmo_api.deps import ServingDep
from elmo_api.encoding import JSONBytesResponse, dumps
from elmo_api.errors import ApiError
from elmo_api.routers.common import ClientGone, check_request_limits, embed_request
from elmo_api.schemas import ERROR_RESPONSES, EmbeddingsRequest, EmbeddingsResponse
from elmo_api.served import ServedModel
from elmo_service.outputs import render

router = APIRouter(prefix="/v1", tags=["openai"])


def model_matches(name: str, served: ServedModel) -> bool:
    return name in (served.name, served.version, f"{served.name}@{served.version}")


@router.post(
    "/embeddings",
    response_model=EmbeddingsResponse,
    responses=ERROR_RESPONSES,
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
    if req.dimensions is not None and req.dimensions != served.dim:
        raise ApiError(
            422,
            "invalid_input",
            f"dimensions={req.dimensions} is not supported: this model's vectors have {served.dim}",
            "dimensions",
        )
    inputs = [req.input] if isinstance(req.input, str) else list(req.input)
    check_request_limits(inputs, settings, "input")
    spec = await served.output_spec(output="mix", pooling="mean")  # the default mix, pooled
    try:
        embedded = await embed_request(
            request,
            served,
            inputs,
            "input",
            spec,
            settings.max_response_floats,
            priority=req.priority,
        )
    except ClientGone:
        return Response(status_code=499)
    token_lists, arrays = embedded.tokens, embedded.layers
    data = []
    for i, layers in enumerate(arrays):
        _, vec = render(layers, token_lists[i], spec)
        enc = outputs.encode_checked(
            vec,
            "base64" if req.encoding_format == "base64" else "json",
            "float32",
            what=f"input[{i}]",
            cause=None if spec.task is None else "task",
        )
        emb: object = enc["data"]
        data.append({"object": "embedding", "index": i, "embedding": emb})
    n_tokens = sum(len(t) for t in token_lists)
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
