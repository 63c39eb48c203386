"""The local Ray cluster's reaper: ``python -m elmo_service.bulk.reaper MARKER``.

Started by the driver, in its own session, before the local cluster; its stdin is a pipe
from the driver. When the driver ends, however it ends (SIGKILL included), the pipe
closes and the reaper kills every process whose environment carries ``MARKER`` (every
process of that cluster inherits it: GCS, raylet, agents, workers). Ray ties only the
GCS and the raylet to the driver (PR_SET_PDEATHSIG); its agents and workers poll for the
raylet and were seen to outlive a killed driver by minutes, one still listening.
"""

from __future__ import annotations

import os
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


def reap(marker: str, bound_s: float = 30.0) -> int:
    """SIGKILL the marked processes until none is left (or ``bound_s`` passes); how many."""
    killed: set[int] = set()
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        pids = marked(marker)
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
    sys.stdin.buffer.read()  # returns at EOF: the driver is gone (or done)
    reap(marker)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
