"""One process setup (elmo_service/process.py): OpenMP's spin by role, an explicit setting wins,
the thread count set; nothing changes the environment at import. Fresh interpreters each:
OpenMP reads its settings once, when torch loads it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elmo_service.bilm.kernels.tuning import OMP_SPINCOUNT
from elmo_service.errors import ConfigError
from elmo_service.process import configure_process, openmp_environment

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def run(code: str, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (*KEYS, "ELMO_THREADS")}
    env.update(extra)
    probe = "{k: os.environ.get(k) for k in KEYS} | {'torch': 'torch' in sys.modules}"
    code += f"; import json, os, sys; KEYS = {KEYS!r}; print(json.dumps({probe}))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


SPIN = {"GOMP_SPINCOUNT": OMP_SPINCOUNT, "OMP_WAIT_POLICY": None}
PASSIVE = {"GOMP_SPINCOUNT": None, "OMP_WAIT_POLICY": "PASSIVE"}


@pytest.mark.parametrize(
    ("role", "extra", "want"),
    [
        ("serve", {}, SPIN),
        ("library", {}, SPIN),
        ("worker", {}, PASSIVE),
        ("cli", {}, PASSIVE),
        ("train", {}, PASSIVE),
        ("serve", {"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "ACTIVE"}),
        ("cli", {"GOMP_SPINCOUNT": "5"}, {"GOMP_SPINCOUNT": "5", "OMP_WAIT_POLICY": None}),
    ],
)
def test_each_role_gets_its_spin_unless_the_environment_says(role, extra, want):
    environ = dict(extra)
    openmp_environment(role, environ)
    assert {k: environ.get(k) for k in want} == want


@pytest.mark.parametrize(("role", "want"), [("serve", SPIN), ("worker", PASSIVE)])
def test_a_fresh_process_has_its_spin_before_torch_loads_and_its_thread_count(role, want):
    """The rule above, in a real process: set before torch loads OpenMP (which reads it
    once), and the count applied."""
    code = (
        "from elmo_service.process import configure_process; "
        f"n = configure_process({role!r}, 1); import torch; assert torch.get_num_threads() == n == 1"
    )
    got = run(code)
    assert {k: got[k] for k in want} == want


def test_threads_default_to_elmo_threads():
    code = (
        "from elmo_service.process import configure_process; n = configure_process('cli'); "
        "import torch; assert n == torch.get_num_threads() == 1, n"
    )
    run(code, ELMO_THREADS="1")


@pytest.mark.parametrize(
    "code", ["import elmo_service", "import elmo_cli.main", "import elmo_service.process"]
)
def test_importing_changes_nothing_and_loads_no_torch(code):
    assert run(code) == {"GOMP_SPINCOUNT": None, "OMP_WAIT_POLICY": None, "torch": False}


def test_a_bad_role_or_thread_count_is_refused(monkeypatch):
    with pytest.raises(ConfigError) as e:
        configure_process("daemon", set_threads=False)
    assert e.value.field == "role"
    with pytest.raises(ConfigError) as e:
        configure_process("cli", 0)
    assert e.value.field == "threads"
    monkeypatch.setenv("ELMO_THREADS", "two")
    with pytest.raises(ConfigError, match="ELMO_THREADS") as e:
        configure_process("cli")
    assert e.value.field == "threads"
