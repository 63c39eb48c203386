"""The collection order `make test` relies on (tests/conftest.py): the slowest files first,
each file's tests together and in their order."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tests.conftest import file_weights, heaviest_files_first

ROOT = Path(__file__).resolve().parents[1]


def test_every_weighted_file_exists():
    weights = file_weights()
    assert weights and all(w > 0 for w in weights.values())
    missing = [p for p in weights if not (ROOT / p).is_file()]
    assert not missing, f"tests/file_weights.txt names files that are gone: {missing}"


def test_heavy_files_first_and_each_file_kept_whole_and_in_order():
    heavy, light = sorted(file_weights().items(), key=lambda kv: -kv[1])[:2]
    ids = [
        "tests/a_test.py::one",
        f"{light[0]}::x",
        "tests/a_test.py::two",
        f"{heavy[0]}::y",
        "tests/b_test.py::one",
        f"{light[0]}::z",
    ]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    heaviest_files_first(items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == [
        f"{heavy[0]}::y",
        f"{light[0]}::x",
        f"{light[0]}::z",
        "tests/a_test.py::one",
        "tests/a_test.py::two",
        "tests/b_test.py::one",
    ]
