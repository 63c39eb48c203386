"""Arrays on the wire: orjson for JSON, raw little-endian bytes for base64.

JSON of big float arrays is the hot path, so responses are built with
``orjson`` straight from numpy (``OPT_SERIALIZE_NUMPY``), never via
``float`` lists or pydantic.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from starlette.responses import JSONResponse

from elmo_service.values import as_dtype, decode_array, encode_array

Encoding = Literal["json", "base64"]
DType = Literal["float32", "float16"]

_ORJSON_OPTS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


def dumps(content: Any) -> bytes:
    return orjson.dumps(content, option=_ORJSON_OPTS)


class JSONBytesResponse(JSONResponse):
    """A JSON response rendered by orjson (numpy arrays serialised natively).

    A JSONResponse subclass so that FastAPI documents routes' response models
    in the OpenAPI document (it writes ``"type": "string"`` for other classes)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        if isinstance(content, bytes):
            return content
        return dumps(content)


# the array codec is the one the Python client decodes with (elmo_service/values.py)
__all__ = [
    "DType",
    "Encoding",
    "JSONBytesResponse",
    "as_dtype",
    "decode_array",
    "dumps",
    "encode_array",
]
