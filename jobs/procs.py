"""Processes: a runner's identity (host, pid, start time, pid namespace) and whether it
still lives, and the parent-death signal that keeps trainers from outliving their runner."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
from pathlib import Path

from elmo_jobs.state import Runner

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Linux: get ``sig`` when the parent process dies (no orphaned trainers)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)


def child_setup() -> None:
    """``preexec_fn`` of phase processes: runs in the forked child, before exec."""
    die_with_parent(signal.SIGTERM)


def proc_start(pid: int) -> str | None:
    """A process's start time (``/proc/<pid>/stat``), None if it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        if not Path("/proc/self/stat").exists():  # no procfs: fall back to signal 0
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return None
            except PermissionError:
                pass
            return "?"
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]  # field 22 of stat: starttime


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def runner_info(worker: str | None = None) -> Runner:
    pid = os.getpid()
    return Runner(
        host=socket.gethostname(),
        pid=pid,
        pid_start=proc_start(pid),
        pid_ns=_pid_namespace(),
        worker=worker,
    )


def runner_alive(r: Runner) -> bool | None:
    """True/False for a runner whose pids we can see; None when it runs elsewhere."""
    if r.host != socket.gethostname() or r.pid_ns != _pid_namespace():
        return None
    start = proc_start(r.pid)
    return start is not None and (r.pid_start in (None, "?") or start == r.pid_start)
