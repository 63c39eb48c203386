"""bench/gpu_check.py stays runnable between the times a GPU is available.

The dry run (``--device cpu --quick``) goes through every phase the GPU run does, with tiny
shapes on a synthetic corpus, and must write a report in which every phase passed or was
skipped for a stated reason. On a machine with no CUDA device, the default ``--device cuda``
must say so, print what it would run, and exit 3.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

pytestmark = pytest.mark.slow


@pytest.mark.heavy  # ~80 s: make test-all (docs/testing.md)
def test_cpu_dry_run_writes_a_passing_report(tmp_path):
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(tmp_path)],
        env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((tmp_path / "gpu-report.json").read_text())
    phases = report["phases"]
    assert set(phases) == {
        "env", "tests", "train_default", "cpu_reference", "train_ptb", "ddp", "resume", "export",
        "serve",
    }  # fmt: skip
    for name, ph in phases.items():
        assert ph["status"] in ("ok", "skipped"), (name, ph)
        if ph["status"] == "skipped":
            assert ph["why"]
    for name in ("train_default", "train_ptb"):
        assert phases[name]["loss_falls"] and phases[name]["tokens_per_s"] > 0
    assert phases["resume"]["identical"]  # the CPU is deterministic: a resumed step is exact
    assert phases["export"]["max_abs_diff_cpu_vs_device"] == 0.0
    assert [r["batch"] for r in phases["serve"]["rows"]] == [1, 4]
    md = (tmp_path / "gpu-report.md").read_text()
    assert "all checks passed" in md and "| serve | ok |" in md


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a CPU-only machine")
def test_no_gpu_says_so_and_exits_nonzero(tmp_path):
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path)],
        env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 3
    assert "no CUDA device" in p.stderr and "It would run" in p.stderr
    assert not (tmp_path / "gpu-report.json").exists()
