"""The client's protocol, without I/O: requests as values, answers as values.

Every operation of :class:`~elmo_service.client.Client` and ``AsyncClient`` is written
once, in ``ops.py``, as a generator that yields what it needs from the network: a
:class:`Call` (one request; the JSON answer comes back), :class:`Many` (requests sent
concurrently; answers or errors come back in order) or :class:`Sleep`. The two clients
differ only in how they carry these out (threads or asyncio), so the retry rule, the
splitting of large inputs and the decoding below are shared.
"""

from __future__ import annotations

import base64
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from elmo_service.client.errors import ServiceError, service_error
from elmo_service.errors import InputError

RETRY_STATUSES = (429, 503)
# a request body's bytes besides its sentences (options, braces): kept free under the limit
_BODY_OVERHEAD = 1024


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    json: Any = None
    params: dict[str, Any] | None = None
    # turns the JSON answer into what the operation wants; run by the driver where the
    # answer arrives (a worker thread), so decoding overlaps the other requests' wait
    parse: Callable[[Any], Any] | None = field(default=None, compare=False)

    def body(self) -> bytes | None:
        return None if self.json is None else orjson.dumps(self.json)


@dataclass(frozen=True)
class Many:
    """Requests sent concurrently (a bounded number in flight). Answers come back in order:
    each a JSON answer, a :class:`ServiceError`, or None if never sent (an earlier error
    stopped the rest; ``response_too_large`` does not stop them, the caller splits)."""

    calls: list[Call]


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class Http:
    """One attempt at ``call``: ``(status, Retry-After, body bytes)`` comes back."""

    call: Call


def attempts(call: Call, policy: RetryPolicy, base_url: str):
    """``call`` until it is answered, retried as ``policy`` says: its JSON answer, or the
    :class:`ServiceError` of the last refusal."""
    first, attempt = time.monotonic(), 0
    while True:
        status, retry_after, content = yield Http(call)
        if status < 400:
            body = loads(content)
            return call.parse(body) if call.parse is not None else body
        wait = policy.delay(attempt, status, retry_after, time.monotonic() - first)
        if wait is None:
            raise error_from(status, content, base_url + call.path)
        attempt += 1
        yield Sleep(wait)


def stops_the_rest(e: BaseException) -> bool:
    return not (isinstance(e, ServiceError) and e.code == "response_too_large")


@dataclass
class RetryPolicy:
    """429 and 503 are retried: after ``Retry-After`` when the server gives one, else an
    exponential backoff, plus a random share of the backoff so that clients refused
    together do not come back together; never past ``deadline`` seconds after the first
    attempt, nor more than ``retries`` times."""

    retries: int = 20
    deadline: float = 120.0
    base: float = 0.1
    cap: float = 10.0
    rng: random.Random = field(default_factory=random.Random)

    def delay(self, attempt: int, status: int, retry_after: str | None, elapsed: float):
        """Seconds to wait before attempt ``attempt + 1``, or None: give up."""
        if status not in RETRY_STATUSES or attempt >= self.retries:
            return None
        backoff = min(self.cap, self.base * 2**attempt)
        wait = _seconds(retry_after)
        wait = (backoff if wait is None else wait) + self.rng.uniform(0, backoff)
        return wait if elapsed + wait <= self.deadline else None


def _seconds(retry_after: str | None) -> float | None:
    try:
        return max(0.0, float(retry_after)) if retry_after is not None else None
    except ValueError:  # an HTTP date: not sent by this server; back off instead
        return None


def error_from(status: int, content: bytes, url: str) -> ServiceError:
    """The server's ``{code, message, field}``; a body that is not one still says something."""
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        body = None
    if not isinstance(body, dict) or "message" not in body:
        text = content.decode("utf-8", "replace").strip()[:500]
        return service_error(status, f"http_{status}", text or "(empty answer)", None, url)
    code = str(body.get("code", f"http_{status}"))
    return service_error(status, code, str(body["message"]), body.get("field"), url)


def loads(content: bytes) -> Any:
    return orjson.loads(content) if content else None


# ------------------------------------------------------------------ limits and splitting


@dataclass(frozen=True)
class Limits:
    """``GET /v1/limits``: what one request may hold."""

    max_sentences: int
    max_chars: int
    max_body_bytes: int
    max_response_floats: int
    max_tokens_per_sentence: int
    n_layers: int
    dim: int

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Limits:
        return cls(**{k: int(d[k]) for k in cls.__dataclass_fields__})


def check_sentences(sentences: Sequence[Any]) -> None:
    """What the library refuses before tokenizing, refused before any request."""
    for i, s in enumerate(sentences):
        if not isinstance(s, str) and not (
            isinstance(s, Sequence) and all(isinstance(w, str) for w in s)
        ):
            raise InputError(
                f"sentence {i} must be a string or a list of strings", field=f"sentences[{i}]"
            )


def _chars(s: str | Sequence[str]) -> int:
    # as the server counts them (api/routers/common.py check_request_limits)
    return len(s) if isinstance(s, str) else sum(map(len, s)) + max(len(s) - 1, 0)


def _positions(s: str | Sequence[str], pooled: bool, cap: int) -> int:
    """An estimate of the answer's positions for ``s`` (the server tokenizes; a chunk
    whose answer is still too large comes back 413 and is split in two)."""
    if pooled:
        return 1
    words = len(s.split()) if isinstance(s, str) else len(s)
    return min(cap, 2 * words + 1)


def plan_chunks(
    sentences: Sequence[str | Sequence[str]],
    limits: Limits,
    *,
    batch_size: int,
    floats_per_position: int,
    pooled: bool,
) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` runs of sentences, each a request under every limit
    (a sentence over a limit on its own goes alone, and the server names it)."""
    most = max(1, min(batch_size, limits.max_sentences))
    byte_budget = limits.max_body_bytes - _BODY_OVERHEAD
    out: list[tuple[int, int]] = []
    start = chars = size = floats = 0
    for i, s in enumerate(sentences):
        c = _chars(s)
        b = len(orjson.dumps(s)) + 1
        f = _positions(s, pooled, limits.max_tokens_per_sentence) * floats_per_position
        over = (
            i - start >= most
            or chars + c > limits.max_chars
            or size + b > byte_budget
            or floats + f > limits.max_response_floats
        )
        if over and i > start:
            out.append((start, i))
            start, chars, size, floats = i, 0, 0, 0
        chars, size, floats = chars + c, size + b, floats + f
    if start < len(sentences):
        out.append((start, len(sentences)))
    return out


def shift_error(e: ServiceError, offset: int) -> ServiceError:
    """A chunk's error, its sentence index counted in the caller's whole input."""
    m = re.fullmatch(r"sentences\[(\d+)\](.*)", e.field or "")
    if not m or offset == 0:
        return e
    k = int(m.group(1))
    message = e.message.replace(f"sentences[{k}]", f"sentences[{k + offset}]", 1)
    message = re.sub(rf"\bsentence {k}\b", f"sentence {k + offset}", message, count=1)
    field_ = f"sentences[{k + offset}]{m.group(2)}"
    return service_error(e.status, e.code, message, field_, e.url)


# ------------------------------------------------------------------ the embed request


def embed_body(
    chunk: Sequence[str | Sequence[str]],
    *,
    mix: Any,
    output: str | None,
    granularity: str,
    pooling: str,
) -> dict[str, Any]:
    """``POST /v1/embed``'s body: base64 float32 arrays (bit-exact, never float lists).

    ``mix``: None, a task name, or a MixSpec (anything with ``weights``, ``gamma``,
    ``per_direction``, ``layer_norm``). ``output`` None: ``both`` with a mix (the library
    returns the layers and the mix), else ``layers``."""
    body: dict[str, Any] = {
        "sentences": [s if isinstance(s, str) else list(s) for s in chunk],
        "output": output or ("layers" if mix is None else "both"),
        "granularity": granularity,
        "pooling": pooling,
        "encoding": "base64",
        "dtype": "float32",
    }
    if isinstance(mix, str):
        body["task"] = mix
    elif mix is not None:
        body["mix"] = [float(w) for w in mix.weights]
        body["gamma"] = float(mix.gamma)
        body["per_direction"] = bool(mix.per_direction)
        body["layer_norm"] = bool(mix.layer_norm)
    return body


def floats_per_position(mix: Any, output: str | None, limits: Limits) -> int:
    out = output or ("layers" if mix is None else "both")
    return limits.dim * ((limits.n_layers if out != "mix" else 0) + (out != "layers"))


def decode_array(obj: dict[str, Any] | None) -> np.ndarray | None:
    """A base64 ``{"shape", "dtype", "data"}`` as float32 (``api/encoding.py`` writes it)."""
    if obj is None:
        return None
    raw = np.frombuffer(
        base64.b64decode(obj["data"]), dtype=np.dtype(obj["dtype"]).newbyteorder("<")
    )
    return raw.astype(np.float32).reshape(obj["shape"])


def decode_sentence(d: dict[str, Any], granularity: str, token_cls: type, sentence_cls: type):
    """One ``data`` entry as the library's ``EmbeddedSentence`` (tokens, or words with
    their index as ``word``, as ``Embedder.embed(granularity="word")`` gives them)."""
    if granularity == "word":
        tokens = [
            token_cls(w["text"].replace("\u2581", ""), w["start"], w["end"], j)
            for j, w in enumerate(d["words"])
        ]
    else:
        tokens = [token_cls(t["text"], t["start"], t["end"], t["word"]) for t in d["tokens"]]
    return sentence_cls(tokens, decode_array(d.get("layers")), decode_array(d.get("mix")))
