"""One shard's work and its check: read its lines, tokenize, embed, write
``part-NNNNN.parquet`` atomically, then its ``_manifests/part-NNNNN.json`` (rows, sha256);
and ``verify_shard``, which says whether a shard already written can be kept.

Runs in a Ray actor (``cluster.py``) or, for tests and the bench, in any process with a
loaded ``Embedder``. ``pyarrow`` is the ``bulk`` extra, imported when a shard is written.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from elmo_bulk.plan import (
    MANIFESTS,
    METADATA_KEY,
    BulkOptions,
    Shard,
    layout,
    read_shard_lines,
)
from elmo_service.atomic import atomic_path, sha256_file, write_json
from elmo_service.errors import ConfigError, InputError, at_line


def pyarrow() -> tuple[Any, Any]:
    """``(pyarrow, pyarrow.parquet)``, or a ConfigError saying how to install them."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ConfigError(
            "embed-bulk needs pyarrow: pip install 'elmo-service[bulk]'", field="embed-bulk"
        ) from e
    return pa, pq


def output_of(n_layers: int, spec: Any | None, granularity: str, pooling: str) -> Any:
    """The ``elmo_service/outputs.py`` spec of a run's vectors: all layers, or the mix."""
    from elmo_service.outputs import plan_output

    out = plan_output(
        n_layers,
        output="layers" if spec is None else "mix",
        granularity=granularity,
        pooling=pooling,
    )
    return out if spec is None else out.using(spec, None)


def sentence_vectors(
    layers: np.ndarray, tokens: Sequence[Any], text: str | None, out: Any
) -> tuple[list[str], np.ndarray]:
    """bulk's one embedding-to-answer call: ``[L+1, T, D]`` -> (position texts,
    ``[K, P, D]``, pooled ``[K, D]``; K = L+1 layers or 1 mix), by
    ``elmo_service/outputs.py`` (every surface's one order: mix, words, pooling)."""
    from elmo_service.outputs import positions, render

    x, m = render(layers, tokens, out)
    return [t.text for t in positions(tokens, out, text)], x if m is None else m[None]


@dataclass
class ShardResult:
    shard: int
    lines: int
    rows: int
    tokens: int
    skipped: list[dict[str, Any]]
    error: str | None = None  # the first bad line when bad lines are not skipped
    started: float = 0.0  # wall clock (time.time()) around the shard's work: for throughput
    finished: float = 0.0
    worker: str = ""  # host:pid of the actor that did it
    model_fault: bool = False  # the error is the model's (non-finite output), not a line's
    write_fault: bool = False  # the error is the output folder's (full disk, read-only, ...)
    cpu_s: float = 0.0  # the process's CPU seconds over the shard (all its threads)


class _NonFinite(Exception):
    """A chunk held a non-finite value: the shard is abandoned, its file never renamed."""


class _HashingFile:
    """The file-like sink pyarrow writes the Parquet bytes to: hashed on the way, so
    the manifest's sha256 costs no second read of the file."""

    def __init__(self, f: Any) -> None:
        self.f, self.sha, self.size, self.closed = f, hashlib.sha256(), 0, False

    def write(self, data: Any) -> int:
        self.sha.update(data)
        self.f.write(data)
        self.size += len(data)
        return len(data)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.f.flush()

    def close(self) -> None:
        self.closed = True  # the caller closes the file itself


class _Writer:
    """One shard's Parquet file, a row group per chunk, encoded and written on a thread
    of its own while the model computes the next chunk (pyarrow releases the GIL)."""

    def __init__(self, pq: Any, path: Path, schema: Any) -> None:
        self._f = open(path, "wb")  # noqa: SIM115 - closed in close()
        self.sink = _HashingFile(self._f)
        # the vectors are incompressible floats: no dictionary, statistics or compression
        # for them (most of the encoding's CPU), the small columns keep pyarrow's defaults
        small = [f.name for f in schema if f.name not in ("embedding", "positions")]
        self._pq = pq.ParquetWriter(
            self.sink,
            schema,
            compression={f.name: ("snappy" if f.name in small else "none") for f in schema},
            use_dictionary=["file"],
            write_statistics=[n for n in small if n != "text"],
        )
        self._queue: queue.Queue = queue.Queue(maxsize=1)  # one chunk ahead, memory bounded
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="parquet-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._pq.write_batch(batch)
                except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
                    self._error = e

    def put(self, batch: Any) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(batch)

    def close(self) -> None:
        """Finish the file (footer), or raise what the writer met."""
        self._queue.put(None)
        self._thread.join()
        try:
            if self._error is None:
                self._pq.close()
        finally:
            self._f.close()
        if self._error is not None:
            raise self._error


def embed_shard(
    emb: Any, shard: Shard, opts: BulkOptions, out: Path, spec: Any | None, skip_bad: bool
) -> ShardResult:
    """Embed one shard with a loaded ``Embedder`` and write it (Parquet, then manifest).
    Writes nothing when a line is bad and ``skip_bad`` is off."""
    started, cpu0 = time.time(), time.process_time()
    pa, pq = pyarrow()
    ids, files, line_nos, texts, toks = [], [], [], [], []
    skipped: list[dict[str, Any]] = []
    for i, file, line, text, why in read_shard_lines(shard):
        if text is None:
            reason = f"line {line} of {file} {why}"
            skipped.append({"id": i, "file": file, "line": line, "reason": reason})
            continue
        sent = text.split() if opts.whitespace else text
        try:
            if opts.documents:  # any length: the document's own checks, not a sentence's
                t = _document_tokens(emb, sent, file, line)
            else:
                (t,) = emb.tokenize([sent], field="input", where=at_line(file, line))
            if not t and opts.documents:  # an empty sentence is an empty row; a document, no
                raise InputError(
                    f"line {line} of {file} has no tokens for this model's tokenizer", field="input"
                )
        except InputError as e:
            skipped.append({"id": i, "file": file, "line": line, "reason": e.message})
            continue
        ids.append(i)
        files.append(file)
        line_nos.append(line)
        texts.append(text)
        toks.append(t)
    if skipped and not skip_bad:
        return ShardResult(
            shard.index, shard.n, 0, 0, skipped, skipped[0]["reason"], started, worker=_worker()
        )

    shape = layout(opts.output, opts.pooling, emb.n_layers, emb.dim)
    meta = {
        "model_version": emb.version,
        "n_layers": emb.n_layers,
        "dim": emb.dim,
        **{k: v for k, v in asdict(opts).items() if k not in ("shard_rows", "batch_tokens")},
        "task": opts.task if opts.output == "mix" else None,
        "mix": None if spec is None else asdict(spec),
        "layout": shape,
        "shard": shard.index,
    }
    vector = pa.list_(pa.float32(), shape["width"])
    fields = [
        pa.field("id", pa.int64()),
        pa.field("text", pa.string()),
        pa.field("file", pa.dictionary(pa.int32(), pa.string())),
        pa.field("line", pa.int64()),
    ]
    if opts.pooling == "none":
        fields += [
            pa.field("positions", pa.list_(pa.string())),
            pa.field("embedding", pa.list_(vector)),
        ]
    else:
        fields.append(pa.field("embedding", vector))
    schema = pa.schema(fields, metadata={METADATA_KEY: json.dumps(meta)})
    target = output_of(emb.n_layers, spec, opts.granularity, opts.pooling)

    parquet = out / f"{shard.name}.parquet"
    n_tokens = sum(len(t) for t in toks)
    try:
        with atomic_path(parquet) as tmp:
            writer = _Writer(pq, tmp, schema)
            try:
                for lo, layers in _chunks(emb, toks, documents=opts.documents):
                    hi = lo + len(layers)
                    try:
                        batch = _record_batch(
                            pa,
                            schema,
                            target,
                            opts,
                            layers,
                            toks[lo:hi],
                            texts[lo:hi],
                            ids[lo:hi],
                            files[lo:hi],
                            line_nos[lo:hi],
                        )
                    except _NonFinite as e:
                        raise _NonFinite(lo + e.args[0]) from None
                    writer.put(batch)
            finally:
                writer.close()
        write_json(
            out / MANIFESTS / f"{shard.name}.json",
            {
                "shard": shard.index,
                "first_id": shard.first_id,
                "lines": shard.n,
                "rows": len(ids),
                "tokens": n_tokens,
                "bytes": writer.sink.size,
                "sha256": writer.sink.sha.hexdigest(),
                "model_version": emb.version,
                "skipped": skipped,
            },
        )
    except _NonFinite as e:  # never write a NaN a reader would trust
        why = f"line {line_nos[e.args[0]]} of {files[e.args[0]]}: the model produced non-finite values"
        return ShardResult(
            shard.index, shard.n, 0, 0, [], why, started, worker=_worker(), model_fault=True
        )
    except OSError as e:  # the folder's fault, not the input's: one line, not a traceback
        why = f"{out}: cannot write {shard.name} ({os_reason(e)})"
        return ShardResult(
            shard.index, shard.n, 0, 0, [], why, started, worker=_worker(), write_fault=True
        )
    return ShardResult(
        shard.index,
        shard.n,
        len(ids),
        n_tokens,
        skipped,
        None,
        started,
        time.time(),
        _worker(),
        cpu_s=time.process_time() - cpu0,
    )


def _record_batch(
    pa: Any,
    schema: Any,
    target: Any,
    opts: BulkOptions,
    layers: list[np.ndarray],
    toks: list,
    texts: list[str],
    ids: list[int],
    files: list[str],
    line_nos: list[int],
) -> Any:
    """One chunk's rows: each sentence's vectors copied once, from its layers straight
    into the one buffer Arrow's ``embedding`` column is made of (no copy from there)."""
    rendered = [
        sentence_vectors(x, ts, None if opts.whitespace else text, target)
        for x, ts, text in zip(layers, toks, texts, strict=True)
    ]
    k, d = rendered[0][1].shape[0], rendered[0][1].shape[-1]
    pooled = opts.pooling != "none"
    counts = [1 if pooled else x.shape[1] for _, x in rendered]
    buf = np.empty((sum(counts), k, d), np.float32)
    at = 0
    for (_, x), n in zip(rendered, counts, strict=True):
        buf[at : at + n] = x[:, None, :].transpose(1, 0, 2) if pooled else x.transpose(1, 0, 2)
        at += n
    # one pass without a mask: a NaN or inf anywhere makes the sum non-finite (and so may
    # a float32 overflow of finite values: then the exact check below says which)
    finite = np.isfinite(buf.sum()) or np.isfinite(buf).all()
    if not finite:
        row = int(np.argmin(np.isfinite(buf).reshape(len(buf), -1).all(axis=1)))
        raise _NonFinite(row if pooled else int(np.searchsorted(np.cumsum(counts), row, "right")))
    vectors = pa.FixedSizeListArray.from_arrays(pa.array(buf.reshape(-1)), k * d)
    columns = [
        pa.array(ids, pa.int64()),
        pa.array(texts, pa.string()),
        pa.array(files, pa.string()).dictionary_encode(),
        pa.array(line_nos, pa.int64()),
    ]
    if pooled:
        columns.append(vectors)
    else:
        offsets = np.zeros(len(counts) + 1, np.int32)
        np.cumsum(counts, out=offsets[1:])
        columns.append(pa.array([names for names, _ in rendered], pa.list_(pa.string())))
        columns.append(pa.ListArray.from_arrays(pa.array(offsets), vectors))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def _chunks(
    emb: Any, toks: list[list[Any]], chunk: int = 1024, documents: bool = False
) -> Iterator[tuple[int, list[np.ndarray]]]:
    """(first index, ``[L+1, T, D]`` per sentence) ``chunk`` sentences at a time (each
    chunk batched under the token budget): a shard's layers are never all in memory.
    ``documents``: in document mode, a row a document, many advancing together."""
    if documents:
        yield from _documents_layers(emb, toks)
        return
    for i in range(0, len(toks), chunk):
        yield i, emb.embed_tokens([[t.piece for t in ts] for ts in toks[i : i + chunk]])


def _document_tokens(emb: Any, sent: Any, file: str, line: int) -> list[Any]:
    """A document line's tokens (``elmo_service/document.py``'s checks; errors name the line)."""
    from elmo_service.document import tokenize_document

    try:
        doc = tokenize_document(emb.tokenizer, sent, field="input", max_tokens=None)
    except InputError as e:
        raise InputError(f"line {line} of {file}: {e.message}", field="input") from e
    return doc.tokens(0, len(doc))


def _documents_layers(emb: Any, toks: list[list[Any]]) -> Iterator[tuple[int, list[np.ndarray]]]:
    """Each document's ``[L+1, T, D]`` by document mode (its words given back as tokens),
    in order: ``document.advance_all`` keeps many in one batched step, a row each."""
    from elmo_service.document import DocTokens, DocumentRun, advance_all
    from elmo_service.outputs import plan_output

    spec = plan_output(emb.n_layers, output="layers")

    def runs() -> Iterator[DocumentRun]:
        for ts in toks:
            texts = list(dict.fromkeys(t.piece for t in ts))
            where = {k: i for i, k in enumerate(texts)}
            cols = np.array([(t.start, t.end, t.word) for t in ts], dtype=np.int64).reshape(-1, 3)
            ids = np.array([where[t.piece] for t in ts], dtype=np.int32)
            doc = DocTokens(texts, ids, cols[:, 0], cols[:, 1], cols[:, 2], "")
            yield DocumentRun(emb, doc, spec)

    for i, run in advance_all(runs(), in_order=True):
        yield i, [np.concatenate([c.layers for c in run.answer()], axis=1)]


def os_reason(e: OSError) -> str:
    """An OSError in a few words: ``No space left on device`` (pyarrow's carry no strerror)."""
    if e.strerror:
        return e.strerror
    if e.errno:
        return os.strerror(e.errno)
    text = str(e)
    m = re.search(r"\[errno (\d+)\]", text, re.IGNORECASE)
    return os.strerror(int(m.group(1))) if m else (text.splitlines() or [type(e).__name__])[0]


def _worker() -> str:
    return f"{os.uname().nodename}:{os.getpid()}"


def verify_shard(out: Path, shard: Shard, version: str, full: bool = True) -> dict[str, Any] | None:
    """The shard's manifest when it was written by this model for these lines and its
    Parquet file is whole, else None (the shard is redone). Whole: the recorded size and
    sha256 (``full``) and a footer giving the recorded row count, or (quick) the size and
    the footer only (reads kilobytes, misses a flipped byte inside the file). The footer
    is read either way: a manifest is not trusted to count the rows it describes."""
    try:
        m = json.loads((out / MANIFESTS / f"{shard.name}.json").read_text())
        parquet = out / f"{shard.name}.parquet"
        ok = (
            m.get("model_version") == version
            and m.get("first_id") == shard.first_id
            and m.get("lines") == shard.n
            and parquet.stat().st_size == m.get("bytes")
        )
        if ok and full:
            ok = sha256_file(parquet) == m.get("sha256")
        if ok:
            _, pq = pyarrow()
            ok = pq.read_metadata(parquet).num_rows == m.get("rows")
    except (OSError, ValueError, AttributeError):
        return None
    except Exception as e:  # noqa: BLE001 - pyarrow's error for a broken footer
        if type(e).__module__.startswith("pyarrow"):
            return None
        raise
    return m if ok else None
