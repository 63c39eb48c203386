"""Error bodies in the dialect of the API a route imitates.

Every error is decided once, by ``api/errors.py``'s table, as ``{code, message, field}``
with its status. Clients of OpenAI's API and of Hugging Face's text-embeddings-inference
(TEI) read their own shapes, so on those routes this middleware rewrites the body (and
nothing else but, for OpenAI, a 422 into the 400 OpenAI answers for a bad request):

* OpenAI (``/v1/embeddings``): ``{"error": {"message", "type", "param", "code"}}``, the
  shape the ``openai`` SDK reads to raise ``BadRequestError``, ``RateLimitError``...;
* TEI (``/embed``, ``/embed_all``, ``/tokenize``, ``/info``, ``/``): ``{"error",
  "error_type"}`` with TEI's types (``Validation``, ``Overloaded``, ``Unhealthy``...).

Only error answers are touched (a status of 400 or more with our JSON body); successes
stream through untouched.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

OPENAI_PATHS = frozenset({"/v1/embeddings"})
TEI_PATHS = frozenset({"/", "/embed", "/embed_all", "/tokenize", "/info"})

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def openai_body(status: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    status = 400 if status == 422 else status
    kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return status, {
        "error": {
            "message": body.get("message", ""),
            "type": kind,
            "param": body.get("field"),
            "code": body.get("code"),
        }
    }


def tei_body(status: int, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    if status == 429:
        kind = "Overloaded"
    elif status == 503:
        kind = "Unhealthy"
    elif status >= 500:
        kind = "Backend"
    elif body.get("code") == "empty_input":
        kind = "Empty"
    else:
        kind = "Validation"
    return status, {"error": body.get("message", ""), "error_type": kind}


def dialect_of(path: str):
    if path in OPENAI_PATHS:
        return openai_body
    if path in TEI_PATHS:
        return tei_body
    return None


class ErrorDialectMiddleware:
    """Rewrites error bodies on the routes of another API's dialect (see the module)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        dialect = dialect_of(scope.get("path", "")) if scope["type"] == "http" else None
        if dialect is None:
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def send_in_dialect(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                if message["status"] < 400:
                    await send(message)
                    return
                start = message
                return
            if start is None:  # a success: as it is
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            status, raw = start["status"], b"".join(chunks)
            try:
                body = json.loads(raw)
                if not isinstance(body, dict) or "message" not in body:
                    raise ValueError
                status, out = dialect(status, body)
                raw = json.dumps(out).encode()
            except ValueError:
                pass  # not our error body: as it is
            headers = [
                (k, v) for k, v in start.get("headers", ()) if k.lower() != b"content-length"
            ]
            headers.append((b"content-length", str(len(raw)).encode()))
            await send({**start, "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": raw})

        await self.app(scope, receive, send_in_dialect)
