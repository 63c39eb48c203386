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
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from elmo_service.atomic import atomic_path, write_json
from elmo_service.bulk.plan import (
    MANIFESTS,
    METADATA_KEY,
    BulkOptions,
    Shard,
    layout,
    read_shard_lines,
)
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


def sentence_vectors(
    layers: np.ndarray,
    tokens: Sequence[Any],
    text: str | None,
    *,
    spec: Any | None,
    granularity: str,
    pooling: str,
) -> tuple[list[str], np.ndarray]:
    """``[L+1, T, D]`` -> (position texts, ``[P, width]`` or pooled ``[width]``), by
    ``elmo_service/outputs.py`` (every surface's one order: mix, words, pooling)."""
    from elmo_service.outputs import plan_output, positions, render

    out = plan_output(
        layers.shape[0],
        output="layers" if spec is None else "mix",
        granularity=granularity,
        pooling=pooling,
    )
    out = out if spec is None else out.using(spec, None)
    x, m = render(layers, tokens, out)
    x = x if m is None else m[None]  # [K, P, D], pooled [K, D]
    texts = [t.text for t in positions(tokens, out, text)]
    if pooling != "none":
        return texts, x.reshape(-1)
    return texts, np.ascontiguousarray(x.transpose(1, 0, 2)).reshape(x.shape[1], -1)  # [P, K*D]


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


def embed_shard(
    emb: Any, shard: Shard, opts: BulkOptions, out: Path, spec: Any | None, skip_bad: bool
) -> ShardResult:
    """Embed one shard with a loaded ``Embedder`` and write it (Parquet, then manifest).
    Writes nothing when a line is bad and ``skip_bad`` is off."""
    started = time.time()
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
            (t,) = emb.tokenize([sent], field="input", where=at_line(file, line))
            if not t:
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

    width = layout(opts.output, opts.pooling, emb.n_layers, emb.dim)["width"]
    vecs, positions = [], []
    for file, line, text, ts, x in zip(
        files, line_nos, texts, toks, _layers(emb, toks), strict=True
    ):
        names, v = sentence_vectors(
            x,
            ts,
            None if opts.whitespace else text,
            spec=spec,
            granularity=opts.granularity,
            pooling=opts.pooling,
        )
        if not np.isfinite(v).all():  # never write a NaN a reader would trust
            why = f"line {line} of {file}: the model produced non-finite values"
            return ShardResult(
                shard.index, shard.n, 0, 0, [], why, started, worker=_worker(), model_fault=True
            )
        vecs.append(v)
        positions.append(names)

    flat = np.concatenate([v.reshape(-1) for v in vecs]) if vecs else np.zeros(0, np.float32)
    per_position = pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.float32()), width)
    columns = {
        "id": pa.array(ids, pa.int64()),
        "text": pa.array(texts, pa.string()),
        "file": pa.array(files, pa.string()).dictionary_encode(),
        "line": pa.array(line_nos, pa.int64()),
    }
    if opts.pooling == "none":
        offsets = np.concatenate([[0], np.cumsum([len(p) for p in positions])]).astype(np.int32)
        columns["positions"] = pa.array(positions, pa.list_(pa.string()))
        columns["embedding"] = pa.ListArray.from_arrays(pa.array(offsets), per_position)
    else:
        columns["embedding"] = per_position
    meta = {
        "model_version": emb.version,
        "n_layers": emb.n_layers,
        "dim": emb.dim,
        **{k: v for k, v in asdict(opts).items() if k not in ("shard_rows", "batch_tokens")},
        "task": opts.task if opts.output == "mix" else None,
        "mix": None if spec is None else asdict(spec),
        "layout": layout(opts.output, opts.pooling, emb.n_layers, emb.dim),
        "shard": shard.index,
    }
    table = pa.table(columns).replace_schema_metadata({METADATA_KEY: json.dumps(meta)})
    parquet = out / f"{shard.name}.parquet"
    n_tokens = sum(len(t) for t in toks)
    try:
        with atomic_path(parquet) as tmp:
            pq.write_table(table, tmp)
        write_json(
            out / MANIFESTS / f"{shard.name}.json",
            {
                "shard": shard.index,
                "first_id": shard.first_id,
                "lines": shard.n,
                "rows": len(ids),
                "tokens": n_tokens,
                "bytes": parquet.stat().st_size,
                "sha256": _sha256(parquet),
                "model_version": emb.version,
                "skipped": skipped,
            },
        )
    except OSError as e:  # the folder's fault, not the input's: one line, not a traceback
        why = f"{out}: cannot write {shard.name} ({os_reason(e)})"
        return ShardResult(
            shard.index, shard.n, 0, 0, [], why, started, worker=_worker(), write_fault=True
        )
    return ShardResult(
        shard.index, shard.n, len(ids), n_tokens, skipped, None, started, time.time(), _worker()
    )


def _layers(emb: Any, toks: list[list[Any]], chunk: int = 1024) -> Iterator[np.ndarray]:
    """``[L+1, T, D]`` per sentence, in order, embedded ``chunk`` sentences at a time (each
    chunk batched under the token budget): a shard's layers are never all in memory."""
    for i in range(0, len(toks), chunk):
        yield from emb.embed_tokens([[t.text for t in ts] for ts in toks[i : i + chunk]])


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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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
            ok = _sha256(parquet) == m.get("sha256")
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
