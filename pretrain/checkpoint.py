"""Training checkpoints: atomic, pruned, loadable with ``weights_only=True``.

    run_dir/checkpoints/step-00001000.pt

A checkpoint is a dict of tensors and primitive containers only (no pickled
classes): model and optimizer state dicts, the step, the data position
(epoch, batch index), per-rank RNG states and counters. It is written to a
temporary file in the same folder, fsync'ed, then ``os.replace``'d into its
name, so a crash mid-write leaves at most a stray ``.tmp`` file and the
previous checkpoint intact. Loading walks from the newest checkpoint back and
skips any that fail to load.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

_NAME = re.compile(r"^step-(\d{8,})\.pt$")


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoint files, oldest first."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def save_checkpoint(run_dir: str | Path, step: int, state: dict[str, Any], keep: int = 3) -> Path:
    d = checkpoint_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"step-{step:08d}.pt"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(d)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    for old in list_checkpoints(run_dir)[:-keep]:
        old.unlink(missing_ok=True)
    for stray in d.glob(".step-*.tmp"):  # left by an earlier crash
        if stray.name != Path(tmp).name:
            stray.unlink(missing_ok=True)
    return path


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


def load_latest(run_dir: str | Path, log=print) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads, or None; unreadable ones are reported and skipped."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return path, load_checkpoint(path)
        except Exception as e:  # truncated zip, bad pickle opcode, ...
            log(
                f"warning: checkpoint {path.name} is unreadable ({type(e).__name__}: {e}); trying an older one"
            )
    return None
