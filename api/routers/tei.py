"""Hugging Face text-embeddings-inference's API (TEI), beside ours.

What ``huggingface_hub.InferenceClient(<server URL>).feature_extraction(...)`` and TEI's other
clients speak, with TEI's request and answer shapes (its error bodies: ``api/dialects.py``):

* ``POST /embed`` -- ``{"inputs": str | [str], "normalize": true, "truncate": false,
  "truncation_direction": "Right"}`` -> ``[[float]]``, one pooled vector per input: the
  mean over its tokens of the default mix, as ``/v1/embeddings`` (unit length when
  ``normalize``, TEI's default);
* ``POST /embed_all`` -> ``[[[float]]]``: a vector per token (the default mix, never
  normalised) -- what ELMo is for;
* ``POST /tokenize`` -> ``[[{"id", "text", "special", "start", "stop"}]]``: the model's
  tokens, each as the text of its character span (``id`` is null: ELMo reads characters and has no
  token ids; its sentence markers are not positions of an answer, so none is listed);
* ``GET /info``: the model, its limits; ``POST /``: ``/embed``'s answer (TEI's route for
  clients that post to the server's URL).

Each goes through the same served-model call as ``/v1/embed`` (admission, lanes, the cache,
the timeout); ``truncate`` keeps the first (``Right``) or last (``Left``) tokens up to the
per-sentence limit instead of refusing a longer input.
"""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, PlainValidator
from starlette.responses import Response

from elmo_api.deps import ServingDep
from elmo_api.encoding import JSONBytesResponse, dumps
from elmo_api.errors import ApiError
from elmo_api.routers.common import (
    ClientGone,
    check_dimensions,
    check_request_limits,
    embed_request,
)
from elmo_api.routers.openai import unit
from elmo_api.schemas import REQUEST_CONFIG, TEI_ERROR_RESPONSES, _valid_text
from elmo_service.outputs import render

router = APIRouter(tags=["tei"])


def _inputs(v: object) -> str | list[str]:
    if isinstance(v, str):
        return _valid_text(v)
    if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
        for x in v:
            _valid_text(x)
        return v
    raise ValueError("must be a string or a non-empty list of strings")


Inputs = Annotated[str | list[str], PlainValidator(_inputs, json_schema_input_type=str | list[str])]
# TEI's clients send null for what they leave unset: accepted as TEI's defaults
_CONFIG = ConfigDict(**{**REQUEST_CONFIG, "extra": "ignore"})


class TeiEmbed(BaseModel):
    model_config = _CONFIG
    inputs: Inputs
    normalize: bool | None = True
    truncate: bool | None = False
    truncation_direction: Literal["Right", "Left", "right", "left"] | None = "Right"
    prompt_name: str | None = None
    dimensions: int | None = None


class TeiTokenize(BaseModel):
    model_config = _CONFIG
    inputs: Inputs
    add_special_tokens: bool | None = True
    prompt_name: str | None = None


def _texts(req) -> list[str]:
    if req.prompt_name is not None:
        raise ApiError(
            422, "invalid_input", "prompt_name: this model has no prompts", "prompt_name"
        )
    return [req.inputs] if isinstance(req.inputs, str) else list(req.inputs)


def _truncated(texts: list[str], served, req: TeiEmbed) -> list[str]:
    """With ``truncate``: each text cut to the per-sentence limit (whole tokens)."""
    if not req.truncate:
        return texts
    limit = served.max_tokens_per_sentence
    left = (req.truncation_direction or "Right").lower() == "left"
    out = []
    for t in texts:
        toks = served.embedder.tokenizer(t)
        if len(toks) > limit:
            t = t[toks[-limit].start :] if left else t[: toks[limit - 1].end]
        out.append(t)
    return out


async def _pooled(req: TeiEmbed, request: Request, ctx, per_token: bool) -> Response:
    served, settings = ctx.served, ctx.settings
    check_dimensions(req.dimensions, served)
    texts = _truncated(_texts(req), served, req)
    check_request_limits(texts, settings, "inputs")
    spec = await served.output_spec(output="mix", pooling="none" if per_token else "mean")
    try:
        embedded = await embed_request(
            request, served, texts, "inputs", spec, settings.max_response_floats
        )
    except ClientGone:
        return Response(status_code=499)
    out = []
    for toks, layers in zip(embedded.tokens, embedded.layers, strict=True):
        _, vec = render(layers, toks, spec)
        if not per_token and req.normalize is not False:
            vec = unit(vec)
        out.append(vec.tolist())
    return JSONBytesResponse(dumps(out))


@router.post(
    "/embed",
    responses=TEI_ERROR_RESPONSES,
    summary="TEI: one pooled vector per input",
    response_model=list[list[float]],
)
async def embed(req: TeiEmbed, request: Request, ctx: ServingDep) -> Response:
    return await _pooled(req, request, ctx, per_token=False)


@router.post("/", responses=TEI_ERROR_RESPONSES, summary="TEI: /embed at the server's URL")
async def root(req: TeiEmbed, request: Request, ctx: ServingDep) -> Response:
    return await _pooled(req, request, ctx, per_token=False)


@router.post(
    "/embed_all",
    responses=TEI_ERROR_RESPONSES,
    summary="TEI: a vector per token (the default mix)",
    response_model=list[list[list[float]]],
)
async def embed_all(req: TeiEmbed, request: Request, ctx: ServingDep) -> Response:
    return await _pooled(req, request, ctx, per_token=True)


@router.post("/tokenize", responses=TEI_ERROR_RESPONSES, summary="TEI: the model's tokens")
async def tokenize(req: TeiTokenize, ctx: ServingDep) -> Response:
    texts = _texts(req)
    check_request_limits(texts, ctx.settings, "inputs")
    out = [
        [
            {
                "id": None,
                "text": text[t.start : t.end],
                "special": False,
                "start": t.start,
                "stop": t.end,
            }
            for t in ctx.served.embedder.tokenizer(text)
        ]
        for text in texts
    ]
    return JSONBytesResponse(dumps(out))


class TeiInfo(BaseModel):
    model_id: str
    model_sha: str | None
    model_dtype: str
    model_type: dict = Field(..., examples=[{"embedding": {"pooling": "mean"}}])
    max_concurrent_requests: int
    max_input_length: int
    max_batch_tokens: int
    max_batch_requests: int | None
    max_client_batch_size: int
    auto_truncate: bool
    tokenization_workers: int
    version: str
    sha: str | None = None
    docker_label: str | None = None


@router.get(
    "/info",
    response_model=TeiInfo,
    responses=TEI_ERROR_RESPONSES,
    summary="TEI: the model and its limits",
)
async def info(ctx: ServingDep) -> Response:
    served, settings = ctx.served, ctx.settings
    body = {
        "model_id": served.name,
        "model_sha": served.version,
        "model_dtype": "float32",
        "model_type": {"embedding": {"pooling": "mean"}},
        "max_concurrent_requests": settings.max_queue,
        "max_input_length": served.max_tokens_per_sentence,
        "max_batch_tokens": served.embedder.batch_tokens,
        "max_batch_requests": None,
        "max_client_batch_size": settings.max_sentences,
        "auto_truncate": False,
        "tokenization_workers": 1,
        "version": "elmo-service 0.1.0",
        "sha": None,
        "docker_label": None,
    }
    return JSONBytesResponse(dumps(body))
