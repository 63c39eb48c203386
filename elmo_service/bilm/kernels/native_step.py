"""One sentence's LSTMP step loop in native code (numba), for the serving kernel.

    xg [T, 4C] (input gates, hoisted) --> out [T, P] (the layer's output for one direction)

One loop for the three weight formats (fp32, and the compact int8 / bf16 of
``native_rounded.py``): the format's two products (``_gates``, ``_project``) are
chosen at compile time from the weights' array type, so numba compiles one
specialisation per format, each with the products inlined, as the three loops were.

At one row each step of a layer is a matrix-vector product that streams the
recurrent weights (2.5 MB for a 1024/128 layer) plus ~10 element-wise ops on
4C values. Written as torch calls, that is ~12 Python-level calls a step,
which hold the GIL between them: the two directions cannot run on the two
cores at once (slower on two Python threads than on one: ``docs/bench-embedder.md``).
Compiled by numba with ``nogil=True``, the whole loop of a layer is one call
that releases the GIL, so :class:`~elmo_service.bilm.kernels.bilstm.BiLstmKernel`
runs each direction on its own core.

The math is ``BiLstmKernel``'s, on the pre-scaled weights of a
:class:`~elmo_service.bilm.kernels.bilstm.ScaledLayer` (g-gate rows doubled, the
cell kept doubled, ``W_proj`` doubled), whose methods are the only callers.
NOTE: ``_cell_row`` reads exactly that layout; change the two together.
Products are summed in float32 in a fixed order, the gate functions in float32
by :func:`_sigmoid` (written so that the compiler vectorizes it): the same
numbers on every call, a few float32 ulps from the torch loop's.

Compilation and the on-disk cache: ``kernels/jit.py``. Measured speed-ups:
``docs/bench-embedder.md``.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.extending import overload

from elmo_service.bilm.kernels.jit import JIT_OPTIONS, compile_checked, enable_caching
from elmo_service.bilm.kernels.native_rounded import BLOCK, matvec_compact

# float32 constants, so that the arithmetic stays in float32 (8 lanes of AVX2)
_F = np.float32
_LOG2E, _LN2_HI, _LN2_LO = _F(1.4426950408889634), _F(0.693359375), _F(-2.1219444e-4)
_EXP_LO, _EXP_HI = _F(-87.0), _F(88.0)  # 2^k stays a normal float32
_ONE, _HALF, _TWO, _FOUR = _F(1.0), _F(0.5), _F(2.0), _F(4.0)
_T2, _T3, _T4, _T5, _T6, _T7 = (
    _F(1 / 2),
    _F(1 / 6),
    _F(1 / 24),
    _F(1 / 120),
    _F(1 / 720),
    _F(1 / 5040),
)


@numba.njit(**JIT_OPTIONS)
def _sigmoid(x: np.ndarray, n: int, bits: np.ndarray) -> None:  # pragma: no cover
    """``x[:n] <- 1 / (1 + exp(-x[:n]))`` in float32, in two loops the compiler vectorizes.

    ``exp(v) = 2^k exp(r)``: ``k = round(v / ln 2)``, ``r = v - k ln 2`` (ln 2 in two
    parts, so ``r`` is exact to float32), ``|r| <= ln 2 / 2``, where the degree-7 Taylor
    polynomial is within 5e-9 of ``exp(r)``; ``2^k`` is built in ``bits`` (int32
    exponent field, read back as float32). Within 1e-7 of the float64 sigmoid
    (``tests/elmo_service/test_native_step.py``); NaN stays NaN. 3.5-7x faster than
    libm's scalar ``exp`` here.
    """
    for j in range(n):
        v = min(max(-x[j], _EXP_LO), _EXP_HI)
        k = np.floor(v * _LOG2E + _HALF)
        r = (v - k * _LN2_HI) - k * _LN2_LO
        x[j] = (
            (((((_T7 * r + _T6) * r + _T5) * r + _T4) * r + _T3) * r + _T2) * r + _ONE
        ) * r + _ONE
        bits[j] = (np.int32(k) + np.int32(127)) << np.int32(23)
    scale = bits.view(np.float32)
    for j in range(n):
        x[j] = _ONE / (_ONE + x[j] * scale[j])


@numba.njit(**JIT_OPTIONS)
def _add_matvec(y: np.ndarray, x: np.ndarray, w: np.ndarray) -> None:  # pragma: no cover
    """``y += x @ w`` for ``x [K]``, ``w [K, N]`` (rows contiguous), ``y [N]``.

    Four rows of ``w`` per pass over ``y``: one load and store of ``y`` for four
    multiply-adds instead of one (5-7 % off the small shape's biLSTM at one row).
    """
    k_all, n = w.shape
    k4 = k_all - k_all % 4
    for k in range(0, k4, 4):
        x0, x1, x2, x3 = x[k], x[k + 1], x[k + 2], x[k + 3]
        w0, w1, w2, w3 = w[k], w[k + 1], w[k + 2], w[k + 3]
        for j in range(n):
            y[j] += (x0 * w0[j] + x1 * w1[j]) + (x2 * w2[j] + x3 * w3[j])
    for k in range(k4, k_all):
        xk, wk = x[k], w[k]
        for j in range(n):
            y[j] += xk * wk[j]


@numba.njit(**JIT_OPTIONS)
def _cell_row(
    g: np.ndarray, c2: np.ndarray, clip2: np.float32, m: np.ndarray, bits: np.ndarray
) -> None:  # pragma: no cover
    """One row's element-wise step, in place: gates ``g [4C]`` (pre-activation, g part
    doubled) become sigmoids; the doubled cell ``c2 [C]`` is updated (clipped at
    ``clip2`` when > 0); ``m [C]`` receives ``o * tanh(c) / 2``. ``bits``: ``[>= 4C]``
    scratch for :func:`_sigmoid`."""
    c = c2.shape[0]
    _sigmoid(g, 4 * c, bits)  # i, f, o, sigmoid(2 g): tanh(g) = 2 sigmoid(2 g) - 1
    for j in range(c):
        i = g[j]
        # 2c' = f * 2c + 2 i tanh(g) = (f * c2 - 2 i) + 4 i sg, as LstmLayer orders it
        v = (g[c + j] * c2[j] - _TWO * i) + _FOUR * i * g[3 * c + j]
        if clip2 > 0:
            v = min(max(v, -clip2), clip2)
        c2[j] = v
        m[j] = v
    _sigmoid(m, c, bits)
    for j in range(c):
        m[j] = (m[j] - _HALF) * g[2 * c + j]  # o * tanh(c) / 2


def _gates(g, xs, h, w, s, acc):  # pragma: no cover - numba's overload below is the code
    """``g = xs + h W_hh^T`` for one step, in the weight format of ``w``."""


def _project(h, m, w, s, acc):  # pragma: no cover - numba's overload below is the code
    """``h = m (2 W_proj^T)`` for one step, in the weight format of ``w``."""


@overload(_gates, jit_options=JIT_OPTIONS)
def _gates_of(g, xs, h, w, s, acc):  # pragma: no cover (compiled)
    # each format keeps its own order of sums: fp32 (``W^T [K, N]``) adds the products to
    # the input gates; a compact one (blocked ``[N / n, K, n]``) sums the products from zero
    # (scaled once) and adds the input after
    if w.ndim == 2:

        def fp32(g, xs, h, w, s, acc):
            for j in range(g.shape[0]):
                g[j] = xs[j]
            _add_matvec(g, h, w)

        return fp32

    def compact(g, xs, h, w, s, acc):
        matvec_compact(g, h, w, s, acc)
        for j in range(g.shape[0]):
            g[j] += xs[j]

    return compact


@overload(_project, jit_options=JIT_OPTIONS)
def _project_of(h, m, w, s, acc):  # pragma: no cover (compiled)
    if w.ndim == 2:

        def fp32(h, m, w, s, acc):
            for k in range(h.shape[0]):
                h[k] = 0.0
            _add_matvec(h, m, w)

        return fp32

    return lambda h, m, w, s, acc: matvec_compact(h, m, w, s, acc)


@numba.njit(**JIT_OPTIONS)
def lstmp_row(
    xg: np.ndarray,
    w_hh: np.ndarray,
    s_hh: np.ndarray,
    w_proj: np.ndarray,
    s_proj: np.ndarray,
    cell_clip2: float,
    proj_clip: float,
    out: np.ndarray,
) -> None:  # pragma: no cover (compiled; tests call it through BiLstmKernel)
    """One direction of one layer for one sentence, in place, from a zero state.

    ``xg [T, 4C]``: the input gates ``x W_ih^T + b`` (g rows doubled); the recurrent
    weights in one of three formats (one loop, compiled per format): fp32 ``w_hh
    [P, 4C]`` = ``W_hh^T`` (g columns doubled) and ``w_proj [C, P]`` = ``2 W_proj^T``;
    or their int8 / bf16 compact forms (``native_rounded.round_weight``) with the
    per-output scales ``s_hh [4C]``, ``s_proj [P]`` (bf16: ones; fp32: unused);
    ``cell_clip2``: twice the cell clip (0: none); ``proj_clip`` (0: none);
    ``out [T, P]`` receives ``h`` of every step.
    """
    p = out.shape[1]
    c = xg.shape[1] // 4
    h = np.zeros(p, np.float32)
    c2 = np.zeros(c, np.float32)  # 2 * cell state
    lstmp_row_from(xg, w_hh, s_hh, w_proj, s_proj, cell_clip2, proj_clip, h, c2, out)


@numba.njit(**JIT_OPTIONS)
def lstmp_row_from(
    xg: np.ndarray,
    w_hh: np.ndarray,
    s_hh: np.ndarray,
    w_proj: np.ndarray,
    s_proj: np.ndarray,
    cell_clip2: float,
    proj_clip: float,
    h: np.ndarray,
    c2: np.ndarray,
    out: np.ndarray,
) -> None:  # pragma: no cover (compiled; tests call it through BiLstmKernel)
    """:func:`lstmp_row` from the state ``h [P]``, ``c2 [C]`` (the doubled cell), which
    are updated in place to the state after the last step (document mode,
    ``elmo_service/document.py``, hands it from chunk to chunk)."""
    steps, gates = xg.shape
    p = out.shape[1]
    c = gates // 4
    clip2, pclip = _F(cell_clip2), _F(proj_clip)
    g = np.empty(gates, np.float32)
    m = np.empty(c, np.float32)
    bits = np.empty(gates, np.int32)
    acc = np.empty(BLOCK, np.float32)  # a compact format's partial sums
    for s in range(steps):
        _gates(g, xg[s], h, w_hh, s_hh, acc)
        _cell_row(g, c2, clip2, m, bits)
        _project(h, m, w_proj, s_proj, acc)
        for k in range(p):
            if pclip > 0:
                h[k] = min(max(h[k], -pclip), pclip)
            out[s, k] = h[k]


@numba.njit(**JIT_OPTIONS)
def lstm_cell(
    gates: np.ndarray, c2: np.ndarray, cell_clip2: float, m: np.ndarray
) -> None:  # pragma: no cover (compiled; tests call it through BiLstmKernel)
    """The element-wise part of a batched step, row by row (in cache), in place.

    ``gates [n, 4C]``: pre-activation, g rows doubled (they become ``sigmoid``);
    ``c2 [n, C]``: the doubled cell, updated; ``m [n, C]`` receives ``o * tanh(c) / 2``.
    ``BiLstmKernel._cell``'s arithmetic, in float32, with :func:`_sigmoid`: one call
    instead of ~8 torch ops each over the whole step.
    """
    clip2 = _F(cell_clip2)
    bits = np.empty(gates.shape[1], np.int32)
    for r in range(gates.shape[0]):
        _cell_row(gates[r], c2[r], clip2, m[r], bits)


enable_caching(lstmp_row)
enable_caching(lstmp_row_from)
enable_caching(lstm_cell)


def compile_now() -> None:
    """Compile (or load from numba's cache) :func:`lstmp_row` and :func:`lstmp_row_from` for
    the three weight formats, and :func:`lstm_cell`."""
    z = np.zeros
    xg, out, none = z((1, 8), np.float32), z((1, 2), np.float32), z(0, np.float32)
    formats = (
        (z((2, 8), np.float32), none, z((2, 2), np.float32), none),
        (z((1, 2, BLOCK), np.int8), z(8, np.float32), z((1, 2, BLOCK), np.int8), z(2, np.float32)),
        (z((1, 2, 64), np.uint16), z(8, np.float32), z((1, 2, 64), np.uint16), z(2, np.float32)),
    )
    # lstmp_row calls lstmp_row_from: the callee first, so a damaged cache file of its own
    # is met (and recompiled) by its own check
    for w in formats:
        state = (z(2, np.float32), z(2, np.float32))
        compile_checked(lstmp_row_from, xg, *w, 0.0, 0.0, *state, out)
        compile_checked(lstmp_row, xg, *w, 0.0, 0.0, out)
    compile_checked(
        lstm_cell, z((1, 8), np.float32), z((1, 2), np.float32), 0.0, z((1, 2), np.float32)
    )
