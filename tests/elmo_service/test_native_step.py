"""The native single-sentence step loop imports and runs where numba can cache nothing."""

import subprocess
import sys
import textwrap
from pathlib import Path

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
        from elmo_service import native_step

        assert native_step.lstmp_row._cache.__class__.__name__ == "NullCache"
        native_step.compile_now()
        print("ran")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ran"


def test_the_compiled_loop_is_cached_where_a_folder_is_writable():
    from elmo_service import native_step

    assert type(native_step.lstmp_row._cache).__name__ == "FunctionCache"
