"""Names that users give and the filesystem sees: one validator per kind (no heavy imports)."""

from __future__ import annotations

import re

from elmo_service.errors import InputError

# A model name is a folder name inside the models folder, a URL segment and a cache/task
# namespace: a whitelist, so NUL, separators, '..', hidden names and control characters
# never reach the filesystem (where NUL raises ValueError deep inside os.path).
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_model_name(name: object, field: str = "name") -> str:
    """``name`` if it is a valid model (artifact folder) name; InputError naming ``field``.

    Every model name that comes from a user goes through here: ``ELMO_MODEL``,
    ``POST /v1/models/{name}/activate`` and a job's artifact ``name``.
    """
    if not isinstance(name, str) or not MODEL_NAME.fullmatch(name):
        raise InputError(
            f"{field}: {name!r} is not a model name: 1-64 characters, letters, digits, "
            "'.', '_', '-', starting with a letter or digit",
            field=field,
        )
    return name
