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

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from elmo_pretrain.prepare import BOS, EOS, FORMAT, UNK
from elmo_service.atomic import sha256_file
from elmo_service.bilm.char_ids import bos_ids, eos_ids, token_ids
from elmo_service.errors import InputError


def _load_array(path: Path, expected_sha256: str | None, mmap: bool) -> np.ndarray:
    """One shard file, its checksum verified (when the manifest records one) and its
    type checked; every failure is one InputError naming the file."""
    again = "; run `elmo-pretrain prepare` again"
    if not path.is_file():
        raise InputError(f"{path}: shard file missing{again}", field="data.path")
    if expected_sha256 is not None and sha256_file(path) != expected_sha256:
        raise InputError(
            f"{path}: content does not match the sha256 in manifest.json (changed or "
            f"damaged after prepare){again}",
            field="data.path",
        )
    try:
        arr = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        why = " ".join(str(e).split())[:120]
        raise InputError(
            f"{path}: not a readable .npy file ({why}){again}", field="data.path"
        ) from None
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InputError(
            f"{path}: expected a 1-d integer array, found {arr.dtype} {arr.shape}{again}",
            field="data.path",
        )
    return arr


def load_shard(
    folder: Path, shard: dict[str, Any], vocab_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """A shard's (tokens memory-mapped, offsets), checked: ids in ``[0, vocab_size)``,
    offsets from 0, never decreasing, ending at the token count."""
    base = folder / "shards" / shard["name"]
    sums = shard.get("sha256") or {}  # corpora prepared before checksums have none
    tok_path, off_path = Path(f"{base}.tokens.npy"), Path(f"{base}.offsets.npy")
    tokens = _load_array(tok_path, sums.get("tokens"), mmap=True)
    off = _load_array(off_path, sums.get("offsets"), mmap=False).astype(np.int64, copy=False)
    if len(off) == 0 or off[0] != 0 or off[-1] != len(tokens) or bool((np.diff(off) < 0).any()):
        raise InputError(
            f"{off_path}: sentence offsets must start at 0, never decrease and end at the "
            f"token count {len(tokens)}; run `elmo-pretrain prepare` again",
            field="data.path",
        )
    if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise InputError(
            f"{tok_path}: token ids from {int(tokens.min())} to {int(tokens.max())}, outside the "
            f"vocabulary's 0..{vocab_size - 1}; run `elmo-pretrain prepare` again",
            field="data.path",
        )
    return tokens, off


class Split:
    """One split's sentences across its shards, memory-mapped and checked at load."""

    def __init__(self, folder: Path, shards: list[dict[str, Any]], vocab_size: int) -> None:
        loaded = [load_shard(folder, s, vocab_size) for s in shards]
        self.tokens = [t for t, _ in loaded]
        starts, lens, shard = [], [], []
        for k, (_, off) in enumerate(loaded):
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
        if not self.manifest["shards"]:  # an exported LM's corpus: vocabulary, no text
            raise InputError(
                f"{self.path} keeps the vocabulary but no text (an exported LM's corpus): "
                "give --file FILE to score",
                field="file",
            )
        if name not in self.manifest["shards"]:
            raise InputError(
                f"unknown split {name!r}; have {sorted(self.manifest['shards'])}", field="split"
            )
        if name not in self._splits:
            self._splits[name] = Split(self.path, self.manifest["shards"][name], len(self.vocab))
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
        from elmo_pretrain.prepare import PrepareOptions, _word_split
        from elmo_pretrain.text import clean

        opts = self.manifest.get("options", {})
        lower = bool(opts.get("lowercase"))
        if not Path(path).is_file():
            raise InputError(f"{path}: not a file (missing, or a folder)", field="file")
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


# ---------------------------------------------------------------- stream mode


def sentence_stream(
    split: Split, bos: int, eos: int, order: np.ndarray | None = None
) -> np.ndarray:
    """The split as one token stream ``<S> s1 </S> <S> s2 </S> ...`` (int32), in ``order``."""
    idx = np.arange(len(split)) if order is None else order
    lens = split.lens[idx].astype(np.int64)
    out = np.empty(int(lens.sum()) + 2 * len(idx), dtype=np.int32)
    starts = np.concatenate([[0], np.cumsum(lens + 2)[:-1]]).astype(np.int64)
    out[starts] = bos
    out[starts + lens + 1] = eos
    for k, shard in enumerate(split.tokens):
        sel = np.nonzero(split.shard[idx] == k)[0]
        if len(sel) == 0:
            continue
        # source and destination positions of every token of these sentences
        n = lens[sel]
        rep = np.repeat(np.arange(len(sel)), n)
        within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        src = split.starts[idx[sel]][rep] + within
        dst = starts[sel][rep] + 1 + within
        out[dst] = np.asarray(shard)[src]
    return out


@dataclass
class StreamWindow:
    """One direction's window: ``ids``/``targets``/``mask``/``inverse`` ``[B, U]``;
    ``keep [B, U]`` (0: reset the state before that step) or None; ``n_pred`` predictions."""

    ids: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    inverse: torch.Tensor
    keep: torch.Tensor | None
    n_pred: int


@dataclass
class StreamBatch:
    """One step of stream training: a window per direction, CNN inputs shared (``uniq``)."""

    windows: dict[str, StreamWindow]
    uniq: torch.Tensor
    n_tokens: int


def make_stream_batch(
    rows: dict[str, np.ndarray],
    corpus: Corpus,
    keep: dict[str, np.ndarray | None],
) -> StreamBatch:
    """``rows[d] [B, U + 1]``: each direction's tokens in reading order (one extra for targets)."""
    start = {"forward": corpus.bos_id, "backward": corpus.eos_id}  # a sentence starts here
    end = {"forward": corpus.eos_id, "backward": corpus.bos_id}
    inputs = {d: r[:, :-1] for d, r in rows.items()}
    uniq, inverse = np.unique(
        np.concatenate([x.ravel() for x in inputs.values()]), return_inverse=True
    )
    windows, at = {}, 0
    for d, r in rows.items():
        x, y = r[:, :-1], r[:, 1:]
        mask = ~((x == end[d]) & (y == start[d]))  # one sentence's end -> the next one's start
        targets = np.where(y < corpus.softmax_size, y, corpus.unk_id)
        k = keep.get(d)
        windows[d] = StreamWindow(
            ids=torch.from_numpy(x.astype(np.int64)),
            targets=torch.from_numpy(targets.astype(np.int64)),
            mask=torch.from_numpy(mask),
            inverse=torch.from_numpy(inverse[at : at + x.size].reshape(x.shape)),
            keep=None if k is None else torch.from_numpy(k),
            n_pred=int(mask.sum()),
        )
        at += x.size
    return StreamBatch(windows=windows, uniq=torch.from_numpy(uniq), n_tokens=at // len(rows))


class StreamBatcher:
    """bilm-tf / Kim et al. order: the split's token stream cut into rows, read in windows.

    The stream (sentence order shuffled per epoch with ``[seed, epoch]`` when
    ``shuffle``) is cut into ``rows * world`` equal rows; this rank reads rows
    ``rank * rows .. (rank + 1) * rows``. Window ``i`` of the forward LM is
    columns ``[i U, (i + 1) U)`` (targets one column later); the backward LM
    reads each row reversed, window ``i`` of the reversed row. The trainer
    carries both LSTM states from window ``i`` to ``i + 1`` and zeroes them at
    an epoch's start. With ``reset_prob`` > 0 the state is also reset before
    that fraction of sentence starts (``<S>`` forward, ``</S>`` backward),
    drawn from ``[seed, epoch, index]``: a batch is a pure function of
    (seed, epoch, index), so resuming needs those integers and the state.
    """

    def __init__(
        self,
        corpus: Corpus,
        split: str,
        *,
        rows: int,
        unroll: int,
        seed: int,
        reset_prob: float = 0.0,
        shuffle: bool = True,
        directions: tuple[str, ...] = ("forward", "backward"),
        rank: int = 0,
        world: int = 1,
    ) -> None:
        self.corpus, self.data = corpus, corpus.split(split)
        self.rows, self.unroll, self.seed = rows, unroll, seed
        self.reset_prob, self.shuffle, self.directions = reset_prob, shuffle, directions
        self.rank, self.world = rank, world
        total = self.data.n_tokens + 2 * len(self.data)
        self.row_len = total // (rows * world)
        self.n_windows = (self.row_len - 1) // unroll
        if self.n_windows < 1:
            raise InputError(
                f"the {split} split has {total} tokens: too few for {rows * world} rows of "
                f"{unroll + 1}; lower data.rows or data.unroll",
                field="data.rows",
            )
        self._epoch: int | None = None
        self._rows: np.ndarray | None = None

    def __len__(self) -> int:
        return self.n_windows

    def epoch_rows(self, epoch: int) -> np.ndarray:
        """This rank's rows for ``epoch``: ``[rows, row_len]`` int32 (forward reading order)."""
        if self._epoch != epoch:
            order = None
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(len(self.data))
            stream = sentence_stream(self.data, self.corpus.bos_id, self.corpus.eos_id, order)
            n = self.rows * self.world * self.row_len
            all_rows = stream[:n].reshape(self.rows * self.world, self.row_len)
            self._rows = np.ascontiguousarray(
                all_rows[self.rank * self.rows : (self.rank + 1) * self.rows]
            )
            self._epoch = epoch
        return self._rows

    def batch(self, epoch: int, index: int) -> StreamBatch:
        data = self.epoch_rows(epoch)
        u = self.unroll
        rows, keep = {}, {}
        rng = np.random.default_rng([self.seed, epoch, index, self.rank])
        for d in self.directions:
            src = data if d == "forward" else data[:, ::-1]
            rows[d] = np.ascontiguousarray(src[:, index * u : index * u + u + 1])
            keep[d] = None
            if self.reset_prob > 0:
                start = self.corpus.bos_id if d == "forward" else self.corpus.eos_id
                reset = (rows[d][:, :-1] == start) & (rng.random((self.rows, u)) < self.reset_prob)
                keep[d] = (~reset).astype(np.float32)
        return make_stream_batch(rows, self.corpus, keep)


def stream_eval_batches(
    sentences: list[np.ndarray], corpus: Corpus, directions: tuple[str, ...], window: int = 512
):
    """The sentences as ONE stream (no resets), in windows of ``window`` tokens per direction."""
    parts = []
    for s in sentences:
        parts += [
            np.array([corpus.bos_id], np.int32),
            np.asarray(s, np.int32),
            np.array([corpus.eos_id], np.int32),
        ]
    stream = np.concatenate(parts)[None, :]
    for i in range(0, stream.shape[1] - 1, window):
        rows = {}
        for d in directions:
            src = stream if d == "forward" else stream[:, ::-1]
            rows[d] = np.ascontiguousarray(src[:, i : i + window + 1])
        yield make_stream_batch(rows, corpus, {})


def to_device(batch, device):
    """A ``Batch`` or ``StreamBatch`` with its tensors on ``device`` (the same object on CPU)."""
    if device.type == "cpu":
        return batch

    def move(obj, fields):
        return dataclasses.replace(
            obj, **{f: getattr(obj, f).to(device, non_blocking=True) for f in fields}
        )

    if isinstance(batch, StreamBatch):
        windows = {
            d: move(
                w, ("ids", "targets", "mask", "inverse") + (("keep",) if w.keep is not None else ())
            )
            for d, w in batch.windows.items()
        }
        return dataclasses.replace(batch, windows=windows, uniq=batch.uniq.to(device))
    return move(batch, ("ids", "targets", "lengths", "uniq", "inverse"))
