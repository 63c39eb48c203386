"""Every rejection is JSON ``{"code", "message", "field"}`` with a 4xx status.

Library errors (:mod:`elmo_service.errors`) already carry ``code`` and
``field``; :class:`ApiError` adds the HTTP status for errors raised here.
FastAPI's own validation errors are re-shaped so that ``field`` is a path such
as ``sentences[2]`` or ``mix[1]``.
"""

from __future__ import annotations

import difflib
import logging
import typing
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from api.encoding import JSONBytesResponse
from elmo_service.errors import ArtifactError, ConfigError, ElmoServiceError, InputError, LimitError

log = logging.getLogger("api")


class ApiError(Exception):
    """An error with an HTTP status, raised by routes and dependencies."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.field = status, code, message, field
        self.headers = headers


def error_body(code: str, message: str, field: str | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "field": field}


def error_response(
    status: int,
    code: str,
    message: str,
    field: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    return JSONBytesResponse(error_body(code, message, field), status_code=status, headers=headers)


# Status of each library error class (most specific first).
_LIBRARY_STATUS: list[tuple[type[ElmoServiceError], int]] = [
    (LimitError, 413),
    (InputError, 422),
    (ConfigError, 422),
    (ArtifactError, 500),
]


def status_of(e: ElmoServiceError) -> int:
    for cls, status in _LIBRARY_STATUS:
        if isinstance(e, cls):
            return status
    return 500


def loc_to_field(loc: Sequence[Any]) -> str | None:
    """``("body", "sentences", 2)`` -> ``"sentences[2]"``; type tags of unions are skipped."""
    parts: list[str] = []
    items = list(loc)
    if items and items[0] in ("body", "query", "path", "header", "cookie"):
        items = items[1:]
    for item in items:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            s = str(item)
            # pydantic tags union branches with their type: "str", "list[str]", "function-after[...]"
            if "[" in s or s in {"str", "int", "float", "bool", "list", "dict", "none"}:
                continue
            parts.append(("." if parts else "") + s)
    return "".join(parts) or None


def _more(n: int) -> str:
    return f" (and {n} more error{'s' if n > 1 else ''})" if n else ""


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside ``X``, ``X | None``, ``list[X]``..."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _known_fields(request: Request | None, loc: Sequence[Any]) -> list[str]:
    """Field names of the model that holds ``loc`` (the route's body model, walked)."""
    endpoint = request.scope.get("endpoint") if request is not None else None
    try:
        hints = typing.get_type_hints(endpoint) if endpoint is not None else {}
    except Exception:  # noqa: BLE001 - only a hint
        return []
    model = next((m for k, t in hints.items() if k != "return" and (m := _model_in(t))), None)
    for part in list(loc)[1:-1]:
        if model is None:
            return []
        if isinstance(part, str):
            info = model.model_fields.get(part)
            model = _model_in(info.annotation) if info is not None else None
    return list(model.model_fields) if model is not None else []


def _unknown_field_message(
    field: str, errors: Sequence[dict[str, Any]], request: Request | None
) -> tuple[str, str | None]:
    """``sentence: unknown field, not permitted (did you mean 'sentences'?)``, and the field meant."""
    loc = errors[0].get("loc", ())
    name = str(loc[-1]) if loc else field
    known = _known_fields(request, loc) or [
        str(e["loc"][-1]) for e in errors if e.get("type") == "missing" and e.get("loc")
    ]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{field}: unknown field, not permitted{hint}", close[0] if close else None


def _validation_response(exc: RequestValidationError, request: Request | None = None) -> Response:
    errors = exc.errors()
    if not errors:
        return error_response(422, "invalid_request", "invalid request")
    # an unknown field is reported first: "sentence" explains the missing "sentences"
    errors = sorted(errors, key=lambda e: e.get("type") != "extra_forbidden")
    first = errors[0]
    typ = first.get("type", "")
    if typ == "json_invalid":
        ctx = first.get("ctx") or {}
        detail = ctx.get("error", first.get("msg", ""))
        return error_response(
            400, "invalid_json", f"request body is not valid JSON: {detail}", "body"
        )
    field = loc_to_field(first.get("loc", ()))
    if (
        typ == "missing"
        and first.get("loc", ())[:1] == ("body",)
        and len(first.get("loc", ())) == 1
    ):
        return error_response(
            422, "invalid_request", "request body is required (JSON object)", "body"
        )
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    more = len(errors) - 1
    if typ == "extra_forbidden" and field:
        msg, meant = _unknown_field_message(field, errors, request)
        # the missing field it was meant to be is the same mistake, not one more
        loc = tuple(first.get("loc", ()))
        more -= any(
            e.get("type") == "missing" and tuple(e.get("loc", ())) == (*loc[:-1], meant)
            for e in errors
        )
    elif field:
        msg = f"{field}: {msg}"
    msg += _more(more)
    return error_response(422, "invalid_request", msg, field)


def allowed_methods(request: Request) -> list[str]:
    """The methods some route of the app answers on this request's path (a path served by
    several routes, e.g. GET and PUT ``/v1/tasks/{name}``, lists them all)."""
    path = request.scope.get("path", "")
    methods: set[str] = set()

    def walk(routes: Sequence[Any]) -> None:
        for route in routes:
            inner = getattr(route, "original_router", None)  # FastAPI >= 0.165's included router
            if inner is not None:
                walk(inner.routes)  # our routers carry their prefix in their routes' paths
            elif getattr(route, "methods", None) and route.path_regex.match(path):
                methods.update(route.methods)

    walk(request.app.router.routes)
    return sorted(methods)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return error_response(exc.status, exc.code, exc.message, exc.field, exc.headers)

    @app.exception_handler(ElmoServiceError)
    async def _library_error(request: Request, exc: ElmoServiceError) -> Response:
        status = status_of(exc)
        if status >= 500:
            log.error("server error: %s", exc.message)
        return error_response(status, exc.code, exc.message, exc.field)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _validation_response(exc, request)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        codes = {404: "not_found", 405: "method_not_allowed", 401: "unauthorized", 403: "forbidden"}
        code = codes.get(exc.status_code, "http_error")
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:  # every method of the path, not only the first route's
            allowed = allowed_methods(request)
            headers = {**(headers or {}), "Allow": ", ".join(allowed)}
            message = f"{request.method} is not allowed on {request.url.path} (allowed: {', '.join(allowed)})"
        return error_response(exc.status_code, code, message, None, headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal_error", "internal server error")
