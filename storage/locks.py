"""File locks, one way: an exclusive ``flock`` on a lock file of its own."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def file_lock(path: Path, mode: int = 0o644) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created, with its folder, if missing), across
    processes and threads: each call opens its own descriptor, so two threads of one
    process exclude each other too. Closing the descriptor releases it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
