"""Task data as tensors: word and character ids (the baseline's input), the frozen
biLM's layers per word (ELMo's), labels, and length-bucketed batches.

Every split is a list of sentences (lists of words); a sentence task's text is
split on whitespace (the built-in polarity data is tokenised that way). The
biLM's layers are embedded once per (model version, split contents) and kept on
disk as float32, so the stored task mix sees the numbers the service computes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from elmo_pretrain.probe.features import cached, fingerprint, word_features
from elmo_service.artifact import Artifact
from elmo_service.embedder import Embedder

PAD, UNK = 0, 1


@dataclass
class Vocab:
    """Lower-cased training words seen ``min_count`` times, and every training character."""

    words: dict[str, int]
    chars: dict[str, int]

    @classmethod
    def build(cls, sentences: Sequence[Sequence[str]], min_count: int) -> Vocab:
        counts = Counter(w.lower() for s in sentences for w in s)
        kept = sorted(w for w, n in counts.items() if n >= min_count)
        chars = sorted({c for s in sentences for w in s for c in w})
        return cls({w: i + 2 for i, w in enumerate(kept)}, {c: i + 2 for i, c in enumerate(chars)})


@dataclass
class Split:
    """One split, ready for batching. ``elmo`` rows are words in sentence order."""

    words: list[np.ndarray]  # per sentence: word ids [T]
    chars: list[np.ndarray]  # per sentence: char ids [T, C]
    labels: list[np.ndarray]  # per sentence: tag ids [T], or one class id [1]
    offsets: np.ndarray  # sentence i's words are elmo[offsets[i] : offsets[i + 1]]
    elmo: np.ndarray | None  # [N_words, L+1, D] float32 (memory-mapped), or None

    def __len__(self) -> int:
        return len(self.words)

    def head(self, n: int) -> Split:
        """The first ``n`` sentences (the same layer rows: offsets index into them)."""
        if n >= len(self):
            return self
        return Split(
            self.words[:n], self.chars[:n], self.labels[:n], self.offsets[: n + 1], self.elmo
        )


def encode(
    sentences: Sequence[Sequence[str]],
    labels: Sequence[Sequence[int]] | Sequence[int],
    vocab: Vocab,
    max_chars: int,
    elmo: np.ndarray | None,
) -> Split:
    words, chars = [], []
    for s in sentences:
        words.append(np.array([vocab.words.get(w.lower(), UNK) for w in s], dtype=np.int64))
        c = np.zeros((len(s), max_chars), dtype=np.int64)
        for i, w in enumerate(s):
            ids = [vocab.chars.get(ch, UNK) for ch in w[:max_chars]]
            c[i, : len(ids)] = ids
        chars.append(c)
    labs = [np.atleast_1d(np.asarray(y, dtype=np.int64)) for y in labels]
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in sentences])]).astype(np.int64)
    return Split(words, chars, labs, offsets, elmo)


def elmo_layers(
    art: Artifact,
    sentences: dict[str, Sequence[Sequence[str]]],
    cache_dir: Path,
    precision: str,
    batch_tokens: int,
    log: Callable[[str], None],
) -> dict[str, np.ndarray]:
    """``[N_words, L+1, D]`` float32 per split, embedded once and cached on disk."""
    # labelled data is not user traffic: no sentence is refused for its length
    emb = Embedder(
        art,
        device="cpu",
        precision=precision,
        batch_tokens=batch_tokens,
        max_sentence_tokens=1_000_000,
    )
    out = {}
    for split, sents in sentences.items():
        key = fingerprint([list(s) for s in sents])
        path = cache_dir / art.version / f"{split}-{key}-{emb.precision}-words-f32.npy"
        if not path.is_file():
            log(f"[features] embedding {split}: {len(sents):,} sentences")
        out[split] = cached(
            path,
            lambda s=sents: word_features(emb, s, chunk=512, dtype=np.float32, log=log),
        )
    return out


@dataclass
class Batch:
    words: torch.Tensor  # [B, T]
    chars: torch.Tensor  # [B, T, C]
    mask: torch.Tensor  # [B, T] bool
    labels: torch.Tensor  # [B, T] (tags, padding 0) or [B] (classes)
    elmo: torch.Tensor | None  # [L+1, B, T, D]
    index: np.ndarray  # the sentences, in batch order


def make_batch(split: Split, index: np.ndarray, tokens: bool) -> Batch:
    lengths = [len(split.words[i]) for i in index]
    b, t = len(index), max(lengths)
    words = torch.zeros(b, t, dtype=torch.long)
    chars = torch.zeros(b, t, split.chars[index[0]].shape[1], dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.bool)
    labels = torch.zeros(b, t, dtype=torch.long) if tokens else torch.zeros(b, dtype=torch.long)
    elmo = None
    if split.elmo is not None:
        n_layers, dim = split.elmo.shape[1:]
        elmo = torch.zeros(n_layers, b, t, dim)
    for j, (i, n) in enumerate(zip(index, lengths, strict=True)):
        words[j, :n] = torch.from_numpy(split.words[i])
        chars[j, :n] = torch.from_numpy(split.chars[i])
        mask[j, :n] = True
        if tokens:
            labels[j, :n] = torch.from_numpy(split.labels[i])
        else:
            labels[j] = int(split.labels[i][0])
        if elmo is not None:
            rows = split.elmo[split.offsets[i] : split.offsets[i + 1]]
            elmo[:, j, :n] = torch.from_numpy(np.array(rows)).transpose(0, 1)
    return Batch(words, chars, mask, labels, elmo, np.asarray(index))


def batches(
    split: Split, size: int, rng: np.random.Generator | None, pool: int = 20
) -> list[np.ndarray]:
    """Sentence indices in batches of similar length (little padding).

    Training (``rng`` given): shuffled, sorted by length within pools of
    ``pool`` batches, batches shuffled. Evaluation: sorted by length.
    """
    n = len(split)
    lengths = np.array([len(w) for w in split.words])
    if rng is None:
        order = np.argsort(lengths, kind="stable")
        return [order[i : i + size] for i in range(0, n, size)]
    order = rng.permutation(n)
    out = []
    for p in range(0, n, size * pool):
        chunk = order[p : p + size * pool]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        out += [chunk[i : i + size] for i in range(0, len(chunk), size)]
    rng.shuffle(out)
    return out
