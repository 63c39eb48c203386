"""The values both sides of the wire share: tokens, embedded sentences, words, arrays.

One file, numpy and the standard library only, so that the library (``Embedder``), the
HTTP API (``api/encoding.py``) and the Python client decode and encode one way: the
client distribution ships this very file as ``elmo_client/values.py`` (a git symlink to
it; setuptools copies the file into the wheel). It therefore imports nothing of the
project, not even with a relative import: ``tests/elmo_service/test_values_shared.py``
holds that, and that the two names are one file.

* ``Token``, ``EmbeddedSentence``: what ``Embedder.embed`` and ``Client.embed`` answer;
* ``word_tokens``, ``average_words``, ``words_of``: a word's vector is its pieces' mean;
* ``encode_array``, ``decode_array``: ``{"shape", "dtype", "data"}`` (base64 of the
  little-endian C-order bytes, or nested lists), checked both ways;
* ``ElmoServiceError``, ``InputError``: errors that carry the offending ``field``.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# the dtypes an answer's arrays may travel in
WIRE_DTYPES = ("float32", "float16")


# ------------------------------------------------------------------ errors


class ElmoServiceError(Exception):
    code = "error"

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class InputError(ElmoServiceError, ValueError):
    """The caller's input is unusable (empty, too long, wrong type).

    ``index`` (and ``word``): the position of the offending sentence (and word) in what the
    caller passed, 0-based. The message already names it as the caller asked
    (``Embedder.tokenize``'s ``where``), so no caller rewrites a message."""

    code = "invalid_input"

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        index: int | None = None,
        word: int | None = None,
    ) -> None:
        super().__init__(message, field=field)
        self.index, self.word = index, word


def invalid_text(text: str) -> str | None:
    """Why ``text`` cannot be embedded, or None: the text rule of every surface (the library,
    every route, the client), written once. A lone surrogate (``"\\ud800"``, which JSON can
    carry) has no UTF-8 form: the tokenizer would fail deep inside with a traceback. A NUL is
    never text (a binary file read as text) and ends a string for any C code it reaches."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"is not valid Unicode (a lone surrogate at character {e.start})"
    if (at := text.find("\x00")) >= 0:
        return f"is not text (a NUL character at character {at})"
    return None


def check_text(text: str, field: str, name: str | None = None) -> str:
    """``text``, or :class:`InputError` naming ``field`` (its message says ``name``, default
    ``field``) when :func:`invalid_text` refuses it."""
    why = invalid_text(text)
    if why is not None:
        raise InputError(f"{name or field} {why}", field=field)
    return text


def check_document(document: Any, field: str = "document") -> None:
    """A document (text, or its words) holds only text every surface can embed."""
    if isinstance(document, str):
        check_text(document, field)
        return
    for j, w in enumerate(document):
        if isinstance(w, str):
            check_text(w, f"{field}[{j}]")


# ------------------------------------------------------------------ tokens and words


@dataclass(frozen=True, slots=True)
class Token:
    """A model token: ``text``, the text of its span ``[start, end)`` of the input, always
    (with sentencepiece's ``▁`` in front where the piece begins a word: the text less that
    mark is the span); the index of its word; and ``piece``, what the model reads (the
    character CNN's input) where it differs from ``text``: a byte piece (``<0xC3>``),
    sentencepiece's NFKC form (``fi`` for ``ﬁ``), a lowercasing model's ``the``.

    A character the model reads as several byte pieces gives that many tokens, one per
    model position, each with the character's span and text (``é``, ``é``): the positions
    are the model's and each keeps its own vector; a word's text and vector take each
    character once (:func:`word_tokens`, :func:`average_words`). ``piece`` is not compared,
    printed or sent: a client's tokens (text and span) equal the library's."""

    text: str
    start: int
    end: int
    word: int
    piece: str = field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.piece:
            object.__setattr__(self, "piece", self.text)

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "start": self.start, "end": self.end, "word": self.word}

    @property
    def surface(self) -> str:
        """The text of the span: ``text`` less sentencepiece's word mark."""
        n = self.end - self.start
        return self.text[len(self.text) - n :] if 0 <= n <= len(self.text) else self.text


def word_tokens(tokens: Sequence[Token], text: str | None = None) -> list[Token]:
    """One token per word: spans from its first to its last piece.

    The text is the word's span in ``text`` when given, else its tokens' spans joined,
    each character once (pieces of one character share its span): the same words as long
    as the word's span holds no character the tokenizer dropped.
    """
    groups: dict[int, list[Token]] = {}
    for t in tokens:
        groups.setdefault(t.word, []).append(t)
    out = []
    for w, pieces in sorted(groups.items()):
        start, end = pieces[0].start, pieces[-1].end
        word = text[start:end] if text is not None else _joined(pieces)
        out.append(Token(word, start, end, w))
    return out


def _joined(pieces: Sequence[Token]) -> str:
    """A word's text from its tokens: each token's span once, in order."""
    parts, covered = [], pieces[0].start
    for p in pieces:
        if p.end > covered:
            parts.append(p.surface[max(0, covered - p.start) :])
        covered = max(covered, p.end)
    return "".join(parts)


def word_groups(tokens: Sequence[Token]) -> tuple[np.ndarray, int]:
    """Dense word ids 0..W-1 in order, and W (a word with no tokens gets no slot)."""
    raw = np.fromiter((t.word for t in tokens), dtype=np.int64, count=len(tokens))
    if not len(raw):
        return raw, 0
    uniq, ids = np.unique(raw, return_inverse=True)
    return ids.reshape(-1), len(uniq)


def average_words(x: np.ndarray, tokens: Sequence[Token], axis: int) -> np.ndarray:
    """Average the positions (along ``axis``) that belong to the same word, in float64."""
    ids, n_words = word_groups(tokens)
    if n_words == len(tokens) and (ids == np.arange(len(ids))).all():
        return x  # one token per word
    moved = np.moveaxis(x, axis, 0).astype(np.float64)
    sums = np.zeros((n_words, *moved.shape[1:]), dtype=np.float64)
    np.add.at(sums, ids, moved)
    counts = np.bincount(ids, minlength=n_words).reshape(-1, *([1] * (moved.ndim - 1)))
    out = (sums / np.maximum(counts, 1)).astype(np.float32)
    return np.moveaxis(out, 0, axis)


def words_of(
    tokens: Sequence[Token], layers: np.ndarray, text: str | None = None
) -> tuple[list[str], np.ndarray]:
    """Average the vectors of each word's tokens: the words' texts and ``[L+1, W, D]``."""
    return [t.text for t in word_tokens(tokens, text)], average_words(layers, tokens, axis=1)


@dataclass
class EmbeddedSentence:
    tokens: list[Token]  # words when embedded with granularity="word"
    layers: np.ndarray  # [L+1, T, D] float32
    mix: np.ndarray | None = None  # [T, D] when a mix was asked for
    # the sentence the offsets point into (pre-tokenized words: joined by single spaces)
    text: str | None = field(default=None, repr=False)

    def words(self) -> tuple[list[str], np.ndarray]:
        """Word-level vectors: a word's pieces averaged. ``[L+1, W, D]``. The words are
        their spans of the sentence: what ``granularity="word"`` answers."""
        return words_of(self.tokens, self.layers, self.text)


# ------------------------------------------------------------------ arrays on the wire


def as_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """C-contiguous little-endian array of ``dtype`` (orjson and base64 both need that)."""
    return np.ascontiguousarray(x, dtype=np.dtype(dtype).newbyteorder("<"))


def encode_array(x: np.ndarray, encoding: str, dtype: str) -> dict[str, Any]:
    """``{"shape", "dtype", "data"}``; data is nested lists (json) or base64 of C-order bytes."""
    arr = as_dtype(x, dtype)
    if encoding == "base64":
        data: Any = base64.b64encode(arr.tobytes()).decode("ascii")
    else:
        data = arr if arr.dtype.isnative else arr.astype(arr.dtype.newbyteorder("="))
    return {"shape": list(arr.shape), "dtype": dtype, "data": data}


def decode_array(obj: Any, *, finite: bool = False) -> np.ndarray:
    """Inverse of :func:`encode_array`, as float32, checked: a ``ValueError`` saying what is
    wrong (not a dict, a dtype other than float32/float16, a shape that is not a list of
    sizes, data whose length is not the shape's, bad base64; with ``finite``, a NaN or
    inf) instead of a silently reshaped, relabelled or truncated array."""
    if not isinstance(obj, dict) or not {"shape", "dtype", "data"} <= obj.keys():
        raise ValueError("an array must be an object with shape, dtype and data")
    shape, dtype, data = obj["shape"], obj["dtype"], obj["data"]
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(WIRE_DTYPES)}")
    if not isinstance(shape, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise ValueError(f"shape {shape!r} is not a list of sizes")
    size = math.prod(shape)
    wire = np.dtype(dtype).newbyteorder("<")
    if isinstance(data, str):
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("data is not base64") from None
        if len(raw) != size * wire.itemsize:
            raise ValueError(
                f"data holds {len(raw)} bytes; shape {shape} of {dtype} needs "
                f"{size * wire.itemsize}"
            )
        out = np.frombuffer(raw, dtype=wire).astype(np.float32).reshape(shape)
    else:
        try:
            out = np.asarray(data, dtype=np.float32)
        except (TypeError, ValueError):
            raise ValueError("data is neither base64 nor nested lists of numbers") from None
        # an empty array's nested lists cannot say their inner sizes ([[], []] for [2, 0, 8])
        if list(out.shape) != shape and not (size == 0 and out.size == 0):
            raise ValueError(f"data has shape {list(out.shape)}, not the shape {shape} it names")
        out = out.reshape(shape)
    if finite and not np.isfinite(out).all():
        raise ValueError("data holds a NaN or an infinity")
    return out
