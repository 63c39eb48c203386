"""elmo_service.atomic: whole or nothing, fsync'ed, with the permissions open() gives."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest

from elmo_service import atomic


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_writes_replace_whole_files(tmp_path):
    p = tmp_path / "a.json"
    atomic.write_json(p, {"x": 1}, sort_keys=True)
    assert p.read_text() == '{\n  "x": 1\n}\n'
    atomic.write_text(p, "new")
    assert p.read_text() == "new"
    atomic.write_bytes(p, b"\x00\x01")
    assert p.read_bytes() == b"\x00\x01"
    with atomic.atomic_open(tmp_path / "a.npy", "wb") as f:
        np.save(f, np.arange(3))
    assert np.load(tmp_path / "a.npy").tolist() == [0, 1, 2]
    assert _leftovers(tmp_path) == []


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    p = tmp_path / "state.json"
    p.write_text("old")
    with pytest.raises(RuntimeError), atomic.atomic_open(p) as f:
        f.write("half of the new")
        raise RuntimeError("crash")
    assert p.read_text() == "old" and _leftovers(tmp_path) == []
    with pytest.raises(RuntimeError), atomic.atomic_path(p) as tmp:
        tmp.write_text("half")
        raise RuntimeError("crash")
    assert p.read_text() == "old" and _leftovers(tmp_path) == []


def test_data_and_folder_are_fsynced_before_and_after_the_rename(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append("fsync") or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: calls.append("replace") or real_replace(a, b))
    atomic.write_text(tmp_path / "x", "data")
    i = calls.index("replace")
    assert "fsync" in calls[:i] and "fsync" in calls[i + 1 :], calls


def test_permissions_follow_the_umask_not_mkstemp(tmp_path):
    old = os.umask(0o022)
    try:
        atomic.write_text(tmp_path / "f", "x")
        with atomic.atomic_dir(tmp_path / "d") as d:
            (d / "inner").write_text("y")
        # a writer that replaces the file it was handed with its own 0600 one
        with atomic.atomic_path(tmp_path / "g") as t:
            t.unlink()
            os.close(os.open(t, os.O_WRONLY | os.O_CREAT, 0o600))
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "g").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o755


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_every_file_of_an_artifact_follows_the_umask(tmp_path, mask):
    """safetensors writes its file 0600; the artifact's weights must be as readable as its
    config (an API container reading what a worker, another user, exported)."""
    from tests.support.core_fixtures import tiny_artifact

    old = os.umask(mask)
    try:
        assert atomic.process_umask() == mask
        art = tiny_artifact(tmp_path / "m")
    finally:
        os.umask(old)
    files = [p for p in art.rglob("*") if p.is_file()]
    assert any(p.name == "weights.safetensors" for p in files)
    for p in files:
        assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~mask, p.name


def test_atomic_dir_swaps_a_folder_in_whole_and_keeps_the_old_one_on_failure(tmp_path):
    out = tmp_path / "corpus"
    with atomic.atomic_dir(out) as d:
        (d / "manifest.json").write_text(json.dumps({"v": 1}))
    with atomic.atomic_dir(out) as d:
        (d / "manifest.json").write_text(json.dumps({"v": 2}))
        assert json.loads((out / "manifest.json").read_text()) == {"v": 1}  # not yet
    assert json.loads((out / "manifest.json").read_text()) == {"v": 2}
    with pytest.raises(RuntimeError), atomic.atomic_dir(out) as d:
        (d / "manifest.json").write_text("half")
        raise RuntimeError("crash")
    assert json.loads((out / "manifest.json").read_text()) == {"v": 2}
    assert _leftovers(tmp_path) == []
