"""One process setup: OpenMP's idle spin and the thread count, decided by the process's role.

    configure_process("serve" | "worker" | "cli" | "train" | "library", threads=None)

Called once at each entry point (``elmo-service serve`` / ``worker`` / the core
commands, ``elmo-pretrain``, a script that embeds), before torch loads: OpenMP
(libgomp) reads its settings once, when torch loads it.

* **Spin.** By default libgomp's idle threads spin ~300k times (a few ms) after
  every parallel op, taking the cores from whatever else runs. Where a model
  answers requests on the process's threads (``serve``, ``library``) a brief
  spin (``tuning.OMP_SPINCOUNT``) keeps both the wake-up cost and the stolen
  time small; the batch commands (``worker``, ``cli``, ``train``) never spin
  (``OMP_WAIT_POLICY=PASSIVE``): spinning threads collapse when another process
  shares the cores. An explicit ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` in the
  environment wins. Measurements: ``docs/bench-embedder.md``.
* **Threads.** ``threads``, else ``ELMO_THREADS``, else all cores: always an
  explicit count (``runtime.set_threads``).

Imports no torch at module level.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping

from elmo_service.bilm.kernels.tuning import OMP_SPINCOUNT
from elmo_service.errors import ConfigError

log = logging.getLogger(__name__)

ROLES = ("serve", "worker", "cli", "train", "library")
SPINNING_ROLES = ("serve", "library")  # a model answers on this process's threads


def openmp_environment(role: str, environ: MutableMapping[str, str] = os.environ) -> None:
    """Set OpenMP's wait policy for ``role`` in ``environ`` unless it already says one."""
    if role not in ROLES:
        raise ConfigError(f"role must be one of {ROLES}", field="role")
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return  # an explicit setting wins
    if role in SPINNING_ROLES:
        environ["GOMP_SPINCOUNT"] = OMP_SPINCOUNT
    else:
        environ["OMP_WAIT_POLICY"] = "PASSIVE"


def configure_process(
    role: str, threads: int | None = None, *, set_threads: bool = True
) -> int | None:
    """OpenMP's spin for ``role``, then the thread count; returns the count set.

    ``set_threads=False`` leaves the count to a later call of
    ``runtime.set_threads`` (a server reads it from its settings after loading
    them). Too late for the spin when torch is already loaded: logged, not fatal.
    """
    if "torch" in sys.modules:
        log.debug("configure_process(%r): torch is loaded, OpenMP's spin is already fixed", role)
    openmp_environment(role)
    if not set_threads:
        return None
    from elmo_service.runtime import set_threads as apply

    return apply(threads)
