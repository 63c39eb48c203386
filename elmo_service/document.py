"""Document mode: a whole text as one sequence, in chunks, at constant memory.

    document --tokens--> [<S>, t_0 .. t_{T-1}, </S>] --biLM, chunk by chunk--> [L+1, T, D]

The forward LSTMs read the whole document left to right from a zero state, the backward
LSTMs right to left from a zero state at its end; one ``<S>`` before the first token and
one ``</S>`` after the last. The answer equals one unchunked pass over the whole text
(``Embedder(max_sentence_tokens=N).embed([text])``) whatever the chunk size
(``tests/elmo_service/test_document.py``).

How (``docs/documents.md``):

1. **tokens**: the text is tokenized in segments cut at whitespace (pieces never cross
   whitespace, so the pieces are the whole text's) into compact arrays (:class:`DocTokens`:
   ~24 bytes a token, no ``Token`` objects held);
2. **pass 1**, the two directions at once (on the two direction workers, as a sentence's
   are): the forward one walks the chunks from the first, the backward one from the last,
   each handing its LSTM state ``(h, c)`` per layer from chunk to chunk (the kernel's
   ``stream``: for one document the native row loop with a state in and out, for several
   advanced together (:func:`advance`) one batched step, a row per document and
   direction; the torch kernel runs the model's own layers). Each chunk's outputs go to a spill
   (:class:`_Spill`: memory for a short document, an unlinked temporary file for a long
   one, written and read with ``pwrite``/``pread``, so none of it is in the process's RSS);
   each direction is computed once;
3. **pass 2**, in document order: a chunk's rows are read back, assembled into
   ``[L+1, n, D]`` and rendered by the one output module (``elmo_service/outputs.py``). A
   layer-normed mix uses the whole document's statistics (summed in pass 1); pooling is
   over the whole document (its one answer comes last).

Memory: the chunk buffers, the token arrays and the state; disk: ``4 (2L+1) P`` bytes a
token, freed when the generator ends.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from elmo_service.errors import InputError, LimitError
from elmo_service.outputs import OutputSpec, pool, positions, render
from elmo_service.values import Token, check_document, check_text

DEFAULT_CHUNK_TOKENS = 1024
# documents advanced together by :func:`advance_all` (embed-file, embed-bulk): a row each per
# step, and a step's matmuls are tall only with many (64 ran at sentence mode's speed on the
# bundled model; docs/documents.md)
DOCUMENTS_AT_ONCE = 64
# a "word" (a run without whitespace) longer than this is refused: no text has one, and a
# megabyte of one would be tokenized as a single segment
MAX_WORD_CHARS = 1000
# characters per tokenizer call (cut at whitespace); bounds the transient Token objects
SEGMENT_CHARS = 1 << 16
# a spill up to this size stays in memory
SPILL_IN_MEMORY_BYTES = 8 << 20

_LONG_WORD = re.compile(rf"\S{{{MAX_WORD_CHARS + 1}}}")


# ------------------------------------------------------------------ tokens


@dataclass
class DocTokens:
    """A document's tokens as arrays: ``texts[ids[i]]`` is token i's piece (what the model
    reads), ``shown[ids[i]]`` its text (``Token``; None: the pieces)."""

    texts: list[str]
    ids: np.ndarray  # [T] int32
    start: np.ndarray  # [T] int64
    end: np.ndarray  # [T] int64
    word: np.ndarray  # [T] int64
    text: str  # the document's text (pre-tokenized words: joined by single spaces)
    shown: list[str] | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def tokens(self, lo: int, hi: int) -> list[Token]:
        p, t = self.texts, self.shown or self.texts
        cols = (self.ids[lo:hi], self.start[lo:hi], self.end[lo:hi], self.word[lo:hi])
        return [
            Token(t[i], s, e, w, p[i])
            for i, s, e, w in zip(*(c.tolist() for c in cols), strict=True)
        ]

    def keys(self, lo: int, hi: int) -> list[str]:
        t = self.texts
        return [t[i] for i in self.ids[lo:hi]]

    def word_end(self, hi: int) -> int:
        """The first token at or after ``hi`` that starts a word (so a cut there splits none)."""
        n = len(self.ids)
        while 0 < hi < n and self.word[hi] == self.word[hi - 1]:
            hi += 1
        return hi


class _TokenArrays:
    def __init__(self) -> None:
        self.index: dict[tuple[str, str], int] = {}  # (text, piece) -> id
        self.ids: list[np.ndarray] = []
        self.cols: list[np.ndarray] = []

    def add(self, toks: list[Token], offset: int, word_base: int) -> int:
        """Append ``toks`` (offsets shifted); the next word index."""
        if not toks:
            return word_base
        idx = self.index
        self.ids.append(
            np.fromiter(
                (idx.setdefault((t.text, t.piece), len(idx)) for t in toks), np.int32, len(toks)
            )
        )
        cols = np.array([(t.start, t.end, t.word) for t in toks], dtype=np.int64)
        cols[:, :2] += offset
        cols[:, 2] += word_base - cols[0, 2]
        self.cols.append(cols)
        return int(cols[-1, 2]) + 1

    def done(self, text: str) -> DocTokens:
        cols = np.concatenate(self.cols) if self.cols else np.zeros((0, 3), np.int64)
        ids = np.concatenate(self.ids) if self.ids else np.zeros(0, np.int32)
        pieces = [piece for _, piece in self.index]
        shown = [shown for shown, _ in self.index]
        return DocTokens(pieces, ids, cols[:, 0], cols[:, 1], cols[:, 2], text, shown)


def _segments(text: str, size: int) -> Iterator[tuple[int, str]]:
    """``(offset, piece)`` cut at whitespace, each about ``size`` characters."""
    lo, n = 0, len(text)
    while lo < n:
        hi = min(lo + size, n)
        if hi < n:
            cut = hi
            while cut > lo and not text[cut].isspace():
                cut -= 1
            hi = cut if cut > lo else hi  # no whitespace: the word check already refused it
        yield lo, text[lo:hi]
        lo = hi


def tokenize_document(
    tokenizer, document: str | Sequence[str], *, field: str = "document", max_tokens: int | None
) -> DocTokens:
    """The document's tokens, or an error naming ``field``: not text or words, empty,
    a word over :data:`MAX_WORD_CHARS`, more than ``max_tokens`` tokens."""
    if isinstance(document, str):
        text = check_text(document, field)
        words = None
    elif isinstance(document, Sequence) and all(isinstance(w, str) for w in document):
        words = list(document)
        check_document(words, field)
        for j, w in enumerate(words):
            if not w.strip():
                raise InputError(
                    f"{field}[{j}] is empty or only whitespace: a word needs a character to embed",
                    field=f"{field}[{j}]",
                )
        text = " ".join(words)
    else:
        raise InputError(f"{field} must be a string or a list of strings", field=field)
    if not text.strip():
        raise InputError(f"{field} is empty: a document needs a character to embed", field=field)
    m = _LONG_WORD.search(text)
    if m is not None:
        run = len(re.match(r"\S*", text[m.start() :]).group(0))
        raise InputError(
            f"{field} has a word of {run:,} characters at character {m.start():,}; "
            f"the limit is {MAX_WORD_CHARS:,}",
            field=field,
        )
    acc = _TokenArrays()
    word = 0
    n_tokens = 0
    if words is None:
        for offset, seg in _segments(text, SEGMENT_CHARS):
            toks = tokenizer.tokenize(seg)
            word = acc.add(toks, offset, word)
            n_tokens += len(toks)
            _check_count(n_tokens, max_tokens, field)
    else:
        offset = 0
        for lo in range(0, len(words), 4096):
            part = words[lo : lo + 4096]
            toks = tokenizer.tokenize_words(part)
            kept = {t.word for t in toks}
            for j in range(len(part)):
                if j not in kept:
                    raise InputError(
                        f"{field}[{lo + j}] ({part[j]!r}) has no character the tokenizer keeps",
                        field=f"{field}[{lo + j}]",
                    )
            acc.add(toks, offset, word)
            word += len(part)
            offset += sum(len(w) + 1 for w in part)
            n_tokens += len(toks)
            _check_count(n_tokens, max_tokens, field)
    doc = acc.done(text)
    if len(doc) == 0:
        raise InputError(f"{field} has no character the tokenizer keeps", field=field)
    return doc


def _check_count(n: int, limit: int | None, field: str) -> None:
    if limit is not None and n > limit:
        raise LimitError(
            f"{field} has more than {limit:,} tokens (the document limit)", field=field
        )


# ------------------------------------------------------------------ spill


class _Spill:
    """``rows x width`` float32, written and read by row ranges: in memory when small,
    else an unlinked temporary file (page cache, not this process's memory)."""

    def __init__(self, rows: int, width: int, directory: str | None = None) -> None:
        self.width = width
        self.row_bytes = width * 4
        self.mem: np.ndarray | None = None
        self.fd: int | None = None
        self.written = 0
        if rows * self.row_bytes <= SPILL_IN_MEMORY_BYTES:
            self.mem = np.empty((rows, width), np.float32)
        else:
            f = tempfile.TemporaryFile(prefix="elmo-document-", dir=directory)  # noqa: SIM115 - closed in close()
            self._file = f  # unlinked already; closed (and its space freed) in close()
            self.fd = f.fileno()

    def write(self, lo: int, x: np.ndarray) -> None:
        if self.mem is not None:
            self.mem[lo : lo + len(x)] = x
            return
        data = np.ascontiguousarray(x, np.float32).data.cast("B")
        at, done = lo * self.row_bytes, 0
        self.written = max(self.written, at + len(data))
        while done < len(data):
            done += os.pwrite(self.fd, data[done:], at + done)

    def read(self, lo: int, hi: int) -> np.ndarray:
        if self.mem is not None:
            return self.mem[lo:hi]
        out = np.empty((hi - lo, self.width), np.float32)
        buf = memoryview(out).cast("B")
        at, done = lo * self.row_bytes, 0
        while done < len(buf):
            got = os.preadv(self.fd, [buf[done:]], at + done)
            if got == 0:
                raise OSError("document spill file ended early")
            done += got
        return out

    @property
    def nbytes(self) -> int:
        """Bytes held: the array in memory, or the file's written extent."""
        if self.mem is not None:
            return self.mem.nbytes
        return self.written if self.fd is not None else 0

    def close(self) -> None:
        self.mem = None
        if self.fd is not None:
            self._file.close()
            self.fd = None


# ------------------------------------------------------------------ the passes


class _Stats:
    """Per output layer: the sum and the sum of squares over the document's token
    positions (markers excluded) and features, float64 (a layer-normed mix's statistics)."""

    def __init__(self, n_layers: int) -> None:
        self.s1 = np.zeros(n_layers)
        self.s2 = np.zeros(n_layers)

    def add(self, layer: int, x: np.ndarray, times: int = 1) -> None:
        x64 = x.astype(np.float64)
        self.s1[layer] += times * x64.sum()
        self.s2[layer] += times * np.square(x64).sum()


def _normalized(layers: np.ndarray, stats: _Stats, count: int, eps: float = 1e-12) -> np.ndarray:
    """``layers [L+1, n, D]`` layer-normed with the whole document's statistics (as
    ``scalar_mix``'s layer norm normalises one sentence over all its positions)."""
    mean = stats.s1 / count
    var = np.maximum(stats.s2 / count - mean * mean, 0.0)
    out = (layers - mean[:, None, None]) / np.sqrt(var + eps)[:, None, None]
    return out.astype(np.float32)


@dataclass
class DocumentChunk:
    """One chunk of a document's answer: its positions (tokens, or words), and the outputs
    ``render`` gives for them (pooled: the whole document's, in the last chunk)."""

    index: int
    tokens: list[Token]
    layers: np.ndarray | None
    mix: np.ndarray | None


class DocumentCancelled(Exception):
    """The caller stopped wanting the answer (``cancelled()`` said so between two rounds)."""


class DocumentRun:
    """One document's two passes, steppable: :func:`advance` computes pass 1 a round at a
    time (several documents' rounds in one batched step), :meth:`answer` is pass 2.

    A round is a chunk of each direction: the forward one from the document's start, the
    backward one from its end, each from the state the previous round left. Each round's
    rows go to the spills as the next round computes (so the last round's are written
    when :attr:`done` turns true).
    """

    def __init__(
        self,
        embedder,
        doc: DocTokens,
        spec: OutputSpec,
        chunk_tokens: int | None = None,
        *,
        spill_dir: str | None = None,
        round_tokens: int | None = None,
    ) -> None:
        chunk = DEFAULT_CHUNK_TOKENS if chunk_tokens is None else int(chunk_tokens)
        if chunk < 1:
            raise InputError("chunk_tokens must be >= 1", field="chunk_tokens")
        # a round (pass 1's unit) may be shorter than an answer chunk: the rows of more
        # documents fit one step's buffers (rows x round), and the vectors are the same
        step = chunk if round_tokens is None else min(int(round_tokens), chunk)
        if step < 1:
            raise ValueError("round_tokens must be >= 1")
        if spec.pending is not None:
            raise ValueError(f"output spec has task {spec.pending!r} still to look up")
        self.embedder, self.doc, self.spec, self.chunk = embedder, doc, spec, chunk
        self._p = embedder.cfg.projection_dim
        self._n_out = embedder.n_layers  # L + 1
        n_seq = len(doc) + 2  # <S> tokens </S>
        self._n_seq = n_seq
        self._norm = spec.mix is not None and spec.mix.layer_norm
        self._stats = _Stats(self._n_out) if self._norm else None
        self.round_tokens = step
        starts = list(range(0, n_seq, step))
        # (forward chunk, backward chunk): the backward direction walks from the end
        self._rounds = [
            ((lo, min(lo + step, n_seq)), (b, min(b + step, n_seq)))
            for lo, b in zip(starts, reversed(starts), strict=True)
        ]
        self._spills: tuple[_Spill, _Spill] | None = (
            _Spill(n_seq, self._n_out * self._p, spill_dir),
            _Spill(n_seq, (self._n_out - 1) * self._p, spill_dir),
        )
        self._k = 0  # the next round to compute
        self._state = None  # the kernel's carried state (created on the first round)
        self._x: tuple[Tensor, Tensor] | None = None  # round k's inputs, prepared
        self._pending: tuple | None = None  # a computed round whose rows are not written yet
        self._next: tuple[Tensor, Tensor] | None = None  # round k + 1's, prepared meanwhile

    @property
    def rounds(self) -> int:
        return len(self._rounds)

    @property
    def tokens(self) -> int:
        return len(self.doc)

    @property
    def done(self) -> bool:
        """Pass 1 finished: every round computed and written."""
        return self._k == len(self._rounds) and self._pending is None

    @property
    def spill_bytes(self) -> int:
        return 0 if self._spills is None else sum(s.nbytes for s in self._spills)

    def close(self) -> None:
        """Free the spills (idempotent; from any thread once no :func:`advance` runs it)."""
        spills, self._spills = self._spills, None
        if spills is not None:
            for s in spills:
                s.close()

    # -- pass 1, driven by advance() ------------------------------------------------
    def _vectors(self, lo: int, hi: int) -> tuple[Tensor, Tensor]:
        """Token vectors of sequence positions ``[lo, hi)`` (markers at 0 and n_seq - 1),
        in reading order and reversed: rows of a small table (the markers, then the
        chunk's distinct tokens), picked without torch's threads on the CPU."""
        doc, runner, n_seq = self.doc, self.embedder.runner, self._n_seq
        t_lo, t_hi = max(lo - 1, 0), min(hi - 1, len(doc))
        uniq, inverse = np.unique(doc.ids[t_lo:t_hi], return_inverse=True)
        table = runner.token_vectors([doc.texts[i] for i in uniq.tolist()])
        markers = runner.marker_vectors()
        idx = inverse.reshape(-1).astype(np.int64) + 2
        if lo == 0:
            idx = np.concatenate([[0], idx])
        if hi == n_seq:
            idx = np.concatenate([idx, [1]])
        if table.device.type == "cpu" and table.dtype == torch.float32:
            # numpy: a torch op here would wake torch's thread team between rounds
            t = np.concatenate([markers.numpy(), table.numpy()])
            return torch.from_numpy(t[idx]), torch.from_numpy(t[idx[::-1]].copy())
        table = torch.cat([markers, table])
        i = torch.from_numpy(idx).to(table.device)
        return table[i], table[i.flip(0)]

    def _prepare(self, k: int) -> tuple[Tensor, Tensor] | None:
        if k >= len(self._rounds):
            return None
        (f_lo, f_hi), (b_lo, b_hi) = self._rounds[k]
        return self._vectors(f_lo, f_hi)[0], self._vectors(b_lo, b_hi)[1]

    def _token_rows(self, lo: int, hi: int) -> slice:
        """The rows of a chunk ``[lo, hi)`` that are tokens (not the markers)."""
        return slice(1 if lo == 0 else 0, (hi - lo) - (1 if hi == self._n_seq else 0))

    def _flush(self) -> None:
        """The pending round's outputs into the spills (and the layer norm's sums)."""
        if self._pending is None:
            return
        k, x, out = self._pending
        self._pending = None
        (f_lo, f_hi), (b_lo, b_hi) = self._rounds[k]
        ef = x[0].float().cpu().numpy()
        fo = [y.float().cpu().numpy() for y in out[0]]
        bo = [y.float().cpu().numpy()[::-1] for y in out[1]]
        assert self._spills is not None, "the run was closed"
        self._spills[0].write(f_lo, np.concatenate([ef, *fo], axis=1))
        self._spills[1].write(b_lo, np.concatenate(bo, axis=1))
        if self._stats is not None:
            rf, rb = self._token_rows(f_lo, f_hi), self._token_rows(b_lo, b_hi)
            self._stats.add(0, ef[rf], times=2)  # layer 0 is [e ; e]
            for i, (f, b) in enumerate(zip(fo, bo, strict=True), start=1):
                self._stats.add(i, f[rf])
                self._stats.add(i, b[rb])

    def _start_round(self) -> tuple[tuple[Tensor, Tensor], object]:
        if self._spills is None:
            raise ValueError("the document run was closed")
        if self._k >= len(self._rounds):
            raise ValueError("the document run has no round left (pass 1 is done)")
        if self._state is None:
            self._state = self.embedder.runner.stream_state()
        if self._x is None:
            self._x = self._prepare(self._k)
        return self._x, self._state

    def _meanwhile(self) -> None:
        """While the kernel computes round k: round k + 1's inputs, round k - 1's rows."""
        self._next = self._prepare(self._k + 1)
        self._flush()

    def _end_round(self, out) -> None:
        self._pending = (self._k, self._x, out)
        self._k += 1
        self._x, self._next = self._next, None
        if self._k == len(self._rounds):
            self._flush()

    # -- pass 2 ------------------------------------------------------------------
    def answer(self) -> Iterator[DocumentChunk]:
        """The answer, chunk by chunk in document order (pass 1 must be done)."""
        if not self.done:
            raise ValueError("the document's first pass is not done")
        if self._spills is None:
            raise ValueError("the document run was closed")
        doc, spec, chunk, p, n_out = self.doc, self.spec, self.chunk, self._p, self._n_out
        spills, stats, norm = self._spills, self._stats, self._norm
        if norm:  # normalised here, with the document's statistics; the mix then has none
            spec = replace(spec, mix=replace(spec.mix, layer_norm=False))
        pooled = spec.pooling != "none"
        each = replace(spec, pooling="none")
        acc: list = [None, None]
        n_pos = 0
        lo, k = 0, 0
        while lo < len(doc):
            hi = min(lo + chunk, len(doc))
            if spec.granularity == "word":
                hi = doc.word_end(hi)
            f = spills[0].read(lo + 1, hi + 1).reshape(hi - lo, n_out, p)
            b = spills[1].read(lo + 1, hi + 1).reshape(hi - lo, n_out - 1, p)
            layers = np.empty((n_out, hi - lo, 2 * p), np.float32)
            layers[0, :, :p] = layers[0, :, p:] = f[:, 0]
            layers[1:, :, :p] = f[:, 1:].transpose(1, 0, 2)
            layers[1:, :, p:] = b.transpose(1, 0, 2)
            mix_in = _normalized(layers, stats, len(doc) * 2 * p) if norm else layers
            toks = doc.tokens(lo, hi)
            x, _ = render(layers, toks, replace(each, mix=None)) if each.layers else (None, None)
            _, m = render(mix_in, toks, replace(each, layers=None)) if each.mix else (None, None)
            pos = positions(toks, spec, doc.text)
            if not pooled:
                yield DocumentChunk(k, pos, x, m)
                k += 1
            else:
                for i, v in enumerate((x, m)):
                    if v is not None:
                        acc[i] = _pool_add(acc[i], v, spec.pooling, 1 if i == 0 else 0)
                n_pos += len(pos)
            lo = hi
        if pooled:
            out = [None if a is None else _pool_done(a, spec.pooling, n_pos) for a in acc]
            yield DocumentChunk(0, [], out[0], out[1])


def advance(runs: Sequence[DocumentRun]) -> None:
    """One round of each run (none done, all of one embedder), computed together: a row
    per document and direction, in one batched step (one document alone: the native row
    loop), under the embedder's one model lock."""
    runs = list(runs)
    if not runs:
        return
    emb = runs[0].embedder
    if any(r.embedder is not emb for r in runs):
        raise ValueError("documents advanced together must share one embedder")
    if len({id(r) for r in runs}) != len(runs):
        raise ValueError("a document run appears twice in one round")
    runner = emb.runner
    with runner.session():
        started = [r._start_round() for r in runs]

        def meanwhile() -> None:
            for r in runs:
                r._meanwhile()

        outs = runner.stream([s[0] for s in started], [s[1] for s in started], meanwhile)
        for r, out in zip(runs, outs, strict=True):
            r._end_round(out)


def check_at_once(n: int | None) -> None:
    """``documents_at_once`` (None: the default) is a count of at least one."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise InputError("documents_at_once must be an integer >= 1", field="documents_at_once")


def advance_all(
    runs: Iterable[DocumentRun], at_once: int = DOCUMENTS_AT_ONCE, *, in_order: bool = False
) -> Iterator[tuple[int, DocumentRun]]:
    """Pass 1 of many documents: up to ``at_once`` runs (taken from ``runs`` as room frees
    up) advance together, a row each in one batched step. Yields ``(i, run)`` as run ``i``
    (its place in ``runs``) finishes pass 1 -- or, ``in_order``, in ``runs``' order, a run
    done early waiting its turn (it keeps its place among the ``at_once``) -- for the
    caller to read its :meth:`~DocumentRun.answer`; the run is closed when the caller asks
    for the next one (or stops)."""
    check_at_once(at_once)
    source = enumerate(runs)
    live: dict[int, DocumentRun] = {}  # started, not yet yielded (in order of start)
    turn = 0  # in_order: the next index to yield
    try:
        while True:
            while len(live) < at_once and (nxt := next(source, None)) is not None:
                live[nxt[0]] = nxt[1]
            if not live:
                return
            active = [run for run in live.values() if not run.done]
            if active:
                advance(active)
            if in_order:
                ready = []
                while turn in live and live[turn].done:
                    ready.append(turn)
                    turn += 1
            else:
                ready = [i for i, run in live.items() if run.done]
            for i in ready:
                run = live.pop(i)
                try:
                    yield i, run
                finally:
                    run.close()
    finally:
        for run in live.values():
            run.close()


def embed_document_chunks(
    embedder,
    doc: DocTokens,
    spec: OutputSpec,
    chunk_tokens: int | None = None,
    *,
    spill_dir: str | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> Iterator[DocumentChunk]:
    """A tokenized document's answer, chunk by chunk in document order (see the module):
    a :class:`DocumentRun` advanced alone until done, then its answer. ``cancelled``:
    asked between rounds of pass 1 (and chunks of pass 2); True stops the work with
    :class:`DocumentCancelled` and frees the spills."""
    run = DocumentRun(embedder, doc, spec, chunk_tokens, spill_dir=spill_dir)
    try:
        while not run.done:
            # a caller that left stops the work within one round
            if cancelled is not None and cancelled():
                raise DocumentCancelled
            advance([run])
        for c in run.answer():
            if cancelled is not None and cancelled():
                raise DocumentCancelled
            yield c
    finally:
        run.close()


def _pool_add(acc, v: np.ndarray, how: str, axis: int):
    if how == "mean":
        s = v.sum(axis=axis, dtype=np.float64)
        return s if acc is None else acc + s
    m = pool(v, "max", axis)
    return m if acc is None else np.maximum(acc, m)


def _pool_done(acc, how: str, n: int) -> np.ndarray:
    if how == "mean":
        return (acc / max(n, 1)).astype(np.float32)
    return acc
