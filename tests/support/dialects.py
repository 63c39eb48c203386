"""Reading an OpenAI-shaped error body (``api/dialects.py``) as our own ``{code, message,
field}``, so one assertion helper serves every route."""

from __future__ import annotations

from typing import Any


def openai_as_ours(body: Any) -> Any:
    """OpenAI's ``{"error": {message, type, param, code}}`` as ``{code, message, field}``
    (checked to be exactly OpenAI's shape); any other body as it is."""
    if isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], dict):
        e = body["error"]
        assert set(e) == {"message", "type", "param", "code"}, e
        assert e["type"].endswith("_error"), e
        return {"code": e["code"], "message": e["message"], "field": e["param"]}
    return body
