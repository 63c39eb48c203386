"""What the client raises: the server's ``{code, message, field}``, an unreachable URL,
a job that ended without a result."""

from __future__ import annotations

from typing import Any

from elmo_service.errors import ElmoServiceError, InputError


class ServiceError(ElmoServiceError):
    """The service answered an error (any 4xx, a 5xx, or a 429/503 still refused at the
    retry deadline): its ``status``, ``code``, ``message`` and ``field``, and the ``url``."""

    def __init__(self, status: int, code: str, message: str, field: str | None, url: str) -> None:
        super().__init__(message, field=field)
        self.status, self.code, self.url = status, code, url

    def __str__(self) -> str:
        where = f" (field {self.field})" if self.field else ""
        return f"{self.url} answered {self.status} {self.code}: {self.message}{where}"


class ServiceInputError(ServiceError, InputError):
    """A 413 or 422: the request's content was refused. Also an ``InputError``, as the
    library raises for the same input, so ``except InputError`` works with either."""


def service_error(status: int, code: str, message: str, field: str | None, url: str):
    kind = ServiceInputError if status in (413, 422) else ServiceError
    return kind(status, code, message, field, url)


class ServiceUnreachable(ElmoServiceError, ConnectionError):
    """No answer: the connection failed or timed out. The message names the URL."""

    code = "unreachable"

    def __init__(self, url: str, reason: object) -> None:
        super().__init__(f"{url} is not reachable: {reason or type(reason).__name__}")
        self.url, self.reason = url, reason


class JobFailed(ElmoServiceError):
    """``jobs.wait``: the job ended failed or cancelled; ``record`` is its last record."""

    code = "job_failed"

    def __init__(self, record: dict[str, Any]) -> None:
        state, error = record.get("state"), record.get("error")
        super().__init__(f"job {record.get('id')} {state}: {error or 'no error recorded'}")
        self.record = record
