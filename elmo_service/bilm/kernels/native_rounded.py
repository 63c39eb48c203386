"""Compact weights (int8 or bf16) and their matrix-vector products, in native code (numba):
the weight formats of ``native_step.lstmp_row``'s one step loop.

At one row a step streams the recurrent weights (``W_hh``, ``W_proj``): its
speed is their bytes over the memory's (or the cache's) bandwidth. fp32 is at
that bound (``docs/bench-embedder.md``); these loops read 1 byte (int8) or 2
bytes (bf16) per weight instead of 4 and widen each to fp32 in registers:

* int8: ``w = q * scale[row]`` (symmetric per output row); the products of
  the fp32 input and the widened ``q`` are summed in fp32 and scaled once per
  output. The input is never quantized: the only error is the weights' 8 bits.
* bf16: the weight's top 16 bits; widening is a 16-bit shift (exact), the
  products and sums fp32. AVX512_BF16's ``vdpbf16ps`` is not used: it would
  round the input to bf16 too (a second error), and at one row the loop is
  bound by the bytes, not the multiply-adds.

The weights are stored in blocks of outputs, ``[N / n, K, n]`` (:func:`blocked`),
each block one contiguous stream, its partial sums in L1, each of its rows
:data:`BLOCK_BYTES` long (64 bf16 or 128 int8 outputs: on the AMD EPYC here,
256-byte rows streamed from memory at half the speed; 128 or less at full). Products are summed in a fixed order: the same numbers on every call.
Only ``native_step``'s loop calls the products (through
:class:`~elmo_service.bilm.kernels.bilstm.ScaledLayer`, which holds the pre-scaled layout).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from numba.core import types
from numba.extending import intrinsic, overload

from elmo_service.bilm.kernels.jit import JIT_OPTIONS

# bytes of a block's row (see the module docstring); the most outputs of a block
BLOCK_BYTES = 128
BLOCK = BLOCK_BYTES  # the most outputs of a block (int8), the partial sums' length


def blocked(wt: np.ndarray) -> np.ndarray:
    """``W^T [K, N]`` (int8 or uint16) -> ``[ceil(N / n), K, n]`` (zero-padded), contiguous,
    ``n = BLOCK_BYTES / itemsize``."""
    k, n = wt.shape
    jb = BLOCK_BYTES // wt.dtype.itemsize
    nb = -(-n // jb)
    out = np.zeros((nb, k, jb), dtype=wt.dtype)
    for b in range(nb):
        part = wt[:, b * jb : (b + 1) * jb]
        out[b, :, : part.shape[1]] = part
    return out


def round_weight(w: torch.Tensor, mode: str) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """``W [N, K]`` rounded once for ``mode`` ("int8": symmetric per output row, scale
    ``max |w_row| / 127``; "bf16": to nearest even) -> (the rounded ``W`` in fp32 for the
    batched matmuls, the blocked compact ``W^T`` for the loops here, the per-output scales:
    ones for bf16). Both forms hold the same numbers: the error is the rounding alone."""
    w = w.detach().float()
    if mode == "int8":
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-30)
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        rounded = q.float() * scale[:, None]
        return rounded, blocked(q.t().contiguous().numpy()), scale.numpy()
    if mode == "bf16":
        b = w.to(torch.bfloat16)
        bits = b.view(torch.int16).t().contiguous().numpy().view(np.uint16)
        return b.float(), blocked(bits), np.ones(w.shape[0], np.float32)
    raise ValueError(f"no compact form for {mode!r}")


@intrinsic
def _widen_bf16(typingctx, bits):  # pragma: no cover (compiled)
    """bf16 bits (uint16) -> float32: the bits shifted to the top half, reinterpreted
    (exact). An LLVM bitcast, so the loops around it vectorize."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        i32 = context.get_value_type(types.uint32)
        wide = builder.shl(builder.zext(args[0], i32), i32(16))
        return builder.bitcast(wide, context.get_value_type(types.float32))

    return sig, codegen


def _widen(v):  # pragma: no cover - numba's overload below is the code
    """A compact weight -> float32: int8 converted, bf16 bits widened (both exact)."""


@overload(_widen, jit_options=JIT_OPTIONS)
def _widen_of(v):  # pragma: no cover (compiled)
    if v == types.uint16:
        return lambda v: _widen_bf16(v)
    return lambda v: np.float32(v)


@numba.njit(**JIT_OPTIONS)
def matvec_compact(
    out: np.ndarray, x: np.ndarray, w: np.ndarray, scale: np.ndarray, acc: np.ndarray
) -> None:  # pragma: no cover (compiled)
    """``out[j] = scale[j] * sum_k x[k] w[k, j]`` for ``w`` a blocked compact ``W^T``
    (int8 ``q``, or bf16 bits with ``scale`` ones: exact), summed in fp32."""
    nb, k_all, jb = w.shape
    n = out.shape[0]
    k4 = k_all - k_all % 4
    for b in range(nb):
        for j in range(jb):
            acc[j] = 0.0
        wb = w[b]
        for k in range(0, k4, 4):
            x0, x1, x2, x3 = x[k], x[k + 1], x[k + 2], x[k + 3]
            w0, w1, w2, w3 = wb[k], wb[k + 1], wb[k + 2], wb[k + 3]
            for j in range(jb):
                acc[j] += (x0 * _widen(w0[j]) + x1 * _widen(w1[j])) + (
                    x2 * _widen(w2[j]) + x3 * _widen(w3[j])
                )
        for k in range(k4, k_all):
            xk, wk = x[k], wb[k]
            for j in range(jb):
                acc[j] += xk * _widen(wk[j])
        base = b * jb
        for j in range(min(jb, n - base)):
            out[base + j] = acc[j] * scale[base + j]
