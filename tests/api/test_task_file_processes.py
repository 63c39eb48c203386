"""The file task store shared by two processes (replicas on one volume, no Redis): no lost
updates, because every read-modify-write holds an flock and re-reads under it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

WRITER = """
import os, sys, time
from pathlib import Path
from elmo_api.tasks_store import FileTaskStore
path, who, n, go = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
store = FileTaskStore(path, "tiny")
while not go.exists():
    time.sleep(0.005)
for i in range(n):
    store.put(f"{who}{i}", {"weights": [i, 0, 0], "gamma": 1.0})
    if i % 3 == 0:
        store.delete(f"{who}{i}")
"""


@pytest.mark.slow  # two subprocesses importing torch
def test_two_processes_writing_one_file_lose_no_update(tmp_path: Path) -> None:
    path, go, n = tmp_path / "tasks.json", tmp_path / "go", 60
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(path), who, str(n), str(go)], env=env)
        for who in ("a", "b")
    ]
    time.sleep(1.0)  # both imported and waiting
    go.touch()
    for p in procs:
        assert p.wait(60) == 0
    stored = json.loads(path.read_text())["tiny"]
    want = {f"{who}{i}" for who in "ab" for i in range(n) if i % 3}
    assert set(stored) == want, f"lost: {sorted(want - set(stored))[:5]}"
    assert stored["b59"]["weights"] == [59, 0, 0]
