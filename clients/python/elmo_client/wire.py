"""The client's protocol, without I/O: requests as values, answers as values.

Every operation of :class:`~elmo_client.Client` and ``AsyncClient`` is written once, in
``ops.py``, as a generator that yields what it needs from the network: a :class:`Call`
(one request, retried as :class:`RetryPolicy` says; the parsed answer comes back),
:class:`Many` (requests sent concurrently; answers or errors come back in order) or
:class:`Sleep`. The two clients differ only in how they carry these out (threads or
asyncio), so the retry rule, the splitting of large inputs and the checks of every answer
(``answers.py``) are shared.
"""

from __future__ import annotations

import math
import random
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from elmo_client.errors import ServiceError, ServiceUnreachable, bad_answer, service_error
from elmo_client.shared import InputError, check_document

# refusals that did nothing: retried for every call, job submission included
REFUSALS = (429, 503)
# a timeout or a gateway's failure: the request may have run; retried for idempotent calls
GATEWAY = (408, 502, 504)
# a request body's bytes besides its sentences (options, braces): kept free under the limit
_BODY_OVERHEAD = 1024


@dataclass(frozen=True)
class Reply:
    """One HTTP answer: status, headers (lower-case names), body bytes, and the URL asked."""

    status: int
    headers: Mapping[str, str]
    content: bytes
    url: str


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    json: Any = None
    params: dict[str, Any] | None = None
    # turns the JSON answer (and its Reply: headers) into what the operation wants; run by
    # the driver where the answer arrives (a worker thread), so decoding overlaps the other
    # requests' wait. What it raises on a malformed answer becomes one ServiceError.
    parse: Callable[[Any, Reply], Any] | None = field(default=None, compare=False)
    # False for a call that must never be sent twice (job submission): only refusals that
    # did nothing (429, 503) are retried
    idempotent: bool = True

    def body(self) -> bytes | None:
        return None if self.json is None else orjson.dumps(self.json)


@dataclass(frozen=True)
class Many:
    """Requests sent concurrently (a bounded number in flight). Answers come back in order:
    each a parsed answer, a :class:`ServiceError`, or None if never sent (an earlier error
    stopped the rest; ``response_too_large`` does not stop them, the caller splits)."""

    calls: list[Call]


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class Http:
    """One attempt at ``call``: a :class:`Reply` comes back, or ServiceUnreachable is thrown."""

    call: Call


# what a parse function raises on an answer that is not what it should be
MALFORMED = (ValueError, KeyError, TypeError, IndexError, AttributeError)


def _wait_after(
    policy: RetryPolicy, attempt: int, e: ServiceUnreachable, call: Call, first: float
) -> float:
    """Seconds to wait before retrying ``call`` after the failure ``e`` (raised when the
    policy says not to retry: not retryable, not idempotent, or out of time)."""
    wait = policy.after_failure(attempt, e.retryable and call.idempotent, time.monotonic() - first)
    if wait is None:
        raise e
    return wait


def attempts(call: Call, policy: RetryPolicy, base_url: str):
    """``call`` until it is answered, retried as ``policy`` says: its parsed answer, or the
    :class:`ServiceError` of the last refusal (the ServiceUnreachable of the last failure)."""
    first, attempt = time.monotonic(), 0
    url = base_url + call.path
    while True:
        try:
            reply = yield Http(call)
        except ServiceUnreachable as e:
            yield Sleep(_wait_after(policy, attempt, e, call, first))
            attempt += 1
            continue
        if reply.status < 400:
            try:
                body = loads(reply.content)
                return call.parse(body, reply) if call.parse is not None else body
            except ServiceError:
                raise
            except MALFORMED as e:  # orjson.JSONDecodeError is a ValueError
                raise bad_answer(reply.status, url, f"{type(e).__name__}: {e}") from None
        elapsed = time.monotonic() - first
        retry_after = reply.headers.get("retry-after")
        wait = policy.delay(attempt, reply.status, retry_after, elapsed, call.idempotent)
        if wait is None:
            raise error_from(reply.status, reply.content, url)
        attempt += 1
        yield Sleep(wait)


def stops_the_rest(e: BaseException) -> bool:
    return not (isinstance(e, ServiceError) and e.code == "response_too_large")


@dataclass
class RetryPolicy:
    """Refusals (429, 503) are retried for every call; a gateway's or the server's timeout
    (408, 502, 504) and a connection error (refused, reset, dropped mid-answer, a protocol
    error) only for idempotent calls (every call but job submission): after
    ``Retry-After`` when the server gives one, else an exponential backoff, plus a random
    share of the backoff so that clients refused together do not come back together;
    never past ``deadline`` seconds after the first attempt, nor more than ``retries``
    times. A request past its own ``timeout`` is not retried."""

    retries: int = 20
    deadline: float = 120.0
    base: float = 0.1
    cap: float = 10.0
    rng: random.Random = field(default_factory=random.Random)

    def delay(
        self,
        attempt: int,
        status: int,
        retry_after: str | None,
        elapsed: float,
        idempotent: bool = True,
    ) -> float | None:
        """Seconds to wait before attempt ``attempt + 1``, or None: give up."""
        retried = status in REFUSALS or (idempotent and status in GATEWAY)
        if not retried or attempt >= self.retries:
            return None
        backoff = self.backoff(attempt)
        wait = _seconds(retry_after)
        wait = (backoff if wait is None else wait) + self.rng.uniform(0, backoff)
        return wait if elapsed + wait <= self.deadline else None

    def after_failure(self, attempt: int, retryable: bool, elapsed: float) -> float | None:
        """The same rule for a request that got no answer (``retryable``: a connection error
        of an idempotent call)."""
        if not retryable or attempt >= self.retries:
            return None
        backoff = self.backoff(attempt)
        wait = backoff + self.rng.uniform(0, backoff)
        return wait if elapsed + wait <= self.deadline else None

    def backoff(self, attempt: int) -> float:
        return min(self.cap, self.base * 2**attempt)


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
    field_ = body.get("field")
    return service_error(
        status, code, str(body["message"]), None if field_ is None else str(field_), url
    )


def loads(content: bytes) -> Any:
    return orjson.loads(content) if content else None


# ------------------------------------------------------------------ limits and splitting


@dataclass(frozen=True)
class Limits:
    """``GET /v1/limits``: what one request may hold, and the model serving it."""

    max_sentences: int
    max_chars: int
    max_body_bytes: int
    max_response_floats: int
    max_tokens_per_sentence: int
    n_layers: int
    dim: int
    model: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Limits:
        sizes = {k: int(d[k]) for k in cls.__dataclass_fields__ if k != "model"}
        model = d.get("model")
        return cls(**sizes, model=dict(model) if isinstance(model, dict) else {})


def is_empty(s: str | Sequence[str]) -> bool:
    """A sentence with nothing to embed: its answer is empty (zero tokens), computed here
    (the library's answer) and never sent."""
    return not s.strip() if isinstance(s, str) else len(s) == 0


def check_sentences(sentences: Sequence[Any]) -> None:
    """What the library refuses before tokenizing, refused before any request."""
    for i, s in enumerate(sentences):
        if not isinstance(s, str) and not (
            isinstance(s, Sequence) and all(isinstance(w, str) for w in s)
        ):
            raise InputError(
                f"sentence {i} must be a string or a list of strings", field=f"sentences[{i}]"
            )
        # the library's text rule, before any request (a lone surrogate has no UTF-8 to send)
        check_document(s, f"sentences[{i}]")


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


def shift_error(e: ServiceError, position: int | Callable[[int], int]) -> ServiceError:
    """A chunk's error, its sentence index counted in the caller's whole input:
    ``position`` is the chunk's offset, or maps a chunk's index to the caller's."""
    where = position if callable(position) else (lambda k: k + position)
    m = re.fullmatch(r"sentences\[(\d+)\](.*)", e.field or "")
    if not m:
        return e
    k = int(m.group(1))
    n = where(k)
    if n == k:
        return e
    message = e.message.replace(f"sentences[{k}]", f"sentences[{n}]", 1)
    message = re.sub(rf"\bsentence {k}\b", f"sentence {n}", message, count=1)
    field_ = f"sentences[{n}]{m.group(2)}"
    return service_error(e.status, e.code, message, field_, e.url)


# ------------------------------------------------------------------ the embed request

PRIORITIES = ("interactive", "batch")


def output_of(mix: Any, output: str | None) -> str:
    """``output`` None: ``both`` with a mix (the library returns the layers and the mix),
    else ``layers``."""
    return output or ("layers" if mix is None else "both")


def output_body(*, mix: Any, output: str | None, granularity: str, pooling: str) -> dict[str, Any]:
    """The output options of ``/v1/embed`` (and ``/v1/embed/document``): base64 float32
    arrays (bit-exact, never float lists).

    ``mix``: None, a task name, a list of layer weights, a dict with ``weights`` (and
    ``gamma``, ``per_direction``, ``layer_norm``), or a MixSpec (anything with those
    attributes)."""
    body: dict[str, Any] = {
        "output": output_of(mix, output),
        "granularity": granularity,
        "pooling": pooling,
        "encoding": "base64",
        "dtype": "float32",
    }
    if isinstance(mix, str):
        body["task"] = mix
    elif mix is not None:
        spec = mix_spec(mix)
        body["mix"] = spec.pop("weights")
        body.update(spec)
    return body


MIX_KEYS = ("weights", "gamma", "per_direction", "layer_norm")
_MIX_FORMS = (
    "a task name, a list of layer weights, or a dict with 'weights' (and 'gamma', "
    "'per_direction', 'layer_norm')"
)


def mix_spec(mix: Any, field: str = "mix") -> dict[str, Any]:
    """An inline mix as ``{"weights", "gamma", "per_direction", "layer_norm"}``: a list of
    layer weights (gamma 1), a dict of those keys (``weights`` required), or anything with
    them as attributes (the library's ``MixSpec``). Anything else, an unknown key or a value
    that is not a finite number: ``InputError`` (a ``ValueError``) naming ``field``, before
    any request is sent."""
    if isinstance(mix, Mapping):
        unknown = [k for k in mix if k not in MIX_KEYS]
        if unknown:
            raise InputError(
                f"{field} has no key {unknown[0]!r}: a mix is {_MIX_FORMS}", field=field
            )
        if "weights" not in mix:
            raise InputError(f"{field} needs 'weights': a mix is {_MIX_FORMS}", field=field)
        given = dict(mix)
    elif isinstance(mix, (list, tuple)) or (hasattr(mix, "ndim") and hasattr(mix, "tolist")):
        given = {"weights": mix}
    elif not isinstance(mix, (str, bytes)) and all(hasattr(mix, k) for k in MIX_KEYS):
        given = {k: getattr(mix, k) for k in MIX_KEYS}
    else:
        raise InputError(f"{field} must be {_MIX_FORMS}, not {type(mix).__name__}", field=field)
    weights = given["weights"]
    weights = weights.tolist() if hasattr(weights, "tolist") else weights
    if not isinstance(weights, (list, tuple)) or not weights:
        raise InputError(f"{field} weights must be a non-empty list of numbers", field=field)
    out = {
        "weights": [_number(w, f"{field} weights[{i}]", field) for i, w in enumerate(weights)],
        "gamma": _number(given.get("gamma", 1.0), f"{field} gamma", field),
    }
    for flag in ("per_direction", "layer_norm"):
        value = given.get(flag, False)
        if not isinstance(value, bool) and type(value).__name__ != "bool_":
            raise InputError(f"{field} {flag} must be true or false", field=field)
        out[flag] = bool(value)
    return out


def _number(x: Any, what: str, field: str) -> float:
    if isinstance(x, (bool, str, bytes)) or not hasattr(x, "__float__"):
        raise InputError(f"{what} must be a number, not {type(x).__name__}", field=field)
    value = float(x)
    if not math.isfinite(value):
        raise InputError(f"{what} must be finite, not {value}", field=field)
    return value


def embed_body(
    chunk: Sequence[str | Sequence[str]],
    *,
    mix: Any,
    output: str | None,
    granularity: str,
    pooling: str,
    priority: str | None = None,
) -> dict[str, Any]:
    """``POST /v1/embed``'s body (``priority``: sent when not None)."""
    body: dict[str, Any] = {"sentences": [s if isinstance(s, str) else list(s) for s in chunk]}
    body.update(output_body(mix=mix, output=output, granularity=granularity, pooling=pooling))
    if priority is not None:
        body["priority"] = priority
    return body


def check_priority(priority: str | None) -> None:
    if priority is not None and priority not in PRIORITIES:
        raise InputError(
            f"priority must be one of {', '.join(PRIORITIES)}, not {priority!r}",
            field="priority",
        )


def floats_per_position(mix: Any, output: str | None, limits: Limits) -> int:
    out = output_of(mix, output)
    return limits.dim * ((limits.n_layers if out != "mix" else 0) + (out != "layers"))


# ------------------------------------------------------------------ streamed answers


@dataclass(frozen=True)
class Open:
    """One attempt at a streamed ``call``: ``(Reply, response)`` comes back, the response
    open (its body not read) when the status is a success, else None with the error's body
    in the Reply."""

    call: Call


def opening(call: Call, policy: RetryPolicy, base_url: str):
    """A streamed ``call`` opened, retried as :func:`attempts` retries (only before its
    answer has begun): the open response."""
    first, attempt = time.monotonic(), 0
    url = base_url + call.path
    while True:
        try:
            reply, response = yield Open(call)
        except ServiceUnreachable as e:
            yield Sleep(_wait_after(policy, attempt, e, call, first))
            attempt += 1
            continue
        if reply.status < 400:
            return response
        wait = policy.delay(
            attempt, reply.status, reply.headers.get("retry-after"),
            time.monotonic() - first, call.idempotent,
        )  # fmt: skip
        if wait is None:
            raise error_from(reply.status, reply.content, url)
        attempt += 1
        yield Sleep(wait)
