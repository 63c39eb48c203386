"""``embed-bulk`` as a real command in its own session (so a test can kill the whole run)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from elmo_bulk.plan import MANIFESTS

ROOT = Path(__file__).resolve().parents[2]


def bulk_cmd(inp: Path, out: Path, model: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "elmo_cli.main", "embed-bulk", str(inp), "--out", str(out),
            "--model", str(model), "--quiet", *flags]  # fmt: skip


def start_bulk(inp: Path, out: Path, model: Path, *flags: str) -> subprocess.Popen:
    """The command running, one thread, stdout dropped, stderr piped."""
    return subprocess.Popen(
        bulk_cmd(inp, out, model, *flags),
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def wait_for_shards(proc: subprocess.Popen, out: Path, n: int, timeout: float = 180) -> None:
    """Until ``n`` shards have their manifests (the run still going); fails naming why."""
    deadline = time.monotonic() + timeout
    while len(list((out / MANIFESTS).glob("*.json"))) < n:
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "no shard written in time"
        time.sleep(0.02)


def one_shard_of_six(tmp_path: Path, model: Path):
    """Six generated sentences embedded as one shard in ``tmp_path/out`` (no Ray):
    ``(out, shard, embedder)``."""
    from elmo_bulk import BulkOptions, embed_shard, scan_inputs
    from elmo_service.embedder import Embedder
    from tests.support.core_fixtures import generated_text

    inp, out = tmp_path / "in.txt", tmp_path / "out"
    inp.write_text(generated_text(6, seed=4))
    (out / MANIFESTS).mkdir(parents=True)
    (shard,) = scan_inputs([inp], shard_rows=10).shards
    emb = Embedder.load(model, threads=1)
    assert embed_shard(emb, shard, BulkOptions(), out, None, skip_bad=False).rows == 6
    return out, shard, emb
