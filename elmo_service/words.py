"""Sub-word pieces grouped into words: one vector per word is its pieces' mean.

Written once for the library (``EmbeddedSentence.words``, ``granularity="word"``) and the
API (``api/outputs.py``); numpy only, so importing it loads no model code.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from elmo_service.tokenizers import Token


def word_tokens(tokens: Sequence[Token], text: str | None = None) -> list[Token]:
    """One token per word: spans from its first to its last piece.

    The text is the word's span in ``text`` when given, else its pieces joined
    without sentencepiece's space marker.
    """
    groups: dict[int, list[Token]] = {}
    for t in tokens:
        groups.setdefault(t.word, []).append(t)
    out = []
    for w, pieces in sorted(groups.items()):
        start, end = pieces[0].start, pieces[-1].end
        word = text[start:end] if text is not None else "".join(p.text for p in pieces)
        out.append(Token(word.replace("\u2581", ""), start, end, w))
    return out


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
