"""The driver of ``embed-bulk`` (docs/bulk.md): plan, lock the folder, keep the shards
that verify, hand the others to the Ray run, check what came back, and sum up.

A re-run skips the shards whose manifest verifies and redoes the others, so a killed
run loses only the shards in flight.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from elmo_bulk.cluster import ray_deps, run_on_ray
from elmo_bulk.plan import (
    LOCK_FILE,
    MANIFESTS,
    RUN_FILE,
    SKIPPED_FILE,
    BulkOptions,
    layout,
    resolve_mix,
    scan_inputs,
    shard_size,
)
from elmo_bulk.shard import ShardResult, os_reason, verify_shard
from elmo_service.atomic import write_json, write_text
from elmo_service.errors import PATH_ERRORS, ConfigError, ElmoServiceError, InputError


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


def _planned_rows(out: Path, options: dict[str, Any]) -> int | None:
    """A re-run keeps the first run's shard size (it may have been cut to the actors)."""
    try:
        before = json.loads((out / RUN_FILE).read_text())
        if before["options"] != options:
            return None
        # a folder of the previous version (no "shard_rows"): its shards were --shard-rows
        return int(before.get("shard_rows", options["shard_rows"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


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
        if isinstance(before, dict) and "shard_rows" not in before:  # the previous version's
            before = {**before, "shard_rows": before.get("options", {}).get("shard_rows")}
            if before == run:
                write_json(path, run)
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
    threads: int | None = None,
    address: str | None = None,
    skip_bad: bool = False,
    verify: str = "full",
    progress: bool = True,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
) -> BulkSummary:
    """Embed ``inputs`` into Parquet shards under ``out`` (docs/bulk.md)."""
    from tqdm import tqdm

    opts.check()
    ray_deps(local=address is None)  # a missing extra is reported before the inputs are read
    if actors is not None and actors < 1:
        raise ConfigError("actors must be >= 1", field="actors")
    if threads is not None and threads < 1:
        raise ConfigError("threads must be >= 1", field="threads")
    if verify not in ("full", "quick"):
        raise ConfigError("verify must be 'full' or 'quick'", field="verify")
    model = Path(model).resolve()
    out = Path(out).resolve()
    if not out.parent.is_dir():
        raise ConfigError(f"{out}: its folder {out.parent} does not exist", field="out")
    version, n_layers, dim, spec = resolve_mix(model, opts)

    options = {k: v for k, v in asdict(opts).items() if k != "batch_tokens"}
    planned = _planned_rows(out, options)
    with tqdm(desc="scan", unit="line", unit_scale=True, disable=not progress) as bar:
        scan = scan_inputs(inputs, planned or opts.shard_rows, bar.update)
    workers = actors or (None if address else max(1, (os.cpu_count() or 1) // (threads or 1)))
    if planned is None and workers and len(scan.shards) < workers and scan.lines > 1:
        # a small corpus: shards of lines / actors, so that every actor works (a re-scan,
        # cheap: fewer than actors x shard_rows lines)
        scan = scan_inputs(inputs, shard_size(scan.lines, workers))
    if scan.bad and not skip_bad:
        shown = "; ".join(b["reason"] for b in scan.bad[:3])
        more = f" (and {len(scan.bad) - 3} more)" if len(scan.bad) > 3 else ""
        raise InputError(
            f"{shown}{more}; give one sentence a line, or --skip-bad to skip "
            f"such lines (listed in {SKIPPED_FILE})",
            field="input",
        )

    rows = scan.shards[0].n if scan.shards else opts.shard_rows
    try:
        (out / MANIFESTS).mkdir(parents=True, exist_ok=True)
        lock = _lock(out)
    except OSError as e:
        raise ElmoServiceError(f"{out}: cannot write there ({os_reason(e)})", field="out") from e
    try:
        run = {
            "model": str(model),
            "model_version": version,
            "options": options,
            "inputs": scan.inputs,
            "shards": len(scan.shards),
            "shard_rows": rows,  # the plan's (a small corpus's shards are smaller)
            "layout": layout(opts.output, opts.pooling, n_layers, dim),
        }
        _check_run_file(out, run)
        _remove_stale_temporaries(out)
        full = verify == "full"
        done = {s.index: verify_shard(out, s, version, full) for s in scan.shards}
        pending = [s for s in scan.shards if done[s.index] is None]
        manifests = {k: m for k, m in done.items() if m is not None}
        log(
            f"{len(scan.shards)} shards of up to {rows} lines: "
            f"{len(manifests)} already written, {len(pending)} to do"
        )
        results: list[ShardResult] = []
        if pending:
            results = run_on_ray(
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
    except OSError as e:  # a full disk, a read-only folder: one line, not a traceback
        if isinstance(e, PATH_ERRORS):
            raise
        raise ElmoServiceError(f"{out}: cannot write there ({os_reason(e)})", field="out") from e
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
