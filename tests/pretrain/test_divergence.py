"""A run that blows up stops at once (exit 2, one line, a "diverged" stop record), never
writes or keeps a non-finite checkpoint, and nothing it writes holds a bare NaN/Infinity."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from elmo_pretrain import checkpoint as ckpt
from elmo_pretrain.cli import main
from elmo_pretrain.evaluate import _ppl_record
from elmo_pretrain.tracking import dumps
from tests.support.corpora import prepared_corpus

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"
# plain SGD, no clipping, no warm-up: lr 1e30 gives NaN at step 2; lr 1e6 stays finite
# but its held-out NLL is millions of nats a token (exp overflows)
BLOW_UP = ["optim.name=sgd", "optim.clip_norm=0", "optim.warmup_steps=0", "train.log_every=1"]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    return prepared_corpus(tmp_path_factory.mktemp("corpus"), 300, 120, seed=3)


def train(corpus_dir: Path, run: Path, *sets: str) -> int:
    args = ["train", str(TINY), "--run-dir", str(run)]
    for s in (f"data.path={corpus_dir}", "train.progress=false", *BLOW_UP, *sets):
        args += ["--set", s]
    return main(args)


def strict_json(text: str):
    """json.loads that refuses NaN / Infinity literals (as browsers and pydantic do)."""

    def refuse(const):
        raise ValueError(f"bare {const} in JSON")

    return [json.loads(line, parse_constant=refuse) for line in text.splitlines()]


def error_lines(err: str) -> list[str]:
    return [x for x in err.splitlines() if x.strip()]


def all_finite(path: Path) -> bool:
    st = ckpt.load_checkpoint(path)
    return not ckpt.nonfinite_tensors(st["model"])


def test_nan_loss_stops_at_that_step_and_keeps_only_good_checkpoints(corpus_dir, tmp_path, capsys):
    run = tmp_path / "run"
    rc = train(corpus_dir, run, "optim.lr=1e30", "train.steps=20", "checkpoint.every_steps=1")
    err = capsys.readouterr().err
    assert rc == 2
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert "diverged at step 2: non-finite loss nan" in lines[0]
    assert "last good checkpoint is step-00000001.pt" in lines[0]
    recs = strict_json((run / "metrics.jsonl").read_text())
    stop = [r for r in recs if r.get("event") == "stop"]
    assert [(s["reason"], s["step"]) for s in stop] == [("diverged", 1)]
    assert "diverged at step 2" in stop[0]["detail"]
    names = [p.name for p in ckpt.list_checkpoints(run)]
    assert names == ["step-00000001.pt"]  # step 2 never saved
    assert all_finite(ckpt.list_checkpoints(run)[0])
    # resuming repeats the divergence at the same step, it does not train on NaN
    rc = main(["train", "--run-dir", str(run), "--resume"])
    assert rc == 2 and "diverged at step 2" in capsys.readouterr().err
    # the policy may change on resume (it is not part of the run's identity)
    rc = main(["train", "--run-dir", str(run), "--resume", "--set", "optim.nonfinite=skip"])
    out, err = capsys.readouterr()
    assert rc == 2 and "update skipped" in out and "different run" not in err


def test_skip_policy_drops_non_finite_updates_then_stops(corpus_dir, tmp_path, capsys):
    run = tmp_path / "run"
    sets = (
        "optim.lr=1e30",
        "train.steps=20",
        "optim.nonfinite=skip",
        "optim.nonfinite_max_skips=2",
    )
    rc = train(corpus_dir, run, *sets)
    out, err = capsys.readouterr()
    assert rc == 2 and "diverged at step 2" in err
    skips = [x for x in out.splitlines() if "update skipped" in x]
    assert len(skips) == 2 and "lr x0.5" in skips[0] and "(2/2 in a row)" in skips[1]


def test_huge_finite_loss_stops_at_the_evaluation_and_export_refuses(corpus_dir, tmp_path, capsys):
    run = tmp_path / "run"
    rc = train(corpus_dir, run, "optim.lr=1e6", "train.steps=12", "checkpoint.every_steps=6")
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(error_lines(err)) == 1 and "held-out perplexity is not finite" in err
    recs = strict_json((run / "metrics.jsonl").read_text())  # no bare Infinity
    held = [r["heldout"] for r in recs if "heldout" in r]
    assert held and held[-1]["avg_ppl"] is None and held[-1]["forward_nll"] > 709
    assert recs[-1]["event"] == "stop" and recs[-1]["reason"] == "diverged"
    rc = main(["export", str(run), str(tmp_path / "model")])
    err = capsys.readouterr().err
    assert rc == 2 and len(error_lines(err)) == 1 and "is not exported" in err
    assert not (tmp_path / "model").exists()


def test_export_refuses_non_finite_weights(corpus_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert train(corpus_dir, run, "optim.lr=0.1", "train.steps=2", "checkpoint.every_steps=1") == 0
    capsys.readouterr()
    # a NaN checkpoint as an older version (or another tool) would have written it
    path = ckpt.list_checkpoints(run)[-1]
    st = ckpt.load_checkpoint(path)
    name = next(k for k, v in st["model"].items() if v.is_floating_point())
    st["model"][name] = torch.full_like(st["model"][name], float("nan"))
    torch.save(st, path)
    ckpt.sidecar(path).write_text(f"{ckpt.sha256_file(path)}  {path.name}\n")
    rc = main(["export", str(run), str(tmp_path / "model"), "--checkpoint", path.name])
    err = capsys.readouterr().err
    assert rc == 2 and len(error_lines(err)) == 1
    assert "is not exported: 1 of" in err and name in err
    assert not (tmp_path / "model").exists()


def state(step: int, value: float = 1.0) -> dict:
    return {"step": step, "model": {"w": torch.full((4,), value), "n": torch.tensor([step])}}


def test_non_finite_checkpoints_are_never_written_resumed_or_counted_as_good(tmp_path):
    with pytest.raises(ckpt.NonFiniteCheckpoint, match="step-00000009.pt not written: 1 of 2"):
        ckpt.save_checkpoint(tmp_path, 9, state(9, float("inf")))
    assert ckpt.list_checkpoints(tmp_path) == []
    for step in (1, 2):
        ckpt.save_checkpoint(tmp_path, step, state(step), keep=2)
    # step 3: NaN weights with a valid hash, as an unguarded trainer wrote them
    d = ckpt.checkpoint_dir(tmp_path)
    bad = d / "step-00000003.pt"
    torch.save(state(3, float("nan")), bad)
    ckpt.sidecar(bad).write_text(f"{ckpt.sha256_file(bad)}  {bad.name}\n")
    assert ckpt.checkpoint_status(bad) == "nonfinite"
    msgs: list[str] = []
    path, st = ckpt.load_latest(tmp_path, log=msgs.append)
    assert st["step"] == 2 and "NaN or infinity" in msgs[0]
    # pruning keeps the two newest GOOD ones: the NaN one displaces nothing
    ckpt.save_checkpoint(tmp_path, 4, state(4), keep=2)
    names = [p.name for p in ckpt.list_checkpoints(tmp_path)]
    assert names == ["step-00000002.pt", "step-00000003.pt", "step-00000004.pt"]


def test_perplexity_overflow_is_inf_and_json_null():
    class Both:
        directions = "both"

    rec = _ppl_record(Both(), 1, 2, 1e7, float("nan"), "sentences")
    assert rec["forward_ppl"] == math.inf and math.isnan(rec["backward_ppl"])
    assert json.loads(dumps(rec))["forward_ppl"] is None
    assert json.loads(dumps(rec))["backward_ppl"] is None


def test_config_reads_exponent_floats_as_floats(tmp_path):
    from elmo_pretrain.config import load_config

    # PyYAML alone reads these as strings, which the strict config refuses
    assert yaml.safe_load("1e-3") == "1e-3"
    assert load_config(TINY, ["optim.lr=1e-3"]).optim.lr == 1e-3
    (tmp_path / "c.yaml").write_text("optim:\n  lr: 2e-4\n")
    assert load_config(tmp_path / "c.yaml").optim.lr == 2e-4


@pytest.mark.parametrize(
    "bad",
    [
        "checkpoint.every_steps=-5",
        "checkpoint.every_minutes=-1",
        "train.eval_max_sentences=-1",
        "train.eval_every=-2",
        "train.max_minutes=-1",
    ],
)
def test_negative_cadences_fail_before_any_work(tmp_path, capsys, bad):
    run = tmp_path / "run"
    assert main(["train", str(TINY), "--run-dir", str(run), "--set", bad]) == 2
    assert f"{bad.split('=')[0]}: must be >= 0" in capsys.readouterr().err
    assert not run.exists()


def test_plot_draws_a_diverged_run(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    recs = [
        {"step": 5, "loss": 4.7, "ppl": 110.0, "lr": 1e6, "grad_norm": 0.3, "tok_s": 900.0},
        {"step": 10, "loss": 3e4, "ppl": 5e21, "lr": 1e6, "grad_norm": 375.0, "tok_s": 900.0},
        {"step": 10, "heldout": {"forward_ppl": None, "avg_ppl": None, "forward_nll": 2e7}},
        {"event": "stop", "reason": "diverged", "step": 10, "tokens_seen": 1, "detail": "x"},
    ]
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main(["plot", str(log)]) == 0
    assert (tmp_path / "metrics.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
@pytest.mark.ddp
def test_ddp_ranks_stop_alike_with_one_line(corpus_dir, tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "elmo_pretrain.cli", "train", str(TINY), "--run-dir", str(run)]
    sets = [f"data.path={corpus_dir}", "train.progress=false", *BLOW_UP, "optim.lr=1e30"]
    sets += ["train.steps=20", "checkpoint.every_steps=1"]
    cmd += [*sum((["--set", s] for s in sets), []), "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    lines = error_lines(out.stderr)
    assert len(lines) == 1 and "diverged at step 2" in lines[0], out.stderr
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step-00000001.pt"]
