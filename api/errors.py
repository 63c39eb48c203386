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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from elmo_api.admission import BatcherClosed, QueueFull
from elmo_api.encoding import JSONBytesResponse
from elmo_api.fleet import OutcomeUnknown
from elmo_api.served import ModelTimeout
from elmo_api.tasks_store import TaskUnreadable
from elmo_jobs import JobConflict, JobNotFound, Unreadable
from elmo_service.errors import ArtifactError, ConfigError, ElmoServiceError, InputError, LimitError
from elmo_storage import StoreUnavailable

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


def _retry(seconds: int) -> Callable[[Exception], dict[str, str]]:
    return lambda e: {"Retry-After": str(seconds)}


@dataclass(frozen=True)
class Answer:
    """How the API answers one exception class. ``code``/``field`` None: the exception's own
    (library errors carry both); ``message``: from the exception (default ``str(e)``)."""

    status: int
    code: str | None = None
    field: str | None = None
    message: Callable[[Any], str] = str
    headers: Callable[[Any], dict[str, str] | None] = lambda e: None


# Every exception the API turns into an answer, and how: the ONE table (most specific
# first). Routes raise what the core raises; nothing else maps a status.
STATUS: list[tuple[type[Exception], Answer]] = [
    # the library's errors carry their code and field (UnknownTask: 422 unknown_task, task)
    (LimitError, Answer(413)),  # ResponseTooLarge included (code response_too_large)
    (InputError, Answer(422)),
    (ConfigError, Answer(422)),
    (ArtifactError, Answer(500)),
    (TaskUnreadable, Answer(409)),  # a stored task the API cannot answer: named, not a 500
    (ElmoServiceError, Answer(500)),
    # the model's queue and worker
    (
        QueueFull,
        Answer(
            429,
            "overloaded",
            message=lambda e: f"the model is overloaded ({e}); retry later",
            headers=lambda e: {"Retry-After": str(e.retry_after)},
        ),
    ),
    (ModelTimeout, Answer(503, "timeout", headers=_retry(1))),
    (BatcherClosed, Answer(503, "unavailable", headers=_retry(1))),
    # Redis (tasks, fleet, jobs) not answering
    (StoreUnavailable, Answer(503, "store_unavailable", headers=_retry(5))),
    # jobs
    (Unreadable, Answer(409, "unreadable_record", "job_id")),
    (JobNotFound, Answer(404, "not_found", "job_id", message=lambda e: f"no job {e.args[0]!r}")),
    (JobConflict, Answer(409, "conflict", message=lambda e: e.message)),
]


def answer_of(e: Exception) -> tuple[int, str, str, str | None, dict[str, str] | None]:
    """(status, code, message, field, headers) of an exception the table names; else 500."""
    for cls, a in STATUS:
        if isinstance(e, cls):
            code = a.code or getattr(e, "code", "error")
            field = a.field if a.field is not None else getattr(e, "field", None)
            message = getattr(e, "message", None) if a.message is str else None
            return a.status, code, message or a.message(e), field, a.headers(e)
    return 500, "internal_error", "internal server error", None, None


def status_of(e: Exception) -> int:
    return answer_of(e)[0]


def activation_error(e: Exception, name: str) -> ApiError | None:
    """What ``POST /v1/models/{name}/activate`` answers for a refusal (None: not one)."""
    if isinstance(e, LookupError):
        return ApiError(404, "not_found", f"no model {name!r} in the models folder", "name")
    if isinstance(e, ArtifactError):  # still being written, or broken: the served model stays
        return ApiError(
            422, "bad_artifact", f"model {name!r} cannot be loaded: {e.message}", "name"
        )
    if isinstance(e, OutcomeUnknown):  # sent, unanswered, not read back: it may land yet
        return ApiError(
            503,
            "fleet_outcome_unknown",
            f"cannot tell whether {name!r} became the fleet's model: {e}. GET /v1/models "
            f"shows the fleet's desired model; activating {name!r} again is safe (a no-op "
            "once recorded)",
            None,
            {"Retry-After": "5"},
        )
    if isinstance(e, StoreUnavailable):  # not recorded (never sent, or read back)
        return ApiError(
            503, "fleet_unavailable", f"{name!r} is not the fleet's model: {e}", None,
            {"Retry-After": "5"},
        )  # fmt: skip
    return None


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

    async def _mapped(request: Request, exc: Exception) -> Response:
        status, code, message, field, headers = answer_of(exc)
        if status >= 500 and status != 503:
            log.error("server error: %s", message)
        return error_response(status, code, message, field, headers)

    for cls, _ in STATUS:
        app.add_exception_handler(cls, _mapped)

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
