"""Planning an ``embed-bulk`` run: its options, the shards cut from the inputs, the
output's layout and the mix, all decided on the driver before any work starts.

The inputs (one sentence a line) are cut into shards of ``shard_rows`` lines, numbered
by the sentence's position over all inputs (``id``); a shard may span two files. One
pass over the inputs' bytes also hashes them and finds the lines that are no sentence.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from elmo_service.bilm.config import DEFAULT_BATCH_TOKENS
from elmo_service.errors import ConfigError, InputError

OUTPUTS = ("layers", "mix")
POOLINGS = ("none", "mean", "max")
GRANULARITIES = ("token", "word")
RUN_FILE = "_bulk.json"  # "_" and ".": Parquet readers of the folder skip them
SKIPPED_FILE = "_skipped.jsonl"
MANIFESTS = "_manifests"
LOCK_FILE = ".bulk.lock"
METADATA_KEY = b"elmo_service"
DEFAULT_SHARD_ROWS = 10_000


# ----------------------------------------------------------------- options and plan


@dataclass(frozen=True)
class BulkOptions:
    """What the vectors are; a re-run into the same folder must give the same."""

    output: str = "layers"  # "layers": all L+1 layers; "mix": one scalar mix
    task: str | None = None  # the mix stored with the model (None: 'default', else average)
    pooling: str = "none"
    granularity: str = "token"
    whitespace: bool = False  # lines are pre-tokenized words
    documents: bool = False  # each line is a document: one sequence (docs/documents.md)
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


def shard_size(lines: int, actors: int) -> int:
    """Lines per shard so that ``lines`` make at least ``actors`` shards (when they can)."""
    return max(1, -(-lines // max(1, actors)))


BOM = b"\xef\xbb\xbf"  # a UTF-8 byte order mark: not part of the first line's text


def _line_problem(raw: bytes) -> str | None:
    """Why a raw line (newline removed) is no sentence, or None."""
    try:
        raw.decode("utf-8")  # only to find a bad byte
    except UnicodeDecodeError as e:
        return f"is not UTF-8 (byte {e.start}: {raw[e.start : e.start + 1]!r})"
    return None  # a blank line is an empty sentence: a row with no positions (#51)


def _strip_newline(raw: bytes) -> bytes:
    return raw[:-2] if raw.endswith(b"\r\n") else raw[:-1] if raw.endswith(b"\n") else raw


def scan_inputs(
    paths: Sequence[str | Path], shard_rows: int, progress: Callable[[int], None] | None = None
) -> Scan:
    """One pass over the inputs' bytes: their sha256, line counts, the lines that are no
    sentence (non-UTF-8; a blank one is an empty sentence), and the shards (a shard may span two files)."""
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
                    first = raw[len(BOM) :] if line_no == 1 and raw.startswith(BOM) else raw
                    why = _line_problem(_strip_newline(first))
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
        if seg.start == 0 and lines and lines[0].startswith(BOM):
            lines[0] = lines[0][len(BOM) :]
        for k, raw in enumerate(lines):
            raw = raw[:-1] if raw.endswith(b"\r") else raw
            why = _line_problem(raw)
            text = raw.decode("utf-8") if why is None else None
            yield i, seg.file, seg.first_line + k, text, why
            i += 1


# ----------------------------------------------------------------- layout and mix


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
    spec = resolve_output(n_layers, tasks.get, tasks, output="mix", task=opts.task).mix
    return header.version, n_layers, header.config.output_dim, spec
