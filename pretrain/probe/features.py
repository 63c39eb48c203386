"""Frozen-biLM features for the probe, computed once per (model version, split) and cached.

Embeddings are kept on disk as float16 arrays, so re-running a probe costs
only the linear training.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from elmo_service.atomic import atomic_open
from elmo_service.embedder import Embedder, words_of


def weights_tag(emb: Embedder) -> str:
    """Feature-cache name part: empty for fp32, so existing caches stay valid."""
    return "" if emb.weights == "fp32" else f"-{emb.weights}"


def word_features(
    emb: Embedder,
    sentences: Sequence[Sequence[str]],
    chunk: int = 2048,
    dtype: type = np.float16,
    log: Callable[[str], None] | None = None,
) -> np.ndarray:
    """Pre-tokenized sentences → word vectors ``[N_words, L+1, D]`` (float16: the
    probe's; float32: the finetuner's, whose stored mix must match the service's).

    A word's subword pieces are averaged; words appear in sentence order.
    ``log`` gets a progress line per chunk.
    """
    n_words = sum(len(s) for s in sentences)
    out = np.empty((n_words, emb.n_layers, emb.dim), dtype=dtype)
    pos = 0
    t0 = time.monotonic()
    for start in range(0, len(sentences), chunk):
        if log is not None and start:
            _progress(log, start, len(sentences), time.monotonic() - t0)
        for sent, res in zip(
            sentences[start : start + chunk],
            emb.embed(sentences[start : start + chunk]),
            strict=True,
        ):
            _, layers = words_of(res.tokens, res.layers)
            assert layers.shape[1] == len(sent), "one vector per given word"
            out[pos : pos + len(sent)] = layers.transpose(1, 0, 2)
            pos += len(sent)
    return out


def _progress(log: Callable[[str], None], done: int, total: int, seconds: float) -> None:
    eta = seconds / done * (total - done)
    log(f"[features] {done:,}/{total:,} sentences, {seconds:.0f}s, ~{eta:.0f}s left")


def pooled_features(emb: Embedder, texts: Sequence[str], chunk: int = 2048) -> np.ndarray:
    """Sentences → mean over tokens of each layer, ``[N, L+1, D]`` float32."""
    out = np.zeros((len(texts), emb.n_layers, emb.dim), dtype=np.float32)
    for start in range(0, len(texts), chunk):
        for i, res in enumerate(emb.embed(texts[start : start + chunk])):
            if res.layers.shape[1]:
                out[start + i] = res.layers.mean(axis=1)
    return out


def fingerprint(inputs: object) -> str:
    """A short hash of a split's inputs: the feature cache must not serve another slice."""
    return hashlib.sha256(json.dumps(inputs, ensure_ascii=False).encode()).hexdigest()[:12]


def cached(path: Path, make: Callable[[], np.ndarray]) -> np.ndarray:
    """Load ``path`` (.npy) if present, else compute and save it atomically."""
    if path.is_file():
        return np.load(path, mmap_mode="r")
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = make()
    with atomic_open(path, "wb") as f:
        np.save(f, arr)
    return np.load(path, mmap_mode="r")
