"""A prepared corpus on disk, and length-bucketed batches drawn from it.

Shards are memory-mapped (``np.load(mmap_mode="r")``): the trainer keeps
only per-sentence index arrays in memory (start, length, shard; 14 bytes a
sentence), never the token lists as Python objects.

Batching: sentences, each wrapped in ``<S> ... </S>`` and started from a zero
LSTM state, grouped by padded length ``T`` (a multiple of ``pad_multiple``);
a bucket's batches all have ``B = tokens_per_batch // T`` rows, so the
number of distinct ``[B, T]`` shapes is ``max_tokens / pad_multiple`` and
``torch.compile`` compiles each once. This differs from bilm-tf, which packs
the token stream into fixed ``[B, 20]`` windows and carries the LSTM state
from one batch to the next: training on whole sentences from a zero state is
exactly what the stateless embedder computes at inference, so train and
serve see the same kind of context. Sentences longer than ``max_tokens``
(markers included) are left out of training (counted in the log).

Order: epoch ``e`` shuffles with ``numpy.random.default_rng([seed, e])``, so a
batch is a pure function of (seed, epoch, index): resuming needs only those
two integers. Under DDP every rank computes the same epoch plan and takes
every ``world``-th batch (cut to a multiple of ``world`` so ranks stay in
step), like ``DistributedSampler``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from elmo_service.char_ids import bos_ids, eos_ids, token_ids
from elmo_service.errors import InputError
from pretrain.prepare import BOS, EOS, FORMAT, UNK


class Split:
    """One split's sentences across its shards, memory-mapped."""

    def __init__(self, folder: Path, shards: list[dict[str, Any]]) -> None:
        self.tokens = [
            np.load(folder / "shards" / f"{s['name']}.tokens.npy", mmap_mode="r") for s in shards
        ]
        starts, lens, shard = [], [], []
        for k, s in enumerate(shards):
            off = np.load(folder / "shards" / f"{s['name']}.offsets.npy")
            starts.append(off[:-1])
            lens.append(np.diff(off).astype(np.int32))
            shard.append(np.full(len(off) - 1, k, dtype=np.int16))
        self.starts = np.concatenate(starts) if starts else np.zeros(0, np.int64)
        self.lens = np.concatenate(lens) if lens else np.zeros(0, np.int32)
        self.shard = np.concatenate(shard) if shard else np.zeros(0, np.int16)

    def __len__(self) -> int:
        return len(self.lens)

    @property
    def n_tokens(self) -> int:
        return int(self.lens.sum())

    def sentence(self, i: int) -> np.ndarray:
        s = int(self.starts[i])
        return self.tokens[self.shard[i]][s : s + int(self.lens[i])]


class Corpus:
    """A folder written by `elmo-pretrain prepare`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        mpath = self.path / "manifest.json"
        if not mpath.is_file():
            raise InputError(
                f"{self.path} is not a prepared corpus (no manifest.json); run `elmo-pretrain prepare` first",
                field="data.path",
            )
        self.manifest = json.loads(mpath.read_text())
        if self.manifest.get("format") != FORMAT:
            raise InputError(f"{mpath}: not a {FORMAT} manifest", field="data.path")
        v = self.manifest["vocab"]
        self.vocab = [
            line.split("\t", 1)[0]
            for line in (self.path / v["file"]).read_text(encoding="utf-8").splitlines()
        ]
        self.softmax_size = int(v["softmax_size"])
        self.bos_id, self.eos_id, self.unk_id = int(v["bos_id"]), int(v["eos_id"]), int(v["unk_id"])
        assert (
            self.vocab[self.bos_id] == BOS
            and self.vocab[self.eos_id] == EOS
            and self.vocab[self.unk_id] == UNK
        )
        self._splits: dict[str, Split] = {}
        self._index: dict[str, int] | None = None

    @property
    def tokenizer_type(self) -> str:
        return self.manifest["tokenizer"]["type"]

    def split(self, name: str) -> Split:
        if name not in self.manifest["shards"]:
            raise InputError(
                f"unknown split {name!r}; have {sorted(self.manifest['shards'])}", field="split"
            )
        if name not in self._splits:
            self._splits[name] = Split(self.path, self.manifest["shards"][name])
        return self._splits[name]

    def char_table(self, max_chars: int, extra: list[str] | None = None) -> torch.Tensor:
        """Character ids of every vocabulary entry: ``[V_in, max_chars]`` int32.

        Row i is what the character CNN reads for token id i, exactly as the
        embedder builds it at inference (``<S>``/``</S>`` are the marker rows).
        """
        words = self.vocab + (extra or [])
        table = np.empty((len(words), max_chars), dtype=np.int32)
        for i, w in enumerate(words):
            table[i] = token_ids(w, max_chars)
        table[self.bos_id] = bos_ids(max_chars)
        table[self.eos_id] = eos_ids(max_chars)
        return torch.from_numpy(table)

    def load_tokenizer(self):
        """The elmo_service tokenizer that serving uses for this corpus."""
        from elmo_service.tokenizers import SentencePieceTokenizer, WordTokenizer

        if self.tokenizer_type == "sentencepiece":
            return SentencePieceTokenizer.from_file(self.path / "tokenizer.model")
        return WordTokenizer(lowercase=bool(self.manifest["tokenizer"].get("lowercase")))

    def encode_file(self, path: str | Path) -> tuple[list[np.ndarray], list[str]]:
        """A held-out text file (one sentence a line) -> id arrays, plus new words.

        Words the vocabulary lacks get ids past its end (the character CNN
        still reads them; their target is ``<unk>``); they are returned so the
        caller can extend the character table.
        """
        from pretrain.prepare import PrepareOptions, _word_split
        from pretrain.text import clean

        opts = self.manifest.get("options", {})
        lower = bool(opts.get("lowercase"))
        lines = [
            clean(line, lower)
            for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
        ]
        lines = [s for s in lines if s]
        if not lines:
            raise InputError(f"{path}: no sentences", field="file")
        if self.tokenizer_type == "sentencepiece":
            import sentencepiece as spm

            sp = spm.SentencePieceProcessor(model_file=str(self.path / "tokenizer.model"))
            remap = np.full(sp.get_piece_size(), self.unk_id, dtype=np.int32)
            for i, piece in enumerate(self.vocab):
                pid = sp.piece_to_id(piece)
                if i >= 3 and pid != sp.unk_id():
                    remap[pid] = i
            return [remap[np.asarray(x, dtype=np.int64)] for x in sp.encode(lines)], []
        split_words = _word_split(
            PrepareOptions(lowercase=lower, pretokenized=bool(opts.get("pretokenized")))
        )
        if self._index is None:
            self._index = {w: i for i, w in enumerate(self.vocab)}
        extra: dict[str, int] = {}
        out = []
        for line in lines:
            ids = []
            for w in split_words(line):
                i = self._index.get(w)
                if i is None:
                    i = extra.setdefault(w, len(self.vocab) + len(extra))
                ids.append(i)
            out.append(np.asarray(ids, dtype=np.int32))
        return out, list(extra)


@dataclass
class Batch:
    """``ids [B, T]`` token ids (padding: ``</S>``), ``targets [B, T]`` softmax ids,
    ``lengths [B]`` with markers (0 for filler rows), ``uniq [U]`` distinct ids,
    ``inverse [B, T]`` with ``uniq[inverse] == ids``; ``n_tokens`` real tokens."""

    ids: torch.Tensor
    targets: torch.Tensor
    lengths: torch.Tensor
    uniq: torch.Tensor
    inverse: torch.Tensor
    n_tokens: int


def make_batch(
    sentences: list[np.ndarray], t_pad: int, b_pad: int, corpus: Corpus, uniq_multiple: int = 1
) -> Batch:
    ids = np.full((b_pad, t_pad), corpus.eos_id, dtype=np.int64)
    lengths = np.zeros(b_pad, dtype=np.int64)
    for r, s in enumerate(sentences):
        n = len(s)
        ids[r, 0] = corpus.bos_id
        ids[r, 1 : n + 1] = s
        ids[r, n + 1] = corpus.eos_id
        lengths[r] = n + 2
    targets = np.where(ids < corpus.softmax_size, ids, corpus.unk_id)
    uniq, inverse = np.unique(ids, return_inverse=True)
    if uniq_multiple > 1 and len(uniq) % uniq_multiple:  # fewer distinct CNN shapes under compile
        uniq = np.concatenate([uniq, np.full(uniq_multiple - len(uniq) % uniq_multiple, uniq[0])])
    return Batch(
        ids=torch.from_numpy(ids),
        targets=torch.from_numpy(targets),
        lengths=torch.from_numpy(lengths),
        uniq=torch.from_numpy(uniq),
        inverse=torch.from_numpy(inverse.reshape(b_pad, t_pad)),
        n_tokens=int(lengths.sum()),
    )


def padded_len(n_tokens: int, multiple: int) -> int:
    return -(-n_tokens // multiple) * multiple


class BucketBatcher:
    """Deterministic, resumable epoch plans of length-bucketed batches for one rank."""

    def __init__(
        self,
        corpus: Corpus,
        split: str,
        *,
        max_tokens: int,
        tokens_per_batch: int,
        pad_multiple: int,
        seed: int,
        rank: int = 0,
        world: int = 1,
        uniq_multiple: int = 1,
    ) -> None:
        self.corpus, self.data = corpus, corpus.split(split)
        self.max_tokens, self.tokens_per_batch, self.pad = (
            max_tokens,
            tokens_per_batch,
            pad_multiple,
        )
        self.seed, self.rank, self.world, self.uniq_multiple = seed, rank, world, uniq_multiple
        full = self.data.lens.astype(np.int64) + 2
        self.eligible = np.nonzero(full <= max_tokens)[0]
        self.n_skipped = len(full) - len(self.eligible)
        if len(self.eligible) == 0:
            raise InputError(
                f"no {split} sentence fits data.max_tokens={max_tokens}", field="data.max_tokens"
            )
        self._plan_epoch: int | None = None
        self._plan: list[tuple[int, np.ndarray]] = []

    def rows(self, t_pad: int) -> int:
        return max(1, self.tokens_per_batch // t_pad)

    def plan(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        """This rank's batches for ``epoch``: (T_pad, sentence indices)."""
        if self._plan_epoch == epoch:
            return self._plan
        rng = np.random.default_rng([self.seed, epoch])
        order = self.eligible[rng.permutation(len(self.eligible))]
        t_pad = np.minimum(
            padded_len(self.data.lens[order].astype(np.int64) + 2, self.pad),
            padded_len(self.max_tokens, self.pad),
        )
        batches: list[tuple[int, np.ndarray]] = []
        for t in np.unique(t_pad):
            members = order[t_pad == t]
            b = self.rows(int(t))
            batches.extend((int(t), members[i : i + b]) for i in range(0, len(members), b))
        batches = [batches[i] for i in rng.permutation(len(batches))]
        n = len(batches) // self.world * self.world
        if n == 0:
            raise InputError(
                f"the training split makes {len(batches)} batches, fewer than {self.world} ranks",
                field="data",
            )
        self._plan_epoch, self._plan = epoch, batches[self.rank : n : self.world]
        return self._plan

    def batch(self, epoch: int, index: int) -> Batch:
        t, members = self.plan(epoch)[index]
        sents = [self.data.sentence(int(i)) for i in members]
        return make_batch(sents, t, self.rows(t), self.corpus, self.uniq_multiple)


def eval_batches(sentences: list[np.ndarray], corpus: Corpus, tokens_per_batch: int = 4096):
    """All sentences, sorted by length, unpadded beyond each batch's longest."""
    order = sorted(range(len(sentences)), key=lambda i: len(sentences[i]))
    i = 0
    while i < len(order):
        t = len(sentences[order[i]]) + 2
        j = i
        while j < len(order) and (j - i + 1) * (len(sentences[order[j]]) + 2) <= max(
            tokens_per_batch, t
        ):
            j += 1
        j = max(j, i + 1)
        chunk = [sentences[k] for k in order[i:j]]
        yield make_batch(chunk, max(len(s) for s in chunk) + 2, len(chunk), corpus)
        i = j
