"""What the client raises: the server's ``{code, message, field}``, an answer that does not
hold together, an unreachable URL, a job that ended without a result.

No message ever shows a URL's ``user:password@`` (:func:`redact`)."""

from __future__ import annotations

import re
from typing import Any

from elmo_client.shared import ElmoServiceError, InputError

# "scheme://user:password@host" -> "scheme://***@host", wherever it appears in a message
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s]+@")


def redact(text: object) -> str:
    """``text`` without the credentials of any URL in it."""
    return _USERINFO.sub(r"\1***@", str(text))


class ServiceError(ElmoServiceError):
    """The service answered an error (any 4xx, a 5xx, or a refusal still standing at the
    retry deadline), or an answer the client cannot trust (code ``bad_answer``: malformed,
    or not the shape, count, order or model the request asked for; ``model_changed``: no
    single model version answered every chunk before the deadline): its ``status``,
    ``code``, ``message`` and ``field``, and the ``url``."""

    def __init__(self, status: int, code: str, message: str, field: str | None, url: str) -> None:
        super().__init__(redact(message), field=field)
        self.status, self.code, self.url = status, code, redact(url)

    def __str__(self) -> str:
        where = f" (field {self.field})" if self.field else ""
        return f"{self.url} answered {self.status} {self.code}: {self.message}{where}"


class ServiceInputError(ServiceError, InputError):
    """A 413 or 422: the request's content was refused. Also an ``InputError``, as the
    library raises for the same input, so ``except InputError`` works with either."""


def service_error(status: int, code: str, message: str, field: str | None, url: str):
    kind = ServiceInputError if status in (413, 422) else ServiceError
    return kind(status, code, message, field, url)


def bad_answer(status: int, url: str, what: object) -> ServiceError:
    """An answer the client refuses to pass on (it would misalign with the input)."""
    return ServiceError(status, "bad_answer", f"the answer cannot be trusted: {what}", None, url)


class ServiceUnreachable(ElmoServiceError, ConnectionError):
    """No answer: the connection failed, dropped, or the request's deadline passed. The
    message names the URL (never its credentials). ``retryable``: the failure was a
    connection error (refused, reset, dropped, a protocol error), which an idempotent call
    retries; a request past its ``timeout`` is not retried."""

    code = "unreachable"

    def __init__(self, url: str, reason: object, retryable: bool = False) -> None:
        why = redact(reason) if str(reason) else type(reason).__name__
        super().__init__(f"{redact(url)} is not reachable: {why}")
        self.url, self.reason, self.retryable = redact(url), why, retryable


class JobFailed(ElmoServiceError):
    """``jobs.wait``: the job ended failed or cancelled; ``record`` is its last record."""

    code = "job_failed"

    def __init__(self, record: dict[str, Any]) -> None:
        state, error = record.get("state"), record.get("error")
        super().__init__(f"job {record.get('id')} {state}: {error or 'no error recorded'}")
        self.record = record
