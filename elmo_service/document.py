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
   each handing its LSTM state ``(h, c)`` per layer from chunk to chunk
   (:class:`_NativeStream`: the native row loop with a state in and out; :class:`_TorchStream`:
   the model's own layers, any device). Each chunk's outputs go to a spill
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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from elmo_service.errors import InputError, LimitError
from elmo_service.outputs import OutputSpec, pool, positions, render
from elmo_service.tokenizers import Token

DEFAULT_CHUNK_TOKENS = 1024
# a "word" (a run without whitespace) longer than this is refused: no text has one, and a
# megabyte of one would be tokenized as a single segment
MAX_WORD_CHARS = 1000
# characters per tokenizer call (cut at whitespace); bounds the transient Token objects
SEGMENT_CHARS = 1 << 16
# input-gate rows computed at once by the native stream (bounds its buffer, not the speed)
GATE_ROWS = 128
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
        text = document
        words = None
    elif isinstance(document, Sequence) and all(isinstance(w, str) for w in document):
        words = list(document)
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

    def close(self) -> None:
        self.mem = None
        if self.fd is not None:
            self._file.close()
            self.fd = None


# ------------------------------------------------------------------ the streams


class _NativeStream:
    """One direction's layers through the CPU kernel (``kernels/bilstm.py``
    ``ScaledLayer``), its state carried from call to call (kernel layout: doubled cell)."""

    def __init__(self, kernel, d: int) -> None:
        self.layers = [pair[d] for pair in kernel.layers]
        self.residual = kernel.residual
        self.state = [
            (torch.zeros(1, sl.w_proj.n), torch.zeros(1, sl.w_proj.k)) for sl in self.layers
        ]

    def run(self, x: Tensor) -> list[Tensor]:
        """``x [n, P]`` in this direction's reading order -> each layer's ``[n, P]``."""
        outs = []
        for i, sl in enumerate(self.layers):
            y = x.new_empty(x.shape[0], self.state[i][0].shape[1])
            # the input gates a block of steps at a time: [GATE_ROWS, 4C] (2 MB for a
            # 1024-cell layer) whatever the chunk; a chunk's [n, 4C] at once, allocated on
            # each worker per chunk, was kept by the allocator and grew the RSS by 16 MB steps
            for lo in range(0, x.shape[0], GATE_ROWS):
                hi = min(lo + GATE_ROWS, x.shape[0])
                xg = sl.w_ih(x[lo:hi])
                h, c2 = self.state[i]
                if sl.row is not None:  # the native loop, from the carried state (fp32)
                    sl.run_row_from(xg, y[lo:hi], h[0], c2[0])
                else:  # int8 weights: the batched step at one row
                    for s in range(hi - lo):
                        h = sl.step(xg[s : s + 1], h, c2)
                        y[lo + s] = h[0]
                    self.state[i] = (h, c2)
            if self.residual and i > 0:
                y.add_(x)
            outs.append(y)
            x = y
        return outs


class _TorchStream:
    """One direction through the model's own layers (any device, dtype, compile)."""

    def __init__(self, model, direction: str) -> None:
        self.model, self.direction, self.state = model, direction, None

    def run(self, x: Tensor) -> list[Tensor]:
        outs, self.state = self.model.run_direction(self.direction, x[None], self.state)
        return [o[0] for o in outs]


def _streams(embedder):
    kernel = embedder.kernel
    bilstm = getattr(kernel, "_bilstm", None)
    if bilstm is not None:  # CpuBiLM
        k = bilstm()
        return _NativeStream(k, 0), _NativeStream(k, 1), True
    model = embedder.model
    return _TorchStream(model, "forward"), _TorchStream(model, "backward"), False


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


def _contextualize(embedder, doc: DocTokens, chunk: int, spills, stats) -> None:
    """Pass 1: both directions over the whole document, chunk by chunk, into the spills
    (forward rows ``[e, f_1 .. f_L]``, backward rows ``[b_1 .. b_L]``, by sequence position)."""
    from elmo_service.bilm.kernels.bilstm import direction_pool

    n_seq = len(doc) + 2  # <S> tokens </S>
    starts = list(range(0, n_seq, chunk))
    fwd, bwd, native = _streams(embedder)
    pool = direction_pool() if native else None
    fwd_spill, bwd_spill = spills

    def vectors(lo: int, hi: int) -> tuple[Tensor, Tensor]:
        """Token vectors of sequence positions ``[lo, hi)`` (markers at 0 and n_seq - 1),
        in reading order and reversed: rows of a small table (the markers, then the
        chunk's distinct tokens), picked without torch's threads on the CPU."""
        t_lo, t_hi = max(lo - 1, 0), min(hi - 1, len(doc))
        ids = doc.ids[t_lo:t_hi]
        uniq, inverse = np.unique(ids, return_inverse=True)
        table = embedder._token_vectors([doc.texts[i] for i in uniq.tolist()])
        markers = embedder._marker_vectors()
        idx = inverse.reshape(-1).astype(np.int64) + 2
        if lo == 0:
            idx = np.concatenate([[0], idx])
        if hi == n_seq:
            idx = np.concatenate([idx, [1]])
        if table.device.type == "cpu" and table.dtype == torch.float32:
            # numpy: a torch op here would wake torch's thread team between chunks
            t = np.concatenate([markers.numpy(), table.numpy()])
            return torch.from_numpy(t[idx]), torch.from_numpy(t[idx[::-1]].copy())
        table = torch.cat([markers, table])
        i = torch.from_numpy(idx).to(table.device)
        return table[i], table[i.flip(0)]

    def token_rows(lo: int, hi: int) -> slice:
        """The rows of a chunk ``[lo, hi)`` that are tokens (not the markers)."""
        return slice(1 if lo == 0 else 0, (hi - lo) - (1 if hi == n_seq else 0))

    streams = (fwd, bwd)
    rounds = [  # (forward chunk, backward chunk): the backward direction walks from the end
        ((lo, min(lo + chunk, n_seq)), (b, min(b + chunk, n_seq)))
        for lo, b in zip(starts, reversed(starts), strict=True)
    ]

    def prepare(k: int):
        if k >= len(rounds):
            return None
        (f_lo, f_hi), (b_lo, b_hi) = rounds[k]
        return vectors(f_lo, f_hi)[0], vectors(b_lo, b_hi)[1]

    def run(d: int, x, out: list) -> None:
        with torch.inference_mode(), torch.no_grad():  # both thread-local: set on the worker
            out[d] = streams[d].run(x[d])

    def finish(k: int, x, out: list) -> None:
        """A round's outputs into the spills (and the layer norm's sums)."""
        (f_lo, f_hi), (b_lo, b_hi) = rounds[k]
        ef = x[0].float().cpu().numpy()
        fo = [y.float().cpu().numpy() for y in out[0]]
        bo = [y.float().cpu().numpy()[::-1] for y in out[1]]
        fwd_spill.write(f_lo, np.concatenate([ef, *fo], axis=1))
        bwd_spill.write(b_lo, np.concatenate(bo, axis=1))
        if stats is not None:
            rf, rb = token_rows(f_lo, f_hi), token_rows(b_lo, b_hi)
            stats.add(0, ef[rf], times=2)  # layer 0 is [e ; e]
            for i, (f, b) in enumerate(zip(fo, bo, strict=True), start=1):
                stats.add(i, f[rf])
                stats.add(i, b[rb])

    from elmo_service.runtime import autocast

    with torch.inference_mode(), autocast(embedder.device, embedder.precision):
        with embedder._lock:
            x = prepare(0)
        pending = None
        for k in range(len(rounds)):
            out: list = [None, None]
            # under the embedder's lock, as a batch is (a server's sentence requests run
            # between two rounds); while the two workers run round k, this thread gets
            # round k + 1's vectors and writes round k - 1's rows
            with embedder._lock:
                if pool is not None:
                    futures = [pool.submit(run, d, x, out) for d in (0, 1)]
                    nxt = prepare(k + 1)
                    if pending is not None:
                        finish(*pending)
                    for f in futures:
                        f.result()
                else:
                    run(0, x, out)
                    run(1, x, out)
                    nxt = prepare(k + 1)
                    if pending is not None:
                        finish(*pending)
            pending = (k, x, out)
            x = nxt
        finish(*pending)


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


def embed_document_chunks(
    embedder,
    doc: DocTokens,
    spec: OutputSpec,
    chunk_tokens: int | None = None,
    *,
    spill_dir: str | None = None,
) -> Iterator[DocumentChunk]:
    """A tokenized document's answer, chunk by chunk in document order (see the module)."""
    chunk = DEFAULT_CHUNK_TOKENS if chunk_tokens is None else int(chunk_tokens)
    if chunk < 1:
        raise InputError("chunk_tokens must be >= 1", field="chunk_tokens")
    if spec.pending is not None:
        raise ValueError(f"output spec has task {spec.pending!r} still to look up")
    p = embedder.cfg.projection_dim
    n_out = embedder.n_layers  # L + 1
    n_seq = len(doc) + 2
    norm = spec.mix is not None and spec.mix.layer_norm
    stats = _Stats(n_out) if norm else None
    spills = (_Spill(n_seq, n_out * p, spill_dir), _Spill(n_seq, (n_out - 1) * p, spill_dir))
    try:
        _contextualize(embedder, doc, chunk, spills, stats)
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
                        axis = 1 if i == 0 else 0
                        acc[i] = _pool_add(acc[i], v, spec.pooling, axis)
                n_pos += len(pos)
            lo = hi
        if pooled:
            out = [None if a is None else _pool_done(a, spec.pooling, n_pos) for a in acc]
            yield DocumentChunk(0, [], out[0], out[1])
    finally:
        for s in spills:
            s.close()


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
