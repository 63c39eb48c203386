"""Task data as tensors: word and character ids (the baseline's input), the frozen
biLM's layers per word (ELMo's), labels, and length-bucketed batches.

Every split is a list of sentences (lists of words); a sentence task's text is
split on whitespace (the built-in polarity data is tokenised that way). The
biLM's layers are embedded once per (model version, split contents) and kept on
disk as float32, so the stored task mix sees the numbers the service computes.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from elmo_pretrain.probe.features import fingerprint
from elmo_service.artifact import Artifact
from elmo_service.atomic import atomic_open
from elmo_service.embedder import Embedder
from elmo_service.values import word_groups

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
    elmo: np.ndarray | None  # [N_words, L+1, D] float32 (memory-mapped from the cache), or None
    # evaluation runs the character CNN once per distinct spelling: row 0 of ``char_table``
    # is padding's (all zeros), ``spellings[i]`` indexes sentence i's words into it
    char_table: np.ndarray | None = None  # [U, C]
    spellings: list[np.ndarray] | None = None  # per sentence: [T] rows of char_table

    def __len__(self) -> int:
        return len(self.words)

    def head(self, n: int) -> Split:
        """The first ``n`` sentences (the same layer rows: offsets index into them)."""
        if n >= len(self):
            return self
        table, spellings = self.char_table, self.spellings
        if spellings is not None:  # only the head's spellings (and padding's row 0)
            flat = np.concatenate([np.zeros(1, dtype=np.int64), *spellings[:n]])
            used, inverse = np.unique(flat, return_inverse=True)
            table = table[used]
            cuts = np.cumsum([len(s) for s in spellings[:n]])[:-1]
            spellings = np.split(inverse.reshape(-1)[1:].astype(np.int64), cuts)
        return Split(
            self.words[:n],
            self.chars[:n],
            self.labels[:n],
            self.offsets[: n + 1],
            self.elmo,
            table,
            spellings,
        )


def encode(
    sentences: Sequence[Sequence[str]],
    labels: Sequence[Sequence[int]] | Sequence[int],
    vocab: Vocab,
    max_chars: int,
    elmo: np.ndarray | None,
) -> Split:
    words, spellings = [], []
    rows: dict[str, int] = {"": 0}  # a word's first max_chars characters -> its table row
    table = [np.zeros(max_chars, dtype=np.int64)]
    for s in sentences:
        words.append(np.array([vocab.words.get(w.lower(), UNK) for w in s], dtype=np.int64))
        for w in s:
            if (key := w[:max_chars]) not in rows:
                rows[key] = len(table)
                ids = [vocab.chars.get(ch, UNK) for ch in key]
                table.append(np.pad(np.array(ids, dtype=np.int64), (0, max_chars - len(ids))))
        spellings.append(np.array([rows[w[:max_chars]] for w in s], dtype=np.int64))
    char_table = np.stack(table)
    chars = [char_table[sp] for sp in spellings]  # each word's row, looked up once per spelling
    labs = [np.atleast_1d(np.asarray(y, dtype=np.int64)) for y in labels]
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in sentences])]).astype(np.int64)
    return Split(words, chars, labs, offsets, elmo, char_table, spellings)


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
    out, writes = {}, []
    # a split's file is written (and fsynced) while the next split embeds; every write has
    # ended, or raised, when this returns
    with ThreadPoolExecutor(1, thread_name_prefix="finetune-cache") as writer:
        for split, sents in sentences.items():
            key = fingerprint([list(s) for s in sents])
            path = cache_dir / art.version / f"{split}-{key}-{emb.precision}-words-f32.npy"
            if path.is_file():
                out[split] = np.load(path, mmap_mode="r")
                continue
            log(f"[features] embedding {split}: {len(sents):,} sentences")
            out[split] = split_layers(emb, sents, log=log)  # used as it is, not read back
            writes.append(writer.submit(_save, path, out[split]))
        for w in writes:
            w.result()
    return out


def _save(path: Path, arr: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "wb") as f:
        np.save(f, arr)


# Sentences per embed_tokens call, in input order. A sentence's layers differ in the
# last bits (~1e-6) with its batch mates, and these are the batches the cached layers
# have always had (elmo_pretrain.probe.features.word_features, chunk=512): the same numbers,
# so an existing cache stays valid. Sorting the whole split by length, or 16k-token
# batches, measured no faster here (the biLM kernel's work is the same; docs/finetune.md).
CHUNK_SENTENCES = 512


def split_layers(
    emb: Embedder,
    sentences: Sequence[Sequence[str]],
    log: Callable[[str], None] | None = None,
) -> np.ndarray:
    """Pre-tokenized sentences -> ``[N_words, L+1, D]`` float32, words in sentence order:
    ``word_features(emb, sentences, chunk=512, dtype=np.float32)`` bit for bit, without its
    per-sentence answer objects and with each word's pieces averaged by one
    ``np.add.reduceat`` instead of ``np.add.at``'s per-element loop."""
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in sentences])]).astype(np.int64)
    out = np.empty((int(offsets[-1]), emb.n_layers, emb.dim), dtype=np.float32)
    t0 = time.monotonic()
    for start in range(0, len(sentences), CHUNK_SENTENCES):
        if log is not None and start:
            eta = (time.monotonic() - t0) / start * (len(sentences) - start)
            log(f"[features] {start:,}/{len(sentences):,} sentences, ~{eta:.0f}s left")
        chunk = [list(s) for s in sentences[start : start + CHUNK_SENTENCES]]
        toks = emb.tokenize(chunk)
        layers = emb.embed_tokens([[t.piece for t in ts] for ts in toks])
        for i, (ts, x) in enumerate(zip(toks, layers, strict=True), start=start):
            words = average_pieces(x, ts)
            assert words.shape[1] == offsets[i + 1] - offsets[i], "one vector per given word"
            out[offsets[i] : offsets[i + 1]] = words.transpose(1, 0, 2)
    return out


def average_pieces(layers: np.ndarray, tokens: Sequence) -> np.ndarray:
    """``[L+1, T, D]`` -> ``[L+1, W, D]``: each word's pieces averaged, bit for bit as
    ``elmo_service.values.average_words`` (float64 sums in piece order, then the mean), with
    one ``np.add.reduceat`` over the word's contiguous pieces instead of ``np.add.at``."""
    ids, n_words = word_groups(tokens)
    if n_words == len(tokens) and (ids == np.arange(len(ids))).all():
        return layers  # one piece per word
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    if len(starts) != n_words:  # a word's pieces not contiguous: the library's way
        from elmo_service.values import average_words

        return average_words(layers, tokens, axis=1)
    sums = np.add.reduceat(layers.astype(np.float64), starts, axis=1)
    counts = np.diff(np.r_[starts, len(ids)]).reshape(1, -1, 1)
    return (sums / counts).astype(np.float32)


@dataclass
class Batch:
    words: torch.Tensor  # [B, T]
    chars: torch.Tensor | None  # [B, T, C] (None: evaluation, see char_features)
    mask: torch.Tensor  # [B, T] bool
    labels: torch.Tensor  # [B, T] (tags, padding 0) or [B] (classes)
    elmo: torch.Tensor | None  # [L+1, B, T, D]
    index: np.ndarray  # the sentences, in batch order
    spellings: torch.Tensor | None = None  # [B, T] rows of the split's char_table (0: padding)
    # evaluation: the character CNN's output per char_table row, computed once per split
    char_features: torch.Tensor | None = None  # [U, filters]


def _padded(parts: list[np.ndarray], mask: np.ndarray) -> np.ndarray:
    """Per-sentence ``[n_i, ...]`` arrays -> ``[B, T, ...]``, zeros past each sentence."""
    out = np.zeros((*mask.shape, *parts[0].shape[1:]), dtype=parts[0].dtype)
    out[mask] = np.concatenate(parts)
    return out


def make_batch(split: Split, index: np.ndarray, tokens: bool, chars: bool = True) -> Batch:
    """Padded tensors for the sentences ``index``, each part filled by one numpy
    scatter (no per-sentence tensor copies); the same values as one sentence at a time.
    ``chars=False``: no character ids (evaluation reads the spellings' CNN outputs)."""
    index = np.asarray(index)
    lengths = np.array([len(split.words[i]) for i in index], dtype=np.int64)
    mask = np.arange(lengths.max()) < lengths[:, None]  # [B, T]
    words = _padded([split.words[i] for i in index], mask)
    char_ids = _padded([split.chars[i] for i in index], mask) if chars else None
    if tokens:
        labels = torch.from_numpy(_padded([split.labels[i] for i in index], mask))
    else:
        labels = torch.from_numpy(np.array([split.labels[i][0] for i in index], dtype=np.int64))
    spellings = None
    if split.spellings is not None:
        spellings = torch.from_numpy(_padded([split.spellings[i] for i in index], mask))
    elmo = None
    if split.elmo is not None:
        n_layers, dim = split.elmo.shape[1:]
        starts = split.offsets[index]
        # the batch's layer rows in (sentence, word) order: one gather from the memory map
        before = np.cumsum(lengths) - lengths  # words of the batch before each sentence
        rows = np.arange(int(lengths.sum())) + np.repeat(starts - before, lengths)
        layers = np.zeros((n_layers, *mask.shape, dim), dtype=np.float32)
        layers[:, mask] = np.asarray(split.elmo[rows]).transpose(1, 0, 2)
        elmo = torch.from_numpy(layers)
    return Batch(
        torch.from_numpy(words),
        None if char_ids is None else torch.from_numpy(char_ids),
        torch.from_numpy(mask),
        labels,
        elmo,
        index,
        spellings,
    )


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
