"""One sentence's LSTMP step loop in native code (numba), for the serving kernel.

    xg [T, 4C] (input gates, hoisted) --> out [T, P] (the layer's output for one direction)

At one row each step of a layer is a matrix-vector product that streams the
recurrent weights (2.5 MB for a 1024/128 layer) plus ~10 element-wise ops on
4C values. Written as torch calls, that is ~12 Python-level calls a step,
which hold the GIL between them: the two directions cannot run on the two
cores at once (measured 1.5x *slower* on two Python threads than on one;
``docs/bench-embedder.md``). Compiled by numba with ``nogil=True``, the whole loop of a layer
is one call that releases the GIL, so :class:`~elmo_service.bilstm.BiLstmKernel`
runs each direction on its own core.

The math is ``BiLstmKernel``'s, on its pre-scaled weights (g-gate rows doubled,
the cell kept doubled, ``W_proj`` doubled: see ``elmo_service/bilstm.py``),
products summed in float32 in a fixed order, the gate functions evaluated
in float64 and stored as float32: the same numbers on every call. They
differ from the torch loop's by a few float32 ulps (3-5e-7 on the bench
shapes), as the batched loops differ from each other.

numba compiles on first use (~1-2.5 s here) and keeps the machine code on disk
(next to this file, or in numba's per-user cache when that is not writable;
~0.2 s to load), so only a process's first single-sentence call pays; the
server's warm-up makes that call, and the Docker image is built with the
cache filled (:func:`compile_now`). Where no folder is writable (a read-only
container without a home), each process compiles once instead of failing.
"""

from __future__ import annotations

import contextlib
import math

import numba
import numpy as np


@numba.njit(nogil=True, boundscheck=False)
def lstmp_row(
    xg: np.ndarray,
    w_hh_t: np.ndarray,
    w_proj_t: np.ndarray,
    cell_clip2: float,
    proj_clip: float,
    out: np.ndarray,
) -> None:  # pragma: no cover (compiled; tests call it through BiLstmKernel)
    """One direction of one layer for one sentence, in place.

    ``xg [T, 4C]``: the input gates ``x W_ih^T + b`` (g rows doubled);
    ``w_hh_t [P, 4C]``: ``W_hh^T`` (g columns doubled); ``w_proj_t [C, P]``:
    ``2 W_proj^T``; ``cell_clip2``: twice the cell clip (0: none);
    ``proj_clip`` (0: none); ``out [T, P]`` receives ``h`` of every step.
    """
    steps, gates = xg.shape
    p = w_hh_t.shape[0]
    c = gates // 4
    h = np.zeros(p, np.float32)
    c2 = np.zeros(c, np.float32)  # 2 * cell state
    g = np.empty(gates, np.float32)
    m = np.empty(c, np.float32)
    for s in range(steps):
        # g = xg[s] + h W_hh^T, summed over h in order (rows of W_hh^T are contiguous)
        for j in range(gates):
            g[j] = xg[s, j]
        for k in range(p):
            hk = h[k]
            for j in range(gates):
                g[j] += hk * w_hh_t[k, j]
        for j in range(c):
            i = 1.0 / (1.0 + math.exp(-g[j]))
            f = 1.0 / (1.0 + math.exp(-g[c + j]))
            o = 1.0 / (1.0 + math.exp(-g[2 * c + j]))
            sg = 1.0 / (1.0 + math.exp(-g[3 * c + j]))  # sigmoid(2 g): tanh(g) = 2 sg - 1
            # 2c' = f * 2c + 2 i tanh(g) = (f * c2 - 2 i) + 4 i sg, as BiLstmKernel orders it
            v = (f * c2[j] - 2.0 * i) + 4.0 * i * sg
            if cell_clip2 > 0.0:
                v = min(max(v, -cell_clip2), cell_clip2)
            c2[j] = v
            m[j] = (1.0 / (1.0 + math.exp(-v)) - 0.5) * o  # o * tanh(c) / 2
        for k in range(p):
            h[k] = 0.0
        for j in range(c):
            mj = m[j]
            for k in range(p):
                h[k] += mj * w_proj_t[j, k]
        if proj_clip > 0.0:
            for k in range(p):
                h[k] = min(max(h[k], -proj_clip), proj_clip)
        for k in range(p):
            out[s, k] = h[k]


# the decorator's cache=True, except that numba finding no writable cache folder (it
# raises RuntimeError) means compiling once per process, not failing the import
with contextlib.suppress(RuntimeError):
    lstmp_row.enable_caching()


def compile_now() -> None:
    """Compile (or load from numba's cache) :func:`lstmp_row` now, e.g. while building
    an image, rather than on the first single-sentence request."""
    z = np.zeros
    lstmp_row(
        z((1, 8), np.float32),
        z((2, 8), np.float32),
        z((2, 2), np.float32),
        0.0,
        0.0,
        z((1, 2), np.float32),
    )
