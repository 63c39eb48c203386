"""Inference matmuls with the weight kept in the layout the BLAS wants.

    PackedLinear(W [N, K], b [N] | None)(x [M, K], add=None) -> x W^T + b (+ add)  [M, N]

Why (measured by ``bench/bench_latency.py --kernels``; figures in ``docs/bench-embedder.md``):

* ``M >= 2`` rows: MKL's sgemm re-packs the whole weight on every call. For
  ``[20, 512] x [512, 16384]`` (an LSTM step of the original ELMo at batch
  20) that runs at ~20 % of the machine's matmul peak; oneDNN with the weight
  reordered once (``mkldnn._reorder_linear_weight``, the op inductor's
  freezing pass uses) runs at ~50-75 % of it.
* ``M == 1`` (a single sentence's recurrent step) is a matrix-vector product,
  bound by reading the weight: MKL with ``W^T [K, N]`` contiguous is faster
  than with ``W [N, K]`` for wide matrices (``N > K``), and the other way
  round for tall ones; oneDNN is slower than both here.
* ``int8`` (opt-in): fbgemm with per-output-channel int8 weights and int32
  accumulation, faster than fp32 on the big shapes. Each input row is
  scaled by its own maximum, never by the batch's, so a row's result does not
  depend on its batch mates, and is carried at ~13 bits (two 7-bit passes in
  one call), so the error is the weights' 8 bits alone.

Each packed form is built on first use, so memory is only spent on the paths
a workload takes. Callers cache instances per weight version (see
:class:`KernelCache`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from elmo_service.bilm.config import WEIGHT_MODES
from elmo_service.bilm.kernels import tuning
from elmo_service.errors import ConfigError


def check_weights_mode(weights: str) -> None:
    """Raise :class:`ConfigError` (field ``weights``) for an unknown or unsupported mode."""
    if weights not in WEIGHT_MODES:
        raise ConfigError(f"weights must be one of {WEIGHT_MODES}", field="weights")
    if weights == "int8" and not int8_available():
        raise ConfigError("weights='int8' needs an x86 CPU (fbgemm kernels)", field="weights")


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def int8_available() -> bool:
    """fbgemm / x86 quantized kernels (x86 CPUs with AVX2)."""
    engines = torch.backends.quantized.supported_engines
    return torch.backends.quantized.engine in ("x86", "fbgemm") and (
        "x86" in engines or "fbgemm" in engines
    )


# ``transposed_below`` for "every row count on W^T": more rows than any batch holds
EVERY_STEP = 1 << 20


class PackedLinear:
    """``x W^T + b`` for inference, the weight packed once (see the module docstring).

    ``int8``: for weights of at least ``tuning.INT8_MIN_ELEMENTS`` (smaller ones stay
    fp32), int8 weights quantized per output row; each input row is scaled by
    its own ``max |x|`` and carried at ~13 bits (see :meth:`_int8_call`), so a
    row's result depends on nothing else in the batch.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None, *, int8: bool = False):
        self.weight = weight.detach().float().contiguous()  # [N, K]
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.n, self.k = self.weight.shape
        self._wt: Tensor | None = None  # W^T [K, N] contiguous, for MKL
        self._onednn: Tensor | None = None
        self._cpu = self.weight.device.type == "cpu"
        self._use_onednn = (
            self._cpu
            and onednn_available()
            and (self.n > self.k or self.n * self.k >= tuning.ONEDNN_MIN_ELEMENTS)
        )
        self._int8: Any = None
        self._transposed_below = 0
        if int8 and self.n * self.k >= tuning.INT8_MIN_ELEMENTS:
            self._int8 = _int8_pack(self.weight)
            self.weight = None  # type: ignore[assignment]  # the int8 pack replaces it

    @property
    def transposed_below(self) -> int:
        """Below this many rows, a matrix with ``W^T`` runs on it (MKL) rather than on
        oneDNN's pack: which is faster depends on the CPU (kernels/calibrate.py measures it).
        Set to :data:`EVERY_STEP`, the pack is let go (built again from ``W^T`` if asked)."""
        return self._transposed_below

    @transposed_below.setter
    def transposed_below(self, rows: int) -> None:
        self._transposed_below = rows
        if rows >= EVERY_STEP and self._wt is not None:
            self._onednn = None

    def use_transposed(self, wt: Tensor) -> None:
        """Use ``wt`` (``W^T [K, N]``, contiguous) instead of building a copy."""
        assert wt.shape == (self.k, self.n) and wt.is_contiguous()
        self._wt = wt

    def pack_now(self) -> PackedLinear:
        """Pack for several rows now and drop the fp32 ``[N, K]`` copy (a big model's
        weights are then held once per layout they run in). A single row then runs
        on ``W^T`` when one was given, else on the oneDNN pack. With ``W^T`` given, the
        pack waits for its first use and is built from it: a route that runs every row
        count on ``W^T`` never holds one."""
        if self._int8 is None and self._use_onednn:
            if self._wt is None:
                self._onednn = torch.ops.mkldnn._reorder_linear_weight(self.weight, None)
            self.weight = None  # type: ignore[assignment]
        return self

    @property
    def is_int8(self) -> bool:
        return self._int8 is not None

    def __call__(self, x: Tensor, add: Tensor | None = None, out: Tensor | None = None) -> Tensor:
        """``x [M, K]`` -> ``[M, N]``; ``add [M, N]`` is added (in the same call where the kernel
        can); ``out``: written there (MKL's calls write it directly: a step allocates nothing)."""
        if self._int8 is not None:
            y = self._int8_call(x, add)
            return y if out is None else out.copy_(y)
        rows = x.shape[0]
        single = rows == 1 and (self.weight is not None or self._wt is not None)
        if self._use_onednn and not single and (rows >= self.transposed_below or self._wt is None):
            if self._onednn is None:
                w = self.weight if self.weight is not None else self._wt.t().contiguous()
                self._onednn = torch.ops.mkldnn._reorder_linear_weight(w, None)
            if add is None:
                y = torch.ops.mkldnn._linear_pointwise(x, self._onednn, self.bias, "none", [], "")
            else:
                y = torch.ops.mkldnn._linear_pointwise.binary(
                    x, add, self._onednn, self.bias, "add"
                )
            return y if out is None else out.copy_(y)
        if rows == 1 and self.n <= self.k and self.weight is not None:
            w = self.weight.t()  # a single row streams tall matrices fastest as stored
        else:
            if self._wt is None:
                self._wt = self.weight.t().contiguous()
            w = self._wt
        if add is None:
            if self.bias is None:
                return torch.mm(x, w, out=out)
            return torch.addmm(self.bias, x, w, out=out)
        return torch.addmm(add if self.bias is None else add + self.bias, x, w, out=out)

    def _int8_call(self, x: Tensor, add: Tensor | None) -> Tensor:
        """int8 weights; each input row carried at ~13 bits as two 7-bit rows of one call.

        fbgemm's AVX2 kernel takes 7-bit inputs (it sums pairs of u8 * s8 products
        in int16, which 8 bits overflow). With ``s`` the row's ``max |x|`` and
        ``u = 63 x / s``: ``hi = round(u)``, ``lo = 63 (u - hi)``, and
        ``x W^T = s / 63 (hi W^T + round(lo) W^T / 63)`` up to ``s / 8000`` per
        input. The weights, read once, serve both rows; the error left is that
        of the weights' 8 bits.
        """
        m = x.shape[0]
        s = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30)  # [M, 1]
        u = x * (63.0 / s)
        hi = torch.round(u)
        lo = u.sub_(hi).mul_(63.0)
        qlinear = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32
        y2 = qlinear(torch.cat([hi, lo]), 1.0, 64, self._int8)  # [2M, N]
        y = torch.add(y2[:m], y2[m:], alpha=1.0 / 63.0)
        if add is not None and self.bias is not None:
            add = add + self.bias
        base = add if add is not None else self.bias
        return y.mul_(s / 63.0) if base is None else torch.addcmul(base, y, s / 63.0)


def _int8_pack(weight: Tensor) -> Any:
    """fbgemm-packed int8 weight, symmetric per output row (scale = max |w| / 127)."""
    scale = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
    zero = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        # the quantized-tensor constructors are marked deprecated in favour of
        # torchao; the fbgemm kernels they feed are what this CPU has
        warnings.simplefilter("ignore")
        q = torch.quantize_per_channel(weight, scale, zero, 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(q, None)


class KernelCache(dict):
    """Per-module cache of kernel-layout weights, keyed on the source weights' versions.

    An in-place update (optimizer step, ``load_state_dict``) bumps a tensor's
    ``_version``; ``.to()`` or re-assigning ``.data`` moves its ``data_ptr``:
    either rebuilds the entry. Never copied (``deepcopy`` of the module gets
    an empty cache) and never part of a ``state_dict``.
    """

    def __deepcopy__(self, memo) -> KernelCache:
        return KernelCache()

    def get_or_build(
        self, slot: Any, params: Sequence[Tensor], build: Callable[[], Any], extra: tuple = ()
    ) -> Any:
        key = (*extra, *((p.data_ptr(), p._version) for p in params))
        hit = super().get(slot)
        if hit is None or hit[0] != key:
            with torch.no_grad():
                hit = (key, build())
            self[slot] = hit
        return hit[1]
