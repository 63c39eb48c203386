"""Stopping training cleanly: SIGTERM while the first step compiles is honoured at once,
and Ctrl-C under the multi-process launcher writes the checkpoint and prints one line."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elmo_pretrain import checkpoint as ckpt
from elmo_pretrain.prepare import PrepareOptions, prepare
from elmo_pretrain.run_dir import checkpoint_step
from elmo_pretrain.sources.synthetic import write_corpus

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    text = write_corpus(d / "book.txt", n_sentences=300, seed=3)
    opts = PrepareOptions(vocab_size=120, byte_fallback=False, heldout_fraction=0.05)
    prepare([str(text)], d / "prepared", opts, progress=False, log=lambda *_: None)
    return d / "prepared"


def start(corpus_dir: Path, run: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "elmo_pretrain.cli", "train", str(TINY), "--run-dir", str(run)]
    for s in (f"data.path={corpus_dir}", "train.progress=false", "train.steps=100000"):
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [*cmd, *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def wait_for(pred, proc: subprocess.Popen, timeout: float = 240) -> None:
    end = time.time() + timeout
    while not pred():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < end, "timed out"
        time.sleep(0.2)


def stop_record(run: Path) -> dict:
    return json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])


@pytest.mark.slow
def test_sigterm_while_compiling_the_first_step_stops_within_seconds(corpus_dir, tmp_path):
    run = tmp_path / "run"
    proc = start(corpus_dir, run, "--set", "train.compile=true")
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "training ... + compile; ...": the loop starts next
    assert line.startswith("training ") and "compile" in line, line
    time.sleep(1.0)  # inside the first step's compilation (tens of seconds on a CPU)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    rec = stop_record(run)
    assert rec["event"] == "stop" and rec["reason"] == "signal"
    # acted on inside the compilation, not once the first step was done: step 0 (no clock,
    # so a loaded machine, whose compilation only takes longer, cannot break it)
    assert rec["step"] == 0, rec
    assert rec["detail"].startswith("signal SIGTERM")


@pytest.mark.slow
@pytest.mark.ddp
def test_ctrl_c_under_the_launcher_checkpoints_and_prints_one_line(corpus_dir, tmp_path):
    run = tmp_path / "run"
    proc = start(corpus_dir, run, "--nproc-per-node", "2", "--set", "checkpoint.every_steps=0")
    metrics = run / "metrics.jsonl"
    wait_for(lambda: metrics.is_file() and '"loss"' in metrics.read_text(), proc)
    proc.send_signal(signal.SIGINT)  # the launcher, as a terminal's Ctrl-C reaches it
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert err.strip().splitlines() == [
        "elmo-pretrain train: stopped by SIGINT; --resume continues"
    ]
    rec = stop_record(run)
    assert rec["reason"] == "signal" and rec["step"] > 0
    assert [checkpoint_step(p) for p in ckpt.list_checkpoints(run)] == [rec["step"]]
    assert ckpt.load_checkpoint(ckpt.list_checkpoints(run)[-1])["world_size"] == 2


def _tiny(corpus_dir: Path):
    from elmo_pretrain.config import load_config

    sets = [f"data.path={corpus_dir}", "train.progress=false", "train.threads=1"]
    return load_config(TINY, [*sets, "train.steps=1000", "checkpoint.every_steps=0"])


def _signal_once(signum: int):
    """A log function that raises ``signum`` in this process when the loop is about to start."""
    sent: list[int] = []

    def log(line: str) -> None:
        if line.startswith("training ") and not sent:
            sent.append(signum)
            signal.raise_signal(signum)

    return log


@contextlib.contextmanager
def interactive_ctrl_c():
    """SIGINT as an interactive Python has it (``KeyboardInterrupt``), whatever this process
    inherited: a suite started as a background job (``make test &``, ``nohup ... &``) starts
    with SIGINT ignored, and then there is no caller's Ctrl-C handler to hand the signal on to."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def test_ctrl_c_with_sigint_ignored_still_checkpoints_and_returns(corpus_dir, tmp_path):
    """Started with SIGINT ignored (a background job), an in-process run still stops at a
    checkpoint on SIGINT (sent by ``kill -INT``), and hands nothing on: the caller ignores it."""
    from elmo_pretrain.train import run_training

    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        res = run_training(_tiny(corpus_dir), tmp_path / "run", log=_signal_once(signal.SIGINT))
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # given back as it was
    finally:
        signal.signal(signal.SIGINT, old)
    assert res["stopped"] == "signal SIGINT"
    assert [checkpoint_step(p) for p in ckpt.list_checkpoints(tmp_path / "run")] == [res["step"]]


def test_ctrl_c_in_an_in_process_run_checkpoints_then_reaches_the_caller(corpus_dir, tmp_path):
    """Under pytest (or a notebook) Ctrl-C must end the program, not just the run: the
    trainer checkpoints, puts the previous handlers back and hands the signal on, here
    Python's KeyboardInterrupt (it used to be swallowed: the suite ran on)."""
    from elmo_pretrain.train import run_training

    run = tmp_path / "run"
    with interactive_ctrl_c():
        before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        with pytest.raises(KeyboardInterrupt):
            run_training(_tiny(corpus_dir), run, log=_signal_once(signal.SIGINT))
        assert {s: signal.getsignal(s) for s in before} == before
    rec = stop_record(run)
    assert rec["reason"] == "signal" and rec["detail"] == "signal SIGINT"
    assert [checkpoint_step(p) for p in ckpt.list_checkpoints(run)] == [rec["step"]]


def test_a_previous_handler_gets_the_signal_after_the_checkpoint(corpus_dir, tmp_path):
    from elmo_pretrain.train import run_training

    got: list[int] = []
    old = signal.signal(signal.SIGTERM, lambda s, _f: got.append(s))
    try:
        res = run_training(_tiny(corpus_dir), tmp_path / "run", log=_signal_once(signal.SIGTERM))
        assert signal.getsignal(signal.SIGTERM) is not None and got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, old)
    assert res["stopped"] == "signal SIGTERM" and ckpt.list_checkpoints(tmp_path / "run")
    # the CLI owns its process and does not hand on: exit 0 (test_sigterm_writes_a_checkpoint...)
