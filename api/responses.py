"""Big answers: bounded before any work, streamed a sentence at a time.

A request of a few hundred KB can ask for a GB of JSON (256 long sentences x all
layers). :func:`check_response_floats` refuses it with 413 before the model runs,
from the request's own size; ``ELMO_MAX_RESPONSE_FLOATS`` sets the bound.
:func:`streamed_json` writes an answer whose entries are already built (and checked:
finite, in range) as ``prefix, entry, entry, ..., suffix``, each entry encoded on a
worker thread only when the client is ready for it and dropped once sent, so the
server never holds the whole JSON text, let alone twice; a client that stops
reading is cut off by the connection's send deadline (:mod:`elmo_api.http_protocol`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from starlette.responses import StreamingResponse

from elmo_api.encoding import dumps
from elmo_service.errors import LimitError

SETTING = "ELMO_MAX_RESPONSE_FLOATS"


class ResponseTooLarge(LimitError):
    """The answer asked for would carry more floats than ``ELMO_MAX_RESPONSE_FLOATS`` (413)."""

    code = "response_too_large"


def check_response_floats(n_floats: int, limit: int, field: str, detail: str) -> None:
    """ResponseTooLarge naming the request's size (``detail``) and the setting that raises
    the bound."""
    if n_floats > limit:
        raise ResponseTooLarge(
            f"the answer would carry {n_floats:,} floats ({detail}); the limit is {limit:,} "
            f"({SETTING}): ask for fewer {field}, fewer layers, a mix or pooling, or raise "
            f"{SETTING}",
            field=field,
        )


def streamed_json(head: dict[str, Any], key: str, entries: list[Any]) -> StreamingResponse:
    """``{**head, key: entries}`` as JSON, streamed one entry at a time (``key`` comes last)."""
    prefix = dumps({**head, key: []})[:-2]  # '...,"<key>":[' (its value is the empty list)

    def chunks() -> Iterator[bytes]:
        yield prefix
        for i in range(len(entries)):
            entry, entries[i] = entries[i], None  # sent: its arrays can go
            yield (b"," if i else b"") + dumps(entry)
        yield b"]}"

    return StreamingResponse(chunks(), media_type="application/json")
