"""atomic_dir replaces a folder in one exchange: a reader never finds it missing (#28 item 8)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest

from elmo_service import atomic

READER = """
import json, sys, time
path, stop = sys.argv[1], sys.argv[2] + "/stop"
reads = misses = 0
seen = set()
import os
while not os.path.exists(stop):
    try:
        with open(path) as f:
            seen.add(json.load(f)["v"])
    except FileNotFoundError:
        misses += 1
    reads += 1
print(json.dumps([reads, misses, len(seen)]))
"""


def _replace_while_reading(out, rounds: int) -> tuple[int, int, int]:
    """Replace ``out`` ``rounds`` times while another process reads its manifest in a loop
    (its own process: no GIL between the reader and the renames);
    -> (reads, misses, distinct versions seen)."""
    flag = out.parent / "flag"
    flag.mkdir()
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, str(out / "manifest.json"), str(flag)],
        stdout=subprocess.PIPE,
    )
    try:
        time.sleep(0.3)
        for v in range(1, rounds + 1):
            with atomic.atomic_dir(out) as d:
                (d / "manifest.json").write_text(json.dumps({"v": v}))
    finally:
        (flag / "stop").touch()
        got, _ = reader.communicate(timeout=30)
        shutil.rmtree(flag)
    reads, misses, seen = json.loads(got)
    return reads, misses, seen


def test_the_folder_is_never_missing_while_it_is_replaced(tmp_path):
    out = tmp_path / "model"
    with atomic.atomic_dir(out) as d:
        (d / "manifest.json").write_text(json.dumps({"v": 0}))
    assert atomic.exchange_paths(tmp_path / "model", tmp_path / "model"), "no renameat2 here"
    reads, misses, seen = _replace_while_reading(out, 150)
    assert reads > 150 and misses == 0
    assert json.loads((out / "manifest.json").read_text()) == {"v": 150}
    assert seen > 1  # the reader saw replacements happen
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # old folders deleted


def test_without_the_exchange_the_two_renames_still_replace_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "exchange_paths", lambda a, b: False)
    out = tmp_path / "model"
    for v in (1, 2):
        with atomic.atomic_dir(out) as d:
            (d / "manifest.json").write_text(json.dumps({"v": v}))
    assert json.loads((out / "manifest.json").read_text()) == {"v": 2}
    with pytest.raises(RuntimeError), atomic.atomic_dir(out) as d:
        (d / "manifest.json").write_text("half")
        raise RuntimeError("crash")
    assert json.loads((out / "manifest.json").read_text()) == {"v": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_exchange_errors_other_than_unsupported_raise(tmp_path):
    (tmp_path / "a").mkdir()
    with pytest.raises(FileNotFoundError):
        atomic.exchange_paths(tmp_path / "a", tmp_path / "missing")
