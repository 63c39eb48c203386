"""The HTTP side of an answer: finite-checked encoding.

What a sentence's layers become (layer subsets, mixes, words, pooling, in one order) is
the core's ``elmo_service/outputs.py`` (the words' spans: ``outputs.positions``), the same
for the library, the CLIs and the API.
"""

from __future__ import annotations

import numpy as np

from elmo_api.encoding import DType, Encoding, as_dtype, encode_array
from elmo_service.errors import ElmoServiceError, InputError
from elmo_service.scalar_mix import softmax

__all__ = ["NonFiniteOutput", "encode_checked", "softmax"]

FLOAT16_MAX = float(np.finfo(np.float16).max)


class NonFiniteOutput(ElmoServiceError):
    """The model itself produced a non-finite value (a server fault: answered 500)."""

    code = "non_finite_output"


def encode_checked(
    x: np.ndarray, encoding: Encoding, dtype: DType, *, what: str, cause: str | None
) -> dict:
    """:func:`encode_array` that never lets a NaN or inf out (one pass over the output).

    A float16 overflow names ``dtype``; a mix that overflowed names ``cause`` (the
    request field that scaled it: ``gamma``, ``mix`` or ``task``); non-finite layers
    are the model's fault and raise NonFiniteOutput naming ``what``.
    """
    with np.errstate(over="ignore"):  # a float16 overflow is reported below, naming dtype
        arr = as_dtype(x, dtype)
    if not np.isfinite(arr).all():
        if arr.dtype.itemsize == 2 and np.isfinite(x).all():
            top = float(np.abs(x).max())
            raise InputError(
                f"{what}: values reach {top:.4g}, beyond float16's range (+-{FLOAT16_MAX:g}); "
                "ask for dtype float32",
                field="dtype",
            )
        if cause is not None:
            raise InputError(
                f"{what}: the mix gives non-finite values; use a smaller {cause}", field=cause
            )
        raise NonFiniteOutput(f"{what}: the model produced non-finite values", field=what)
    return encode_array(arr, encoding, dtype)
