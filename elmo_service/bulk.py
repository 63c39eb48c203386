"""Corpus-scale embedding: ``elmo-service embed-bulk`` on Ray Data (docs/bulk.md).

The inputs (one sentence a line) are cut into shards of ``shard_rows`` lines, numbered
by the sentence's position over all inputs (``id``). Each shard is one unit of work:
a Ray Data actor (``ShardEmbedder``, the model loaded once per actor) embeds its lines
under the token budget and writes ``part-NNNNN.parquet`` itself, atomically, then a
``part-NNNNN.json`` manifest (rows, sha256). A re-run skips the shards whose manifest
verifies and redoes the others, so a killed run loses only the shards in flight.
Shards are written by the actors, not the driver: on a cluster ``--out`` is shared
storage and no vector travels through the driver.

The core never imports Ray at import time: ``ray`` and ``pyarrow`` are the optional
extra ``elmo-service[bulk]``, imported inside the functions that need them.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from elmo_service.atomic import atomic_path, write_json, write_text
from elmo_service.batching import DEFAULT_BATCH_TOKENS
from elmo_service.errors import ConfigError, ElmoServiceError, InputError, at_line

OUTPUTS = ("layers", "mix")
POOLINGS = ("none", "mean", "max")
GRANULARITIES = ("token", "word")
RUN_FILE = "_bulk.json"  # "_" and ".": Parquet readers of the folder skip them
SKIPPED_FILE = "_skipped.jsonl"
MANIFESTS = "_manifests"
LOCK_FILE = ".bulk.lock"
METADATA_KEY = b"elmo_service"
DEFAULT_SHARD_ROWS = 10_000


def _deps() -> tuple[Any, Any, Any]:
    """``(ray, pyarrow, pyarrow.parquet)``, or a ConfigError saying how to install them."""
    # Ray Data logs each execution at INFO; our bar and summary say it (an explicit choice wins)
    os.environ.setdefault("RAY_DATA_LOG_LEVEL", "ERROR")
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
        import ray
    except ImportError as e:
        raise ConfigError(
            f"embed-bulk needs Ray Data and pyarrow ({e.name} is missing): "
            "pip install 'elmo-service[bulk]'",
            field="embed-bulk",
        ) from e
    return ray, pa, pq


def _pyarrow() -> tuple[Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ConfigError(
            "embed-bulk needs pyarrow: pip install 'elmo-service[bulk]'", field="embed-bulk"
        ) from e
    return pa, pq


# ----------------------------------------------------------------- options and plan


@dataclass(frozen=True)
class BulkOptions:
    """What the vectors are; a re-run into the same folder must give the same."""

    output: str = "layers"  # "layers": all L+1 layers; "mix": one scalar mix
    task: str | None = None  # the mix stored with the model (None: 'default', else average)
    pooling: str = "none"
    granularity: str = "token"
    whitespace: bool = False  # lines are pre-tokenized words
    shard_rows: int = DEFAULT_SHARD_ROWS
    batch_tokens: int = DEFAULT_BATCH_TOKENS

    def check(self) -> BulkOptions:
        if self.output not in OUTPUTS:
            raise ConfigError(f"output must be one of {OUTPUTS}", field="output")
        if self.pooling not in POOLINGS:
            raise ConfigError(f"pooling must be one of {POOLINGS}", field="pooling")
        if self.granularity not in GRANULARITIES:
            raise ConfigError(f"granularity must be one of {GRANULARITIES}", field="granularity")
        if self.task is not None and self.output != "mix":
            raise ConfigError(
                "--task gives a mix: use --output mix (or leave --output out)", field="task"
            )
        if self.shard_rows < 1:
            raise ConfigError("shard-rows must be >= 1", field="shard-rows")
        if self.batch_tokens < 1:
            raise ConfigError("batch-tokens must be >= 1", field="batch-tokens")
        return self


@dataclass(frozen=True)
class Segment:
    """Lines ``[first_line, first_line + n)`` (1-based) of one input, bytes ``[start, end)``."""

    file: str
    start: int
    end: int
    first_line: int
    n: int


@dataclass(frozen=True)
class Shard:
    index: int
    first_id: int
    n: int
    segments: tuple[Segment, ...]

    @property
    def name(self) -> str:
        return f"part-{self.index:05d}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Shard:
        d = json.loads(text)
        return cls(d["index"], d["first_id"], d["n"], tuple(Segment(**s) for s in d["segments"]))


@dataclass
class Scan:
    inputs: list[dict[str, Any]]  # path, bytes, lines, sha256
    shards: list[Shard]
    bad: list[dict[str, Any]] = field(default_factory=list)  # {id, file, line, reason}

    @property
    def lines(self) -> int:
        return sum(i["lines"] for i in self.inputs)


def _line_problem(raw: bytes) -> str | None:
    """Why a raw line (newline removed) is no sentence, or None."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"is not UTF-8 (byte {e.start}: {raw[e.start : e.start + 1]!r})"
    if not text.strip():
        return "is blank"
    return None


def _strip_newline(raw: bytes) -> bytes:
    return raw[:-2] if raw.endswith(b"\r\n") else raw[:-1] if raw.endswith(b"\n") else raw


def scan_inputs(
    paths: Sequence[str | Path], shard_rows: int, progress: Callable[[int], None] | None = None
) -> Scan:
    """One pass over the inputs' bytes: their sha256, line counts, the lines that are no
    sentence (non-UTF-8, blank), and the shards (a shard may span two files)."""
    inputs: list[dict[str, Any]] = []
    shards: list[Shard] = []
    bad: list[dict[str, Any]] = []
    segs: list[Segment] = []
    in_shard = 0
    next_id = 0
    shard_first = 0

    def close_shard() -> None:
        nonlocal segs, in_shard, shard_first
        shards.append(Shard(len(shards), shard_first, in_shard, tuple(segs)))
        segs, in_shard, shard_first = [], 0, next_id

    for p in paths:
        path = Path(p).resolve()
        if not path.is_file():
            raise InputError(f"{p}: not a file (missing, or a folder)", field="input")
        h = hashlib.sha256()
        pos = seg_start = 0
        line_no = seg_first = 1
        try:
            with path.open("rb") as f:
                for raw in f:
                    h.update(raw)
                    why = _line_problem(_strip_newline(raw))
                    if why is not None:
                        bad.append(
                            {
                                "id": next_id,
                                "file": str(path),
                                "line": line_no,
                                "reason": f"line {line_no} of {path} {why}",
                            }
                        )
                    pos += len(raw)
                    line_no += 1
                    next_id += 1
                    in_shard += 1
                    if in_shard == shard_rows:
                        segs.append(
                            Segment(str(path), seg_start, pos, seg_first, line_no - seg_first)
                        )
                        close_shard()
                        seg_start, seg_first = pos, line_no
                    if progress is not None and next_id % 65536 == 0:
                        progress(65536)
        except OSError as e:
            raise InputError(f"{p}: cannot be read ({e.strerror or e})", field="input") from e
        if line_no > seg_first:
            segs.append(Segment(str(path), seg_start, pos, seg_first, line_no - seg_first))
        inputs.append(
            {"path": str(path), "bytes": pos, "lines": line_no - 1, "sha256": h.hexdigest()}
        )
    if in_shard:
        close_shard()
    if progress is not None:
        progress(next_id % 65536)
    return Scan(inputs, shards, bad)


def read_shard_lines(shard: Shard) -> Iterator[tuple[int, str, int, str | None, str | None]]:
    """``(id, file, line, text, why)`` for the shard's lines: ``text`` None and ``why`` the
    reason when the line is no sentence."""
    i = shard.first_id
    for seg in shard.segments:
        with open(seg.file, "rb") as f:
            f.seek(seg.start)
            data = f.read(seg.end - seg.start)
        lines = data.split(b"\n")
        if data.endswith(b"\n"):
            lines.pop()
        if len(lines) != seg.n:
            raise InputError(
                f"{seg.file} changed since it was scanned (lines {seg.first_line}-"
                f"{seg.first_line + seg.n - 1}): re-run embed-bulk",
                field="input",
            )
        for k, raw in enumerate(lines):
            raw = raw[:-1] if raw.endswith(b"\r") else raw
            why = _line_problem(raw)
            text = raw.decode("utf-8") if why is None else None
            yield i, seg.file, seg.first_line + k, text, why
            i += 1


# ----------------------------------------------------------------- vectors and layout


def layout(output: str, pooling: str, n_layers: int, dim: int) -> dict[str, Any]:
    """The ``embedding`` column's shape (docs/bulk.md): every position's vector is
    ``width`` float32s, ``[dim]`` for a mix, ``[n_layers, dim]`` layer-major for layers."""
    width = dim if output == "mix" else n_layers * dim
    vector = [dim] if output == "mix" else [n_layers, dim]
    if pooling == "none":
        return {
            "width": width,
            "row_shape": ["positions", *vector],
            "column": f"list<fixed_size_list<float32, {width}>>",
        }
    return {"width": width, "row_shape": vector, "column": f"fixed_size_list<float32, {width}>"}


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


def embed_shard(
    emb: Any, shard: Shard, opts: BulkOptions, out: Path, spec: Any | None, skip_bad: bool
) -> ShardResult:
    """Embed one shard with a loaded ``Embedder`` and write it (Parquet, then manifest).
    Writes nothing when a line is bad and ``skip_bad`` is off."""
    started = time.time()
    pa, pq = _pyarrow()
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
    with atomic_path(parquet) as tmp:
        pq.write_table(table, tmp)
    n_tokens = sum(len(t) for t in toks)
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
    return ShardResult(
        shard.index, shard.n, len(ids), n_tokens, skipped, None, started, time.time(), _worker()
    )


def _layers(emb: Any, toks: list[list[Any]], chunk: int = 1024) -> Iterator[np.ndarray]:
    """``[L+1, T, D]`` per sentence, in order, embedded ``chunk`` sentences at a time (each
    chunk batched under the token budget): a shard's layers are never all in memory."""
    for i in range(0, len(toks), chunk):
        yield from emb.embed_tokens([[t.text for t in ts] for ts in toks[i : i + chunk]])


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
    sha256 (``full``), or the recorded size and a footer giving the recorded row count
    (quick: reads kilobytes, misses a flipped byte inside the file)."""
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
        elif ok:
            _, pq = _pyarrow()
            ok = pq.read_metadata(parquet).num_rows == m.get("rows")
    except (OSError, ValueError, AttributeError):
        return None
    except Exception as e:  # noqa: BLE001 - pyarrow's error for a broken footer
        if type(e).__module__.startswith("pyarrow"):
            return None
        raise
    return m if ok else None


# ----------------------------------------------------------------- the Ray actor


class ShardEmbedder:
    """A Ray Data actor: loads the ``Embedder`` once, then embeds and writes one shard
    per call (``batch_size=1``); returns the shard's result, never its vectors."""

    def __init__(
        self,
        model: str,
        version: str,
        opts: dict,
        out: str,
        skip_bad: bool,
        threads: int,
        spec: dict | None,
    ) -> None:
        from elmo_service.embedder import Embedder
        from elmo_service.scalar_mix import MixSpec

        self.opts = BulkOptions(**opts)
        self.emb = Embedder.load(
            model, threads=threads, device="cpu", batch_tokens=self.opts.batch_tokens
        )
        if self.emb.version != version:
            raise ConfigError(
                f"model {model} is version {self.emb.version} here, {version} on the driver: "
                "every node must see the same model files",
                field="model",
            )
        self.out = Path(out)
        self.skip_bad = skip_bad
        self.spec = None if spec is None else MixSpec(**spec)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        results = [
            embed_shard(self.emb, Shard.from_json(s), self.opts, self.out, self.spec, self.skip_bad)
            for s in batch["shard"]
        ]
        return {"result": [json.dumps(asdict(r)) for r in results]}


# ----------------------------------------------------------------- the driver


@dataclass
class BulkSummary:
    shards: int
    done_before: int  # verified shards a re-run kept
    written: int
    rows: int
    tokens: int  # model tokens embedded in this run
    results: list[ShardResult]  # this run's shards
    embed_seconds: float  # first shard started -> last shard written (no start-up), this run
    skipped: list[dict[str, Any]]
    version: str


def resolve_mix(model: Path, opts: BulkOptions) -> tuple[str, int, int, Any | None]:
    """(model version, output layers, dim, the mix spec or None), from the model's files
    without its weights: a bad option fails before any work starts."""
    from elmo_service.artifact import load_tasks, read_header
    from elmo_service.outputs import resolve_output

    header = read_header(model)
    if header.version is None:
        raise ConfigError(f"{model}: its manifest has no version", field="model")
    n_layers = header.config.n_output_layers
    if opts.output != "mix":
        return header.version, n_layers, header.config.output_dim, None
    tasks = load_tasks(model, n_layers)
    if opts.task is not None and opts.task not in tasks:
        known = ", ".join(sorted(tasks)) or "none"
        raise ConfigError(f"model has no task {opts.task!r} (tasks: {known})", field="task")
    spec = resolve_output(n_layers, tasks.get, output="mix", task=opts.task).mix
    return header.version, n_layers, header.config.output_dim, spec


def _lock(out: Path):
    f = open(out / LOCK_FILE, "w")  # noqa: SIM115 - held until the run ends
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as e:
        f.close()
        raise ConfigError(f"{out} is in use by another embed-bulk run", field="out") from e
    return f


def _check_run_file(out: Path, run: dict[str, Any]) -> None:
    """A folder holds one run's shards: the same inputs, model and options, or refused."""
    path = out / RUN_FILE
    if path.exists():
        try:
            before = json.loads(path.read_text())
        except ValueError:
            before = None
        if before != run:
            diff = sorted(k for k in run if not isinstance(before, dict) or before.get(k) != run[k])
            raise ConfigError(
                f"{out} holds the output of another run (differs in: {', '.join(diff)}); "
                "use another --out, or remove the folder to start over",
                field="out",
            )
    else:
        write_json(path, run)


def _remove_stale_temporaries(out: Path) -> None:
    """A killed run leaves ``.part-*.tmp`` files behind (atomic.py's temporaries)."""
    for p in [*out.glob(".part-*.tmp"), *(out / MANIFESTS).glob(".part-*.tmp")]:
        p.unlink(missing_ok=True)


def run_bulk(
    inputs: Sequence[str | Path],
    out: str | Path,
    model: str | Path,
    opts: BulkOptions,
    *,
    actors: int | None = None,
    threads: int = 1,
    address: str | None = None,
    skip_bad: bool = False,
    verify: str = "full",
    progress: bool = True,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
) -> BulkSummary:
    """Embed ``inputs`` into Parquet shards under ``out`` (docs/bulk.md)."""
    from tqdm import tqdm

    opts.check()
    _deps()  # a missing extra is reported before the inputs are read
    if actors is not None and actors < 1:
        raise ConfigError("actors must be >= 1", field="actors")
    if threads < 1:
        raise ConfigError("threads must be >= 1", field="threads")
    if verify not in ("full", "quick"):
        raise ConfigError("verify must be 'full' or 'quick'", field="verify")
    model = Path(model).resolve()
    out = Path(out).resolve()
    if not out.parent.is_dir():
        raise ConfigError(f"{out}: its folder {out.parent} does not exist", field="out")
    version, n_layers, dim, spec = resolve_mix(model, opts)

    with tqdm(desc="scan", unit="line", unit_scale=True, disable=not progress) as bar:
        scan = scan_inputs(inputs, opts.shard_rows, bar.update)
    if scan.bad and not skip_bad:
        shown = "; ".join(b["reason"] for b in scan.bad[:3])
        more = f" (and {len(scan.bad) - 3} more)" if len(scan.bad) > 3 else ""
        raise InputError(
            f"{shown}{more}; give one sentence a line, or --skip-bad to skip "
            f"such lines (listed in {SKIPPED_FILE})",
            field="input",
        )

    (out / MANIFESTS).mkdir(parents=True, exist_ok=True)
    lock = _lock(out)
    try:
        run = {
            "model": str(model),
            "model_version": version,
            "options": {k: v for k, v in asdict(opts).items() if k != "batch_tokens"},
            "inputs": scan.inputs,
            "shards": len(scan.shards),
            "layout": layout(opts.output, opts.pooling, n_layers, dim),
        }
        _check_run_file(out, run)
        _remove_stale_temporaries(out)
        full = verify == "full"
        done = {s.index: verify_shard(out, s, version, full) for s in scan.shards}
        pending = [s for s in scan.shards if done[s.index] is None]
        manifests = {k: m for k, m in done.items() if m is not None}
        log(
            f"{len(scan.shards)} shards of up to {opts.shard_rows} lines: "
            f"{len(manifests)} already written, {len(pending)} to do"
        )
        results: list[ShardResult] = []
        if pending:
            results = _run_on_ray(
                pending,
                out,
                model,
                version,
                opts,
                spec,
                actors,
                threads,
                address,
                skip_bad,
                progress,
            )
        for s in pending:
            m = verify_shard(out, s, version, full=False)  # the actor hashed what it wrote
            if m is None:
                raise ElmoServiceError(
                    f"{out / s.name}.parquet did not verify after writing", field="out"
                )
            manifests[s.index] = m
        skipped = [b for k in sorted(manifests) for b in manifests[k]["skipped"]]
        write_text(out / SKIPPED_FILE, "".join(json.dumps(b) + "\n" for b in skipped))
    finally:
        lock.close()
    return BulkSummary(
        shards=len(scan.shards),
        done_before=len(scan.shards) - len(pending),
        written=len(pending),
        rows=sum(m["rows"] for m in manifests.values()),
        tokens=sum(r.tokens for r in results),
        results=results,
        embed_seconds=max((r.finished for r in results), default=0.0)
        - min((r.started for r in results), default=0.0),
        skipped=skipped,
        version=version,
    )


def _run_on_ray(
    pending: list[Shard],
    out: Path,
    model: Path,
    version: str,
    opts: BulkOptions,
    spec: Any | None,
    actors: int | None,
    threads: int,
    address: str | None,
    skip_bad: bool,
    progress: bool,
) -> list[ShardResult]:
    """Embed ``pending`` on a Ray Data actor pool; the shards' results."""
    from tqdm import tqdm

    ray, _, _ = _deps()
    started = False
    if not ray.is_initialized():
        if address is None:  # a local cluster: no set-up, gone when the run ends
            cpus = actors * threads if actors else (os.cpu_count() or 1)
            ray.init(
                num_cpus=cpus,
                include_dashboard=False,
                log_to_driver=False,
                logging_level="ERROR",
                configure_logging=True,
            )
        else:
            ray.init(address=address, log_to_driver=False, logging_level="ERROR")
        started = True
    try:
        if actors is None:
            actors = max(1, int(ray.cluster_resources().get("CPU", 1)) // threads)
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False  # ours counts sentences
        ctx.print_on_execution_start = False
        # start only once every actor has loaded its model, so none takes the others' share
        ctx.wait_for_min_actors_s = 600
        ds = ray.data.from_items(
            [{"shard": s.to_json()} for s in pending], override_num_blocks=len(pending)
        ).map_batches(
            ShardEmbedder,
            fn_constructor_kwargs={
                "model": str(model),
                "version": version,
                "opts": asdict(opts),
                "out": str(out),
                "skip_bad": skip_bad,
                "threads": threads,
                "spec": None if spec is None else asdict(spec),
            },
            # a shard is seconds of work: hand it to an actor only when that one is free
            compute=ray.data.ActorPoolStrategy(
                size=min(actors, len(pending)), max_tasks_in_flight_per_actor=1
            ),
            batch_size=1,
            num_cpus=threads,
        )
        tokens, results = 0, []
        total = sum(s.n for s in pending)
        with tqdm(total=total, desc="embed", unit="sent", disable=not progress) as bar:
            for row in ds.iter_rows():
                r = ShardResult(**json.loads(row["result"]))
                if r.model_fault:
                    raise ElmoServiceError(f"{r.error}: a broken model", field="model")
                if r.error is not None:
                    raise InputError(
                        f"{r.error}; fix the line, or --skip-bad to skip such lines "
                        f"(listed in {SKIPPED_FILE})",
                        field="input",
                    )
                results.append(r)
                tokens += r.tokens
                bar.update(r.lines)
                bar.set_postfix(tokens=tokens, refresh=False)
        return results
    finally:
        if started:
            ray.shutdown()
