"""Processes of the tests: finding them by command line (a job's trainer, to kill it in
fault tests), and stopping the servers the fixtures start."""

from __future__ import annotations

import subprocess
from pathlib import Path


def pids_of(*args: str, containing: str = "") -> list[int]:
    """Pids of processes whose command line has each of ``args`` as a whole argument and
    ``containing`` inside some argument (e.g. ``pids_of("elmo_pretrain.cli", "train",
    containing=run_dir)``: the trainers of one run, not its ``prepare``)."""
    want = [a.encode() for a in args]
    part = containing.encode()
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            argv = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if all(a in argv for a in want) and any(part in a for a in argv):
            out.append(int(p.name))
    return out


def terminate(proc: subprocess.Popen | None, wait: float = 5) -> None:
    """SIGTERM, ``wait`` seconds to exit, then SIGKILL; nothing if it already ended."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(wait)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
