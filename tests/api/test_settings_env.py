"""Misspelt ``ELMO_*`` variables are not ignored silently: each one
that names no setting is logged at start with the setting it was probably meant to be."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elmo_api.settings import OTHER_VARIABLES, load_settings, unknown_variables

REPO = Path(__file__).resolve().parents[2]


def test_a_misspelt_variable_is_warned_with_a_did_you_mean(monkeypatch, tmp_path, caplog):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ELMO_ENV_FILE", ".env")  # the default outside the tests
    monkeypatch.setenv("ELMO_MAX_SENTENCE", "3")  # ELMO_MAX_SENTENCES meant
    monkeypatch.setenv("ELMO_THREADS", "1")  # right: no warning
    monkeypatch.setenv("ELMO_JOBS_PARENT_PID", "1")  # read by the jobs worker: no warning
    (tmp_path / ".env").write_text("# a comment\nexport ELMO_REDIS_TIMEOT=1\nELMO_DEVICE=cpu\n")
    with caplog.at_level(logging.WARNING, logger="elmo_api.settings"):
        s = load_settings(data_dir=tmp_path)
    assert s.max_sentences == 256  # the typo changed nothing: hence the warning
    lines = [r.getMessage() for r in caplog.records if r.name == "elmo_api.settings"]
    assert lines == [
        "ELMO_MAX_SENTENCE is not a setting and is ignored (did you mean ELMO_MAX_SENTENCES?)",
        "ELMO_REDIS_TIMEOT is not a setting and is ignored (did you mean ELMO_REDIS_TIMEOUT?)",
    ]


def test_a_name_close_to_nothing_is_warned_without_a_guess():
    assert unknown_variables(["ELMO_FROBNICATE", "PATH", "REDIS_URL"]) == [
        "ELMO_FROBNICATE is not a setting and is ignored"
    ]


def test_the_other_variables_are_read_somewhere():
    """The allow-list holds only names some file of the project reads (no stale entries)."""
    for name in OTHER_VARIABLES:
        found = subprocess.run(
            ["git", "grep", "-l", name, "--", ":!api/settings.py", ":!tests/api/test_settings_env.py"],
            cwd=REPO, capture_output=True, text=True,
        )  # fmt: skip
        assert found.stdout.strip(), f"{name} is read nowhere: drop it from OTHER_VARIABLES"


STACK_ENV = "ELMO_ADMIN_KEYS=stack-admin\nELMO_API_REPLICAS=3\nELMO_LB_IMAGE=lb:1\n"


def test_keys_from_a_dotenv_file_are_said_and_compose_names_are_known(
    monkeypatch, tmp_path, caplog
):
    """The compose stack's `.env` (docker/README.md): a local server says it took its admin key,
    and the compose-only names are not called typos."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ELMO_ENV_FILE", ".env")
    monkeypatch.delenv("ELMO_ADMIN_KEYS", raising=False)
    (tmp_path / ".env").write_text(STACK_ENV)
    with caplog.at_level(logging.WARNING, logger="elmo_api.settings"):
        s = load_settings(data_dir=tmp_path)
    assert s.admin_keys == ["stack-admin"]
    lines = [r.getMessage() for r in caplog.records if r.name == "elmo_api.settings"]
    assert lines == [
        f"ELMO_ADMIN_KEYS taken from {tmp_path / '.env'} (the compose stack reads that file "
        "too); ELMO_ENV_FILE= reads no file"
    ]
    # ELMO_ENV_FILE= (empty): no file at all
    monkeypatch.setenv("ELMO_ENV_FILE", "")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="elmo_api.settings"):
        assert load_settings(data_dir=tmp_path).admin_keys == []
    assert not [r for r in caplog.records if r.name == "elmo_api.settings"]


@pytest.mark.slow  # a pytest subprocess
def test_the_auth_tests_pass_beside_a_stack_dotenv(tmp_path):
    """With the compose `.env` (an admin key) in the working directory, the tests that
    need *no* admin key still see none, in-process and in the servers they start."""
    (tmp_path / ".env").write_text(STACK_ENV)
    env = {k: v for k, v in os.environ.items() if k not in ("ELMO_ENV_FILE", "ELMO_ADMIN_KEYS")}
    env |= {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    nodes = [
        "tests/api/test_errors.py::test_writes_refused_without_admin_keys",
        "tests/jobs/test_jobs.py::test_jobs_need_an_admin_key",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(REPO),
         *(str(REPO / n) for n in nodes)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "2 passed" in proc.stdout, proc.stdout[-2000:]
