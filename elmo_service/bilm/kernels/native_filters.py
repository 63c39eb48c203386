"""The character CNN's filter bank by table lookup, in native code (numba).

    char ids [N, W] --> max over positions of each filter's windows [N, F]  (before bias and activation)

The function of :meth:`CharCNN._filters_lookup`'s torch loop (``elmo_service/bilm/model.py``),
summed in the same order, so the numbers are the same to the bit: a window of
filter ``f`` (width ``w``) starting at position ``p`` is the sum of the table rows
``k * 262 + ids[p + k]`` for ``k < w``; a token's value is the max over its windows.
Positions from a token's own padding tail on hold one repeated id, so every window
starting there is equal and one of them stands for all (the torch loop cuts at the
batch's longest token instead; the max is the same).

Why native: the torch loop is ~8 calls per filter width (index arithmetic, an
``embedding_bag``, a max), ~55 calls per batch, which cost more than the additions
for a single sentence (0.78 -> 0.27 ms for 20 tokens of the 2048-filter CNN, one
thread), and the GIL is released, so two workers can split a batch's tokens.
"""

from __future__ import annotations

import numba
import numpy as np

from elmo_service.bilm.kernels.jit import JIT_OPTIONS, compile_checked, enable_caching


@numba.njit(**JIT_OPTIONS)
def char_filters(
    ids: np.ndarray,
    flat: np.ndarray,
    widths: np.ndarray,
    n_out: np.ndarray,
    offsets: np.ndarray,
    n_ids: int,
    out: np.ndarray,
) -> None:  # pragma: no cover (compiled; tests call it through CharCNN)
    """Filter maxima for the tokens ``ids [N, W]`` (int64) into ``out [N, sum(n_out)]``.

    ``flat``: every filter's table, flattened one after the other; filter ``f``'s
    ``[widths[f] * n_ids, n_out[f]]`` table starts at ``offsets[f]``.
    """
    n_tok, w_max = ids.shape
    acc = np.empty(n_out.max(), np.float32)
    for t in range(n_tok):
        last = ids[t, w_max - 1]
        tail = w_max  # positions from `tail` on all hold `last`
        while tail > 0 and ids[t, tail - 1] == last:
            tail -= 1
        col = 0
        for f in range(widths.shape[0]):
            w, n, base = widths[f], n_out[f], offsets[f]
            # 2-D views: row indices the compiler knows are in range, so the loops vectorize
            tab = flat[base : base + w * n_ids * n].reshape((w * n_ids, n))
            o = out[t, col : col + n]
            for p in range(min(tail + 1, w_max - w + 1)):
                row = tab[ids[t, p]]
                for j in range(n):
                    acc[j] = row[j]
                for k in range(1, w):
                    row = tab[k * n_ids + ids[t, p + k]]
                    for j in range(n):
                        acc[j] += row[j]
                if p == 0:
                    for j in range(n):
                        o[j] = acc[j]
                else:
                    for j in range(n):
                        o[j] = max(o[j], acc[j])
            col += n


enable_caching(char_filters)


def compile_now() -> None:
    """Compile (or load from numba's cache) :func:`char_filters`."""
    i = np.array
    compile_checked(
        char_filters,
        np.zeros((1, 3), np.int64),
        np.zeros(2 * 2 * 1, np.float32),
        i([2], np.int64),
        i([1], np.int64),
        i([0], np.int64),
        2,
        np.zeros((1, 1), np.float32),
    )
