"""Misspelt ``ELMO_*`` variables are not ignored silently: each one
that names no setting is logged at start with the setting it was probably meant to be."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

from api.settings import OTHER_VARIABLES, load_settings, unknown_variables

REPO = Path(__file__).resolve().parents[2]


def test_a_misspelt_variable_is_warned_with_a_did_you_mean(monkeypatch, tmp_path, caplog):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ELMO_MAX_SENTENCE", "3")  # ELMO_MAX_SENTENCES meant
    monkeypatch.setenv("ELMO_THREADS", "1")  # right: no warning
    monkeypatch.setenv("ELMO_JOBS_PARENT_PID", "1")  # read by the jobs worker: no warning
    (tmp_path / ".env").write_text("# a comment\nexport ELMO_REDIS_TIMEOT=1\nELMO_DEVICE=cpu\n")
    with caplog.at_level(logging.WARNING, logger="api.settings"):
        s = load_settings(data_dir=tmp_path)
    assert s.max_sentences == 256  # the typo changed nothing: hence the warning
    lines = [r.getMessage() for r in caplog.records if r.name == "api.settings"]
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
