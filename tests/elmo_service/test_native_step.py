"""The native kernels (the single-sentence step loop, the filter lookup) import and run where
numba can cache nothing, recompile a damaged cache, and their sigmoid is exact enough."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_no_writable_cache_folder_is_not_an_import_error(tmp_path):
    """Every cache locator refusing (a read-only install and no writable home) used to
    raise at import through ``cache=True``; now the loop compiles per process."""
    code = textwrap.dedent(
        """
        import numba.core.caching as caching

        def refuse(self):
            raise PermissionError("read-only")

        caching._CacheLocator.ensure_cache_path = refuse  # every locator's writability check
        from elmo_service.bilm.kernels import native_filters, native_step

        assert native_step.lstmp_row._cache.__class__.__name__ == "NullCache"
        assert native_step.lstm_cell._cache.__class__.__name__ == "NullCache"
        assert native_filters.char_filters._cache.__class__.__name__ == "NullCache"
        native_step.compile_now()
        native_filters.compile_now()
        print("ran")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ran"


WARM = """
from elmo_service.bilm.kernels.cpu_bilm import CpuBiLM, compile_kernels
from elmo_service.bilm.model import BiLM
from tests.support.configs import small_test_config
import torch

compile_kernels()
model = BiLM(small_test_config()).eval()
x = torch.randn(2, 4, model.cfg.projection_dim)
kernel = CpuBiLM(model)
one = kernel.contextualize(x[:1], torch.tensor([4]))  # the single-sentence loop
two = kernel.contextualize(x, torch.tensor([4, 2]))  # the batched cell
print(float((one[:, 0] - two[:, 0]).abs().max()) < 1e-5)
"""


def _seed_numba_cache(cache_dir: Path) -> None:
    """numba's cache of the kernels as the suite's own runs wrote it beside the sources (when
    one did), copied where ``NUMBA_CACHE_DIR=cache_dir`` looks: the first run then loads the
    kernels instead of compiling all of them (~25 s on 2 cores); what a damaged file does is
    unchanged. With nothing to copy, the first run compiles, as before."""
    from numba.core.caching import UserProvidedCacheLocator

    kernels = ROOT / "elmo_service" / "bilm" / "kernels"
    sub = UserProvidedCacheLocator.get_suitable_cache_subpath(str(kernels / "native_step.py"))
    (cache_dir / sub).mkdir(parents=True, exist_ok=True)
    for f in (kernels / "__pycache__").glob("*.nb[ic]"):
        shutil.copy(f, cache_dir / sub / f.name)


@pytest.mark.slow  # three fresh interpreters, one or two of them compiling (~1 min on 2 cores)
def test_a_damaged_cache_file_is_recompiled_with_a_warning(tmp_path):
    """#28 item 13: garbage and zero-length cache files (a real NUMBA_CACHE_DIR) used to fail
    the first call (serve's warm-up) with a raw traceback."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    _seed_numba_cache(tmp_path)

    def warm() -> subprocess.CompletedProcess:
        run = {"cwd": ROOT, "env": env, "capture_output": True, "text": True, "timeout": 300}
        return subprocess.run([sys.executable, "-c", WARM], **run)

    first = warm()
    assert first.returncode == 0, first.stderr[-2000:]
    files = sorted(tmp_path.rglob("*.nbc"))
    assert {f.name.split("-")[0] for f in files} >= {
        "native_step.lstmp_row",
        "native_step.lstm_cell",
        "native_filters.char_filters",
    }
    for f in files:
        if "lstmp_row" in f.name:
            f.write_bytes(os.urandom(300))  # garbage
        elif "lstm_cell" in f.name:
            f.write_bytes(b"")  # zero length
    damaged = warm()
    assert damaged.returncode == 0, damaged.stderr[-2000:]
    assert damaged.stdout.strip() == "True"
    assert "Traceback" not in damaged.stderr
    for name in ("lstmp_row", "lstm_cell"):
        assert (
            f"numba's cache of {name}" in damaged.stderr and "compiling it again" in damaged.stderr
        )
    again = warm()  # the recompile wrote good files back
    assert again.returncode == 0 and "compiling it again" not in again.stderr, again.stderr


def test_the_compiled_loop_is_cached_where_a_folder_is_writable():
    from elmo_service.bilm.kernels import native_filters, native_step

    assert type(native_step.lstmp_row._cache).__name__ == "FunctionCache"
    assert type(native_step.lstm_cell._cache).__name__ == "FunctionCache"
    assert type(native_filters.char_filters._cache).__name__ == "FunctionCache"


def test_the_vectorized_sigmoid_is_within_1e7_of_float64():
    """The loop's float32 sigmoid (range reduction, polynomial, 2^k from exponent bits)
    against the float64 one: the whole finite range, the clamps and both tails."""
    import numpy as np

    from elmo_service.bilm.kernels.native_step import _sigmoid

    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.standard_normal(4000) * 6,
            np.linspace(-120, 120, 4001),
            [0.0, -0.0, 1e-30, -1e-30, 87.0, -87.0, 88.0, -88.0, 89.0, -89.0, 3.4e38, -3.4e38],
        ]
    ).astype(np.float32)
    with np.errstate(over="ignore"):
        want = 1.0 / (1.0 + np.exp(-x.astype(np.float64)))
    got = x.copy()
    _sigmoid(got, len(got), np.empty(len(got), np.int32))
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() < 1e-7
    nan = np.array([np.nan], np.float32)
    _sigmoid(nan, 1, np.empty(1, np.int32))
    assert np.isnan(nan[0])  # not hidden by the clamps
    # only the first n values change
    part = x.copy()
    _sigmoid(part, 10, np.empty(10, np.int32))
    np.testing.assert_array_equal(part[10:], x[10:])
    np.testing.assert_array_equal(part[:10], got[:10])
