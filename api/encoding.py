"""Arrays on the wire: orjson for JSON, raw little-endian bytes for base64.

JSON of big float arrays is the hot path, so responses are built with
``orjson`` straight from numpy (``OPT_SERIALIZE_NUMPY``), never via
``float`` lists or pydantic.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
import orjson
from starlette.responses import JSONResponse

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


def as_dtype(x: np.ndarray, dtype: DType) -> np.ndarray:
    """C-contiguous little-endian array of ``dtype`` (orjson and base64 both need that)."""
    return np.ascontiguousarray(x, dtype=np.dtype(dtype).newbyteorder("<"))


def encode_array(x: np.ndarray, encoding: Encoding, dtype: DType) -> dict[str, Any]:
    """``{"shape", "dtype", "data"}``; data is nested lists (json) or base64 of C-order bytes."""
    arr = as_dtype(x, dtype)
    if encoding == "base64":
        data: Any = base64.b64encode(arr.tobytes()).decode("ascii")
    else:
        data = arr if arr.dtype.isnative else arr.astype(arr.dtype.newbyteorder("="))
    return {"shape": list(arr.shape), "dtype": dtype, "data": data}


def decode_array(obj: dict[str, Any]) -> np.ndarray:
    """Inverse of :func:`encode_array` (used by tests, the bench and Python clients)."""
    dtype = np.dtype(obj["dtype"]).newbyteorder("<")
    data = obj["data"]
    if isinstance(data, str):
        return (
            np.frombuffer(base64.b64decode(data), dtype=dtype)
            .reshape(obj["shape"])
            .astype(np.float32)
        )
    return np.asarray(data, dtype=np.float32).reshape(obj["shape"])
