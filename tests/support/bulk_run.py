"""``embed-bulk`` as a real command in its own session (so a test can kill the whole run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def bulk_cmd(inp: Path, out: Path, model: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "api.cli", "embed-bulk", str(inp), "--out", str(out),
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
