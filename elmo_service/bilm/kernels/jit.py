"""numba settings shared by the native kernels, and their on-disk cache.

numba compiles a kernel on first use (~1-2.5 s here) and keeps the machine
code on disk (next to the module, or in numba's per-user cache when that is
not writable; ~0.2 s to load), so only a process's first call pays; the
embedder's ``warm_up`` makes that call, and the Docker image is built with
the cache filled (``CpuBiLM.compile_kernels``). Where no folder is writable (a
read-only container without a home), each process compiles once instead of
failing; a damaged cache file (truncated, garbage) is recompiled with a
warning instead of failing the first call.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

log = logging.getLogger(__name__)

# error_model="numpy": a division by zero gives inf instead of a Python exception, so the
# division needs no branch and the loops vectorize
JIT_OPTIONS = dict(nogil=True, boundscheck=False, error_model="numpy")


def enable_caching(fn: Any) -> None:
    """The decorator's ``cache=True``, except that numba finding no writable cache folder
    (it raises RuntimeError) means compiling once per process, not failing the import."""
    with contextlib.suppress(RuntimeError):
        fn.enable_caching()


def compile_checked(fn: Any, *args: Any) -> None:
    """Call ``fn(*args)`` once so that numba compiles it or loads it from its cache.

    A damaged cache entry makes numba's loader raise whatever its unpickling or LLVM
    hits (``EOFError`` for a zero-length file, an LLVM bitcode parsing error for
    garbage): the cache's index is then emptied and the kernel compiled again (the
    fresh code replaces the damaged file), with a warning naming the cache folder.
    """
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - numba's loader raises anything a bad file causes
        cache = getattr(fn, "_cache", None)
        if cache is None or type(cache).__name__ == "NullCache":
            raise  # nothing was read from disk: a real compile error
        where = getattr(cache, "cache_path", "?")
        log.warning(
            "numba's cache of %s in %s is unreadable (%s: %s); compiling it again",
            fn.__name__,
            where,
            type(e).__name__,
            str(e)[:200],
        )
        cache.flush()  # forget the damaged entries; the recompile writes fresh ones
        fn(*args)
