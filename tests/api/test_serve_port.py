"""`elmo-service serve` on a port that is taken says so at once, before the model loads."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_a_port_in_use_is_one_line_before_the_model_loads(tiny_model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        p = subprocess.run(
            [sys.executable, "-m", "elmo_cli.main", "serve", "--port", str(port),
             "--model", str(tiny_model_dir), "--threads", "1"],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "--port" in lines[0], lines
    assert "kernel:" not in p.stderr and "Traceback" not in p.stderr  # no model was loaded


def test_serve_says_where_it_listens(tiny_model_dir):
    """uvicorn, handed a bound socket, cannot name the address: the service says it (#51)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(
        [sys.executable, "-m", "elmo_cli.main", "serve", "--port", str(port),
         "--model", str(tiny_model_dir), "--threads", "1"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env,
    )  # fmt: skip
    seen = []
    try:
        for line in p.stderr:  # once the model is loaded; the pipe ends with p
            seen.append(line)
            if "listening on" in line:
                break
    finally:
        p.terminate()
        p.wait(timeout=60)
    assert any(f"listening on http://127.0.0.1:{port}" in line for line in seen), seen
