"""Exceptions shared by the library, the API and the trainer.

Every error a caller can cause carries the name of the offending ``field`` so
that the HTTP layer can answer ``{code, message, field}`` without guessing.
"""

from __future__ import annotations


class ElmoServiceError(Exception):
    code = "error"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class InputError(ElmoServiceError, ValueError):
    """The caller's input is unusable (empty, too long, wrong type)."""

    code = "invalid_input"


class LimitError(InputError):
    """The input exceeds a configured limit."""

    code = "limit_exceeded"


class ConfigError(ElmoServiceError, ValueError):
    """A configuration (model, training, mix, settings) is invalid."""

    code = "invalid_config"


class ArtifactError(ElmoServiceError):
    """A model artifact is missing, corrupt or inconsistent."""

    code = "bad_artifact"


# a path the user gave that is missing or unreadable: the CLIs report these in one line
PATH_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)
