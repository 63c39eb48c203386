"""The local Ray cluster's reaper: ``python -m elmo_bulk.reaper MARKER``.

Started by the driver, in its own session, before the local cluster; its stdin is a pipe
from the driver. When the driver ends, however it ends (SIGKILL included), the pipe
closes and the reaper kills every process whose environment carries ``MARKER`` (every
process of that cluster inherits it: GCS, raylet, agents, workers). Ray ties only the
GCS and the raylet to the driver (PR_SET_PDEATHSIG); its agents and workers poll for the
raylet and were seen to outlive a killed driver by minutes, one still listening.

Two ways to know them, since either alone misses some: the environment marker (a process
started after the last look), and the processes under the marked children of the driver
(GCS, raylet), recorded every 0.5 s while it lives (Ray's agents rename themselves with setproctitle, which overwrites the memory
``/proc/PID/environ`` reads; once the driver is gone they are orphans of init).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

ENV = "ELMO_BULK_CLUSTER"  # its value: one run's marker


def marked(marker: str) -> list[int]:
    """The pids whose environment holds ``ENV=marker`` (readable ones: this user's)."""
    needle = f"\0{ENV}={marker}\0".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = b"\0" + f.read()
        except OSError:  # gone, or not ours
            continue
        if needle in env:
            found.append(int(name))
    return found


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, start time) of a live process, None when gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else (int(fields[1]), fields[19])


def _has_marker(pid: int, marker: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"\0{ENV}={marker}\0".encode() in b"\0" + f.read()
    except OSError:
        return False


class Family:
    """The cluster's processes, recorded while the driver lives: the driver's children
    that carry the marker (GCS, raylet: programs that keep their environment), and
    every process under them. Nothing else of the driver's is ever touched."""

    def __init__(self, driver: int, marker: str) -> None:
        self.driver, self.marker = driver, marker
        self.known: dict[int, str] = {}  # pid -> start time
        self._roots: set[tuple[int, str]] = set()

    def look(self) -> None:
        kids: dict[int, list[tuple[int, str]]] = {}
        for name in os.listdir("/proc"):
            if name.isdigit() and (st := _stat(int(name))) is not None:
                kids.setdefault(st[0], []).append((int(name), st[1]))
        for child in kids.get(self.driver, []):
            # asked again each time: a child caught between fork and exec still shows
            # the driver's first environment, without the marker
            if child not in self._roots and _has_marker(child[0], self.marker):
                self._roots.add(child)
        todo = list(self._roots)
        while todo:
            pid, start = todo.pop()
            self.known[pid] = start
            todo.extend(kids.get(pid, []))


def reap(marker: str, known: dict[int, str], bound_s: float = 30.0) -> int:
    """SIGKILL the marked processes and the ``known`` ones still alive (same start time)
    until none is left (or ``bound_s`` passes); how many were killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        alive = {p for p, start in known.items() if (st := _stat(p)) and st[1] == start}
        pids = alive | set(marked(marker))
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except OSError:
                pass
        time.sleep(0.1)
    return len(killed)


def main(argv: list[str]) -> int:
    (marker,) = argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the driver's to handle
    family = Family(os.getppid(), marker)
    stdin = sys.stdin.fileno()
    while True:  # until EOF: the driver is gone (or done)
        ready, _, _ = select.select([stdin], [], [], 0.5)
        if ready and not os.read(stdin, 4096):
            break
        family.look()
    reap(marker, family.known)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
