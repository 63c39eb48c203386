"""Layers -> what the client asked for: layer subsets, scalar mixes, words, pooling.

Pure numpy, run by the HTTP layer on cached or freshly computed layers; it
mirrors :class:`elmo_service.scalar_mix.ScalarMix` (tests hold it to
``apply_mix`` within 1e-5).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from api.encoding import DType, Encoding, as_dtype, encode_array
from elmo_service.errors import ElmoServiceError, InputError
from elmo_service.scalar_mix import MixSpec
from elmo_service.tokenizers import Token

FLOAT16_MAX = float(np.finfo(np.float16).max)


class NonFiniteOutput(ElmoServiceError):
    """The model itself produced a non-finite value (a server fault: answered 500)."""

    code = "non_finite_output"


def softmax(x: Sequence[float]) -> np.ndarray:
    """Stable softmax: shifted by the max in float64, so any finite weights give finite
    probabilities (a float32 cast first would turn 1e308 into inf, and inf - inf into NaN)."""
    a = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):  # a gap beyond float64 is -inf: exp gives 0, as it should
        e = np.exp(a - a.max())
    return (e / e.sum()).astype(np.float32)


def encode_checked(
    x: np.ndarray, encoding: Encoding, dtype: DType, *, what: str, cause: str | None
) -> dict:
    """:func:`encode_array` that never lets a NaN or inf out (one pass over the output).

    A float16 overflow names ``dtype``; a mix that overflowed names ``cause`` (the
    request field that scaled it: ``gamma``, ``mix`` or ``task``); non-finite layers
    are the model's fault and raise NonFiniteOutput naming ``what``.
    """
    with np.errstate(over="ignore"):  # a float16 overflow is reported below, naming dtype
        arr = as_dtype(x, dtype)
    if not np.isfinite(arr).all():
        if arr.dtype.itemsize == 2 and np.isfinite(x).all():
            top = float(np.abs(x).max())
            raise InputError(
                f"{what}: values reach {top:.4g}, beyond float16's range (+-{FLOAT16_MAX:g}); "
                "ask for dtype float32",
                field="dtype",
            )
        if cause is not None:
            raise InputError(
                f"{what}: the mix gives non-finite values; use a smaller {cause}", field=cause
            )
        raise NonFiniteOutput(f"{what}: the model produced non-finite values", field=what)
    return encode_array(arr, encoding, dtype)


def _layer_norm(h: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """Normalise one layer ``[T, D]`` over all its positions and features."""
    if h.size == 0:
        return h
    mean = h.mean(dtype=np.float64)
    var = ((h - mean) ** 2).mean(dtype=np.float64)
    return ((h - mean) / np.sqrt(var + eps)).astype(np.float32)


def mix(layers: np.ndarray, spec: MixSpec) -> np.ndarray:
    """``[L+1, T, D]`` -> ``[T, D]``: gamma * sum_j softmax(s)_j h_j (per direction if asked)."""
    n = layers.shape[0]
    spec.validate(n)
    if spec.layer_norm:
        layers = np.stack([_layer_norm(h) for h in layers])
    w = softmax(spec.weights)
    if not spec.per_direction:
        out = np.tensordot(w, layers, axes=1)
    else:
        p = layers.shape[-1] // 2
        nl = n - 1
        tok = layers[0, :, :p]
        fwd = np.tensordot(w[1 : 1 + nl], layers[1:, :, :p], axes=1)
        bwd = np.tensordot(w[1 + nl :], layers[1:, :, p:], axes=1)
        out = np.concatenate([w[0] * tok + fwd, w[0] * tok + bwd], axis=-1)
    with np.errstate(over="ignore", invalid="ignore"):  # encode_checked reports non-finite
        return (np.float32(spec.gamma) * out).astype(np.float32, copy=False)


def word_groups(tokens: Sequence[Token]) -> tuple[np.ndarray, int]:
    """Dense word ids 0..W-1 in order (a word with no tokens gets no slot)."""
    raw = np.fromiter((t.word for t in tokens), dtype=np.int64, count=len(tokens))
    if not len(raw):
        return raw, 0
    uniq, ids = np.unique(raw, return_inverse=True)
    return ids.reshape(-1), len(uniq)


def to_words(x: np.ndarray, tokens: Sequence[Token], axis: int) -> np.ndarray:
    """Average positions (along ``axis``) that belong to the same word."""
    ids, n_words = word_groups(tokens)
    if n_words == len(tokens) and (ids == np.arange(len(ids))).all():
        return x
    moved = np.moveaxis(x, axis, 0).astype(np.float64)
    sums = np.zeros((n_words, *moved.shape[1:]), dtype=np.float64)
    np.add.at(sums, ids, moved)
    counts = np.bincount(ids, minlength=n_words).reshape(-1, *([1] * (moved.ndim - 1)))
    out = (sums / np.maximum(counts, 1)).astype(np.float32)
    return np.moveaxis(out, 0, axis)


def words_meta(tokens: Sequence[Token], text: str) -> list[dict]:
    out: list[dict] = []
    prev = None
    for t in tokens:
        if out and t.word == prev:
            out[-1]["end"] = t.end
        else:
            out.append({"start": t.start, "end": t.end})
        prev = t.word
    for w in out:
        w["text"] = text[w["start"] : w["end"]]
    return out


def pool(x: np.ndarray, how: str, axis: int) -> np.ndarray:
    if how == "mean":
        return x.mean(axis=axis, dtype=np.float64).astype(np.float32)
    if how == "max":
        return x.max(axis=axis)
    return x
