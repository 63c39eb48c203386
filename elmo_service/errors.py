"""Exceptions shared by the library, the API and the trainer.

Every error a caller can cause carries the name of the offending ``field`` so
that the HTTP layer can answer ``{code, message, field}`` without guessing.
"""

from __future__ import annotations

# defined with the values the client shares (numpy-only, one file for both sides of the wire)
from elmo_service.values import ElmoServiceError, InputError

__all__ = ["ArtifactError", "ConfigError", "ElmoServiceError", "InputError", "LimitError"]


class UnknownTask(InputError):
    """A task name the model does not hold (its artifact, or a server's store): the one
    error for it on every surface (library, CLIs, jobs, API: 422 ``unknown_task``)."""

    code = "unknown_task"

    def __init__(self, name: str, known: object = (), *, field: str = "task") -> None:
        self.name, self.known = name, sorted(known)  # type: ignore[call-overload]
        listed = ", ".join(self.known) or "none"
        super().__init__(f"model has no task {name!r} (known: {listed})", field=field)


class LimitError(InputError):
    """The input exceeds a configured limit."""

    code = "limit_exceeded"


class ConfigError(ElmoServiceError, ValueError):
    """A configuration (model, training, mix, settings) is invalid."""

    code = "invalid_config"


class ArtifactError(ElmoServiceError):
    """A model artifact is missing, corrupt or inconsistent."""

    code = "bad_artifact"


def at_line(file: object, first_line: int):
    """How a file reader names sentence ``i`` (word ``j``) in errors: sentence 0 is line
    ``first_line`` (1-based): "line 7 of a.txt, word 2" (``Embedder.tokenize``'s ``where``)."""

    def where(i: int, j: int | None) -> str:
        at = f"line {first_line + i} of {file}"
        return at if j is None else f"{at}, word {j + 1}"

    return where


# a path the user gave that is missing or unreadable: the CLIs report these in one line
PATH_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)
