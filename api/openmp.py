"""OpenMP settings for serving, applied before torch loads libgomp (no other imports here).

By default libgomp's idle threads spin ~300k times (a few ms) after every
parallel op, taking the cores from whatever else runs: the event loop, the
biLSTM's direction workers, other processes. With no spin
(``OMP_WAIT_POLICY=PASSIVE``, what the other commands use) every op pays a
sleep and a wake-up. ``serve`` spins briefly, which keeps both costs small:
1 client +2.0 ms over in-process against +3.7 with PASSIVE, 16 clients 79 % of
in-process against 71 % with the default spin (docs/benchmarks.md, "Serving
speed"). An explicit ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` wins.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

SERVE_SPINCOUNT = "30000"


def openmp_env_for_serving(environ: MutableMapping[str, str] = os.environ) -> None:
    if "OMP_WAIT_POLICY" not in environ:
        environ.setdefault("GOMP_SPINCOUNT", SERVE_SPINCOUNT)
