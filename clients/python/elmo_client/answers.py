"""Every answer checked before it is believed, then decoded into the library's values.

A chunk's answer must hold exactly the sentences asked, in order (``index``), each with
arrays that decode (float32/float16 only, data the length its ``shape`` says, finite),
shaped ``[K, T, D]`` / ``[T, D]`` for its own T tokens (``[K, D]`` / ``[D]`` pooled), the
outputs asked for, one K and D for the whole chunk, and a model version that agrees with
the ``X-Model-Version`` header. Anything else raises (``wire.attempts`` turns it into one
``ServiceError`` naming the URL): a misaligned answer never reaches the caller.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from elmo_client.shared import EmbeddedSentence, Token, decode_array
from elmo_client.wire import Reply, output_of

# TEI's timing headers (milliseconds), as the server sends them
TIMING_HEADERS = {
    "total": "x-total-time",
    "tokenization": "x-tokenization-time",
    "queue": "x-queue-time",
    "inference": "x-inference-time",
}


class BadAnswer(ValueError):
    """The answer is not what was asked (the message says how)."""


@dataclass
class ChunkAnswer:
    model: dict[str, str]
    sentences: list[EmbeddedSentence]
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def version(self) -> str:
        return self.model["version"]


@dataclass(frozen=True)
class Expect:
    """What a request asked for, so that its answer can be held to it."""

    granularity: str
    output: str  # layers | mix | both
    pooled: bool

    @classmethod
    def of(cls, *, mix: Any, output: str | None, granularity: str, pooling: str) -> Expect:
        return cls(granularity, output_of(mix, output), pooling != "none")


def timings(reply: Reply) -> dict[str, float]:
    """The server's timing headers present in ``reply``, in milliseconds."""
    out = {}
    for name, header in TIMING_HEADERS.items():
        raw = reply.headers.get(header)
        if raw is None:
            continue
        try:
            value = float(raw)
        except ValueError:
            raise BadAnswer(f"header {header}: {raw!r} is not a number of milliseconds") from None
        if not np.isfinite(value) or value < 0:
            raise BadAnswer(f"header {header}: {raw!r} is not a number of milliseconds")
        out[name] = value
    return out


def model_of(body: Any, reply: Reply) -> dict[str, str]:
    """The answer's ``model``, which the ``X-Model-Version`` header must not contradict."""
    if not isinstance(body, dict):
        raise BadAnswer("the answer is not a JSON object")
    model = body.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("version"), str):
        raise BadAnswer("the answer names no model version")
    header = reply.headers.get("x-model-version")
    if header is not None and header != model["version"]:
        raise BadAnswer(
            f"header X-Model-Version {header!r} disagrees with the body's model version "
            f"{model['version']!r}"
        )
    return {k: str(v) for k, v in model.items() if isinstance(v, str | int)}


def check_embed(
    body: Any, reply: Reply, sentences: Sequence[str | Sequence[str]], expect: Expect
) -> ChunkAnswer:
    """``POST /v1/embed``'s answer for ``sentences``, checked and decoded."""
    model = model_of(body, reply)
    data = body.get("data")
    if not isinstance(data, list):
        raise BadAnswer("the answer has no data list")
    if len(data) != len(sentences):
        raise BadAnswer(f"{len(data)} sentences answered for {len(sentences)} asked")
    out: list[EmbeddedSentence] = []
    dims: set[tuple[int, ...]] = set()
    for i, (d, s) in enumerate(zip(data, sentences, strict=True)):
        if not isinstance(d, dict) or d.get("index") != i:
            got = d.get("index") if isinstance(d, dict) else d
            raise BadAnswer(f"data[{i}] has index {got!r}: answers out of order")
        sentence, dim = decode_one(d, expect, f"data[{i}]", s)
        dims.add(dim)
        out.append(sentence)
    if len(dims) > 1:
        raise BadAnswer(f"the sentences' arrays disagree on layers and width: {sorted(dims)}")
    return ChunkAnswer(model, out, timings(reply))


def decode_one(
    d: dict[str, Any], expect: Expect, where: str, sentence: str | Sequence[str] | None = None
) -> tuple[EmbeddedSentence, tuple[int, ...]]:
    """One ``data`` entry as the library's ``EmbeddedSentence`` (tokens, or words with
    their index as ``word``, as ``Embedder.embed(granularity="word")`` gives them), and its
    (K, D): K layers (0 without layers), width D."""
    tokens = _tokens(d, expect.granularity, where, sentence)
    t = len(tokens)
    layers = mix = None
    k = 0
    if expect.output in ("layers", "both"):
        layers = _array(d, "layers", where)
        want = 2 if expect.pooled else 3
        if layers.ndim != want or (not expect.pooled and layers.shape[1] != t):
            raise BadAnswer(
                f"{where}.layers has shape {list(layers.shape)}; {t} tokens need "
                + ("[K, D]" if expect.pooled else f"[K, {t}, D]")
            )
        indices = d["layers"].get("indices")
        if indices is not None and (not isinstance(indices, list) or len(indices) != len(layers)):
            raise BadAnswer(f"{where}.layers holds {len(layers)} layers, indices {indices!r}")
        k = layers.shape[0]
    if expect.output in ("mix", "both"):
        mix = _array(d, "mix", where)
        want_shape = mix.ndim == (1 if expect.pooled else 2)
        if not want_shape or (not expect.pooled and mix.shape[0] != t):
            raise BadAnswer(
                f"{where}.mix has shape {list(mix.shape)}; {t} tokens need "
                + ("[D]" if expect.pooled else f"[{t}, D]")
            )
    widths = {a.shape[-1] for a in (layers, mix) if a is not None}
    if len(widths) > 1:
        raise BadAnswer(f"{where}: layers and mix differ in width ({sorted(widths)})")
    text = sentence if sentence is None or isinstance(sentence, str) else " ".join(sentence)
    return EmbeddedSentence(tokens, layers, mix, text), (k, *widths)


def _array(d: dict[str, Any], key: str, where: str) -> np.ndarray:
    if d.get(key) is None:
        raise BadAnswer(f"{where} has no {key}, which was asked for")
    try:
        return decode_array(d[key], finite=True)
    except ValueError as e:
        raise BadAnswer(f"{where}.{key}: {e}") from None


def _tokens(
    d: dict[str, Any], granularity: str, where: str, sentence: str | Sequence[str] | None
) -> list[Token]:
    key = "words" if granularity == "word" else "tokens"
    items = d.get(key)
    if not isinstance(items, list):
        raise BadAnswer(f"{where} has no {key} list")
    # a span past the sentence's end, or a word index past its words: another sentence's
    # (pre-tokenized words: spans are the server's; the word index is checked)
    limit = len(sentence) if isinstance(sentence, str) else None
    words = len(sentence) if sentence is not None and not isinstance(sentence, str) else None
    out = []
    for j, t in enumerate(items):
        if not isinstance(t, dict) or not isinstance(t.get("text"), str):
            raise BadAnswer(f"{where}.{key}[{j}] is not a token")
        start, end = t.get("start"), t.get("end")
        word = j if granularity == "word" else t.get("word")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (start, end, word)):
            raise BadAnswer(f"{where}.{key}[{j}] lacks integer start, end and word")
        if not 0 <= start <= end or (limit is not None and end > limit):
            raise BadAnswer(f"{where}.{key}[{j}] spans [{start}, {end}), not in its sentence")
        if words is not None and not 0 <= word < max(words, 1):
            raise BadAnswer(f"{where}.{key}[{j}] is word {word} of a {words}-word sentence")
        text = t["text"].replace("\u2581", "") if granularity == "word" else t["text"]
        out.append(Token(text, start, end, word))
    return out


def empty_sentence(expect: Expect, k: int, dim: int) -> EmbeddedSentence:
    """What the library answers for a sentence with no tokens: zero positions (``[K, 0, D]``,
    ``[0, D]``); pooled, the zero vector."""
    shape = (k, dim) if expect.pooled else (k, 0, dim)
    layers = np.zeros(shape, np.float32) if expect.output in ("layers", "both") else None
    mix = None
    if expect.output in ("mix", "both"):
        mix = np.zeros((dim,) if expect.pooled else (0, dim), np.float32)
    return EmbeddedSentence([], layers, mix)


# ------------------------------------------------------------------ documents


@dataclass
class DocumentLine:
    """One line of ``POST /v1/embed/document``'s answer: a chunk, or the end."""

    chunk: int | None = None
    sentence: EmbeddedSentence | None = None
    done: dict[str, int] | None = None


def document_line(line: bytes, expect: Expect, n_chunks: int, url: str) -> DocumentLine:
    """A streamed line checked: chunk ``n_chunks`` (the next in order), ``done``, or the
    server's error (raised as the client's ServiceError)."""
    import orjson

    from elmo_client.wire import error_from

    obj = orjson.loads(line)
    if not isinstance(obj, dict):
        raise BadAnswer("a streamed line is not a JSON object")
    if "error" in obj:
        err = obj["error"]
        raise error_from(_status_of(err), orjson.dumps(err), url)
    if obj.get("done") is True:
        chunks, tokens = obj.get("chunks"), obj.get("tokens")
        if not isinstance(chunks, int) or not isinstance(tokens, int):
            raise BadAnswer("the last line lacks integer chunks and tokens")
        return DocumentLine(done={"chunks": chunks, "tokens": tokens})
    if obj.get("chunk") != n_chunks:
        raise BadAnswer(f"chunk {obj.get('chunk')!r} came where chunk {n_chunks} was due")
    sentence, _ = decode_one(obj, expect, f"chunk {n_chunks}")
    return DocumentLine(chunk=n_chunks, sentence=sentence)


def _status_of(err: Any) -> int:
    """A streamed error's HTTP status: its ``status`` if it says, else 422 for the input
    codes (so ``except InputError`` catches them as it would a 422), else 500."""
    if isinstance(err, dict):
        if isinstance(err.get("status"), int):
            return err["status"]
        if err.get("code") in ("invalid_input", "limit_exceeded", "response_too_large"):
            return 422 if err.get("code") == "invalid_input" else 413
    return 500
