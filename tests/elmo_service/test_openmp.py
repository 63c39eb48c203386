"""The library's entry point spins OpenMP's idle threads briefly unless told otherwise, and
only where it still counts (before torch loads libgomp). Fresh interpreters each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elmo_service.openmp import SPINCOUNT

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def run(code: str, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in KEYS}
    env.update(extra)
    probe = "{k: os.environ.get(k) for k in KEYS} | {'torch': 'torch' in sys.modules}"
    code += f"; import json, os, sys; KEYS = {KEYS!r}; print(json.dumps({probe}))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("code", "extra", "want"),
    [
        ("from elmo_service import Embedder", {}, {"GOMP_SPINCOUNT": SPINCOUNT}),
        ("from elmo_service import MixSpec", {}, {"GOMP_SPINCOUNT": SPINCOUNT}),
        ("import torch; from elmo_service import Embedder", {}, {"GOMP_SPINCOUNT": None}),
        (
            "from elmo_service import Embedder",
            {"OMP_WAIT_POLICY": "PASSIVE"},
            {"GOMP_SPINCOUNT": None, "OMP_WAIT_POLICY": "PASSIVE"},
        ),
        ("from elmo_service import Embedder", {"GOMP_SPINCOUNT": "7"}, {"GOMP_SPINCOUNT": "7"}),
        # the submodules are what the CLIs import: they choose their own setting first
        ("import elmo_service.embedder", {}, {"GOMP_SPINCOUNT": None}),
    ],
)
def test_the_entry_point_spins_briefly_unless_told_or_too_late(code, extra, want):
    got = run(code, **extra)
    assert {k: got[k] for k in want} == want
    assert got["torch"]


def test_importing_the_package_loads_no_torch():
    got = run("import elmo_service")
    assert got == {"GOMP_SPINCOUNT": None, "OMP_WAIT_POLICY": None, "torch": False}
