"""`elmo-service serve` spins OpenMP's idle threads briefly; the other commands do not spin;
an explicit setting wins. Checked in fresh interpreters: the settings only work before torch
loads libgomp."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from api.openmp import SERVE_SPINCOUNT

ROOT = Path(__file__).resolve().parents[2]
PROBE = (
    "import sys; sys.argv = ['elmo-service'] + sys.argv[1:]; import api.cli, json, os; "
    "print(json.dumps({k: os.environ.get(k) for k in ('GOMP_SPINCOUNT', 'OMP_WAIT_POLICY')}))"
)


def openmp_env(args: list[str], **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update(extra)
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("args", "extra", "want"),
    [
        (["serve"], {}, {"GOMP_SPINCOUNT": SERVE_SPINCOUNT, "OMP_WAIT_POLICY": None}),
        (["embed-file", "--help"], {}, {"GOMP_SPINCOUNT": None, "OMP_WAIT_POLICY": "PASSIVE"}),
        (["worker"], {}, {"GOMP_SPINCOUNT": None, "OMP_WAIT_POLICY": "PASSIVE"}),
        (
            ["serve"],
            {"OMP_WAIT_POLICY": "ACTIVE"},
            {"GOMP_SPINCOUNT": None, "OMP_WAIT_POLICY": "ACTIVE"},
        ),
        (["serve"], {"GOMP_SPINCOUNT": "5"}, {"GOMP_SPINCOUNT": "5", "OMP_WAIT_POLICY": None}),
    ],
)
def test_serve_spins_briefly_and_the_rest_do_not(args, extra, want):
    assert openmp_env(args, **extra) == want


def test_the_openmp_module_loads_no_torch():
    code = "import sys, api.openmp; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr
