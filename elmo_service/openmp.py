"""OpenMP's idle-thread spin, chosen before torch loads libgomp (imports nothing else).

By default libgomp's idle threads spin ~300k times (a few ms) after every
parallel op, taking the cores from whatever else runs: the biLSTM's direction
workers (which start right after the character CNN's matmuls), the server's
event loop, other processes. In one process, one sentence of the small
shape: 11.9 ms with the default spin, 9.3 with none (``OMP_WAIT_POLICY=PASSIVE``,
every op then pays a sleep and a wake-up), 9.1 with a brief spin. Served, a
brief spin keeps both costs small: 1 client +2.0 ms over in-process against
+3.7 with PASSIVE, 16 clients 79 % of in-process against 71 % with the default
spin (``docs/benchmarks.md``, "Serving speed").

``spin_briefly`` sets that brief spin unless ``OMP_WAIT_POLICY`` or
``GOMP_SPINCOUNT`` is given (an explicit setting wins). ``elmo-service serve``
applies it; so does ``from elmo_service import Embedder`` when torch is not
loaded yet; the other commands use PASSIVE.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

SPINCOUNT = "30000"


def spin_briefly(environ: MutableMapping[str, str] = os.environ) -> None:
    if "OMP_WAIT_POLICY" not in environ:
        environ.setdefault("GOMP_SPINCOUNT", SPINCOUNT)
