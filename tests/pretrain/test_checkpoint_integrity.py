"""Checkpoint integrity: every checkpoint carries a sha256 of its bytes; resume takes the
newest one that verifies; a run whose checkpoints all fail fails loudly and deletes
nothing; pruning never keeps a corrupt checkpoint over a good one; a bit flip inside
tensor data (which torch.load alone accepts) is caught."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from elmo_pretrain import checkpoint as ckpt
from elmo_pretrain.cli import main
from elmo_pretrain.config import TrainConfig, apply_overrides
from elmo_pretrain.train import run_training
from tests.support.corpora import prepared_corpus, quiet

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"step": step, "w": torch.randn(256, generator=g), "data": {"epoch": 0}}


def snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def flip_inside(path: Path, tensor: torch.Tensor) -> int:
    """Flip one bit in the middle of ``tensor``'s bytes inside ``path``. Returns the offset."""
    raw = bytearray(path.read_bytes())
    at = raw.find(tensor.numpy().tobytes())
    assert at >= 0, "tensor bytes not found in the checkpoint"
    at += tensor.numel() * tensor.element_size() // 2
    raw[at] ^= 0x10
    path.write_bytes(bytes(raw))
    return at


# ------------------------------------------------------------------ the module


def test_checkpoint_has_a_sha256sum_sidecar_and_verifies(tmp_path):
    path = ckpt.save_checkpoint(tmp_path, 7, state(7))
    side = ckpt.sidecar(path)
    assert side.name == "step-00000007.pt.sha256"
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert side.read_text() == f"{digest}  step-00000007.pt\n"  # `sha256sum -c` format
    assert ckpt.verify_checkpoint(path) is True
    assert ckpt.checkpoint_status(path) == "verified"
    assert torch.equal(ckpt.load_checkpoint(path)["w"], state(7)["w"])
    # no temp files left
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, side.name]


def test_bit_flip_in_tensor_data_is_caught_and_resume_takes_the_previous(tmp_path):
    for step in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, step, state(step), keep=3)
    newest = ckpt.list_checkpoints(tmp_path)[-1]
    flip_inside(newest, state(3)["w"])
    # torch.load alone accepts it: the flipped tensor differs silently
    unverified = ckpt.load_checkpoint(newest, verify=False)
    assert not torch.equal(unverified["w"], state(3)["w"])
    with pytest.raises(ckpt.CorruptCheckpoint, match="content hash mismatch"):
        ckpt.load_checkpoint(newest)
    assert ckpt.checkpoint_status(newest) == "corrupt"
    msgs: list[str] = []
    path, st = ckpt.load_latest(tmp_path, log=msgs.append)
    assert path.name == "step-00000002.pt" and st["step"] == 2
    assert len(msgs) == 1 and "step-00000003.pt is unreadable" in msgs[0]
    assert "hash mismatch" in msgs[0]


def test_no_resumable_checkpoint_raises_and_deletes_nothing(tmp_path):
    for step in (1, 2):
        ckpt.save_checkpoint(tmp_path, step, state(step))
    d = ckpt.checkpoint_dir(tmp_path)
    first, second = ckpt.list_checkpoints(tmp_path)
    first.write_bytes(first.read_bytes()[:100])  # truncated
    flip_inside(second, state(2)["w"])  # bit flip
    before = snapshot(d)
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load_latest(tmp_path, log=quiet)
    msg = e.value.message
    assert "\n" not in msg and "none of the 2 checkpoints" in msg
    assert "step-00000001.pt" in msg and "step-00000002.pt" in msg
    assert snapshot(d) == before
    assert ckpt.load_latest(tmp_path / "empty", log=quiet) is None  # no checkpoints: a new run


def test_prune_never_keeps_a_corrupt_checkpoint_over_a_good_one(tmp_path):
    for step in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, step, state(step), keep=3)
    three = ckpt.list_checkpoints(tmp_path)[-1]
    three.write_bytes(three.read_bytes()[:-50])  # torn newest
    # resumed from step 2, the run writes step 2 again; with keep=1 a prune by step
    # number alone would delete the good one and keep the corrupt step 3
    ckpt.save_checkpoint(tmp_path, 2, state(2), keep=1)
    d = ckpt.checkpoint_dir(tmp_path)
    assert sorted(p.name for p in d.iterdir()) == ["step-00000002.pt", "step-00000002.pt.sha256"]
    assert ckpt.load_latest(tmp_path, log=quiet)[1]["step"] == 2
    # the newest good one is kept even when older good ones go
    ckpt.save_checkpoint(tmp_path, 4, state(4), keep=2)
    ckpt.save_checkpoint(tmp_path, 5, state(5), keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [
        "step-00000004.pt",
        "step-00000005.pt",
    ]
    assert not (d / "step-00000002.pt.sha256").exists()  # sidecars go with their checkpoint


def test_checkpoint_without_a_hash_still_loads_with_a_note(tmp_path):
    d = ckpt.checkpoint_dir(tmp_path)
    d.mkdir(parents=True)
    torch.save(state(5), d / "step-00000005.pt")  # as written before hashes
    assert ckpt.checkpoint_status(d / "step-00000005.pt") == "unhashed"
    msgs: list[str] = []
    path, st = ckpt.load_latest(tmp_path, log=msgs.append)
    assert st["step"] == 5 and any("no content hash" in m for m in msgs)
    # an unhashed checkpoint counts as good for pruning: never deleted in favour of nothing
    ckpt.save_checkpoint(tmp_path, 6, state(6), keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [
        "step-00000005.pt",
        "step-00000006.pt",
    ]


def test_a_crash_between_hash_and_rename_leaves_the_previous_checkpoint_usable(
    tmp_path, monkeypatch
):
    ckpt.save_checkpoint(tmp_path, 1, state(1))
    real = os.replace  # the atomic writer renames through os.replace

    def crash_on_checkpoint(src, dst):
        if str(dst).endswith(".pt"):
            raise OSError("power cut")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_checkpoint)
    with pytest.raises(ckpt.CheckpointError, match="step-00000002.pt: power cut"):
        ckpt.save_checkpoint(tmp_path, 2, state(2))
    monkeypatch.undo()
    assert ckpt.load_latest(tmp_path, log=quiet)[1]["step"] == 1
    ckpt.save_checkpoint(tmp_path, 3, state(3))  # the lone step-2 sidecar is cleaned up
    d = ckpt.checkpoint_dir(tmp_path)
    assert not (d / "step-00000002.pt.sha256").exists()
    assert not list(d.glob(".*.tmp"))


# ------------------------------------------------------------------ the trainer


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    return prepared_corpus(tmp_path_factory.mktemp("corpus"), 400, 200, seed=5)


def tiny_sets(corpus_dir: Path, steps: int) -> list[str]:
    return [
        f"data.path={corpus_dir}",
        "train.progress=false",
        "train.threads=1",
        f"train.steps={steps}",
        "train.log_every=1",
        "train.eval_max_sentences=5",
        "checkpoint.every_steps=4",
        "checkpoint.every_minutes=0",
        "checkpoint.keep=3",
        "optim.warmup_steps=2",
    ]


def tiny(corpus_dir: Path, steps: int) -> TrainConfig:
    raw = yaml.safe_load(TINY.read_text())
    return TrainConfig.from_dict(apply_overrides(raw, tiny_sets(corpus_dir, steps)))


@pytest.mark.slow
def test_resume_after_a_bit_flip_continues_from_the_previous_checkpoint_exactly(
    corpus_dir, tmp_path
):
    one = tmp_path / "one"
    run_training(tiny(corpus_dir, 12), one, log=quiet)
    two = tmp_path / "two"
    run_training(tiny(corpus_dir, 12), two, stop_after=8, log=quiet)
    newest = ckpt.list_checkpoints(two)[-1]
    assert newest.name == "step-00000008.pt"
    st = ckpt.load_checkpoint(newest)
    big = max(st["model"].values(), key=lambda t: t.numel())
    flip_inside(newest, big)
    msgs: list[str] = []
    res = run_training(tiny(corpus_dir, 12), two, resume=True, log=msgs.append)
    text = "\n".join(msgs)
    assert "step-00000008.pt is unreadable" in text and "hash mismatch" in text
    assert "resumed from step-00000004.pt: step 4" in text
    assert res["step"] == 12
    # the flip cost nothing: the final weights are those of an uninterrupted run
    a, b = ckpt.load_latest(one, log=quiet)[1], ckpt.load_latest(two, log=quiet)[1]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


@pytest.mark.slow
def test_resume_with_no_readable_checkpoint_fails_loudly_and_deletes_nothing(
    corpus_dir, tmp_path, capsys
):
    run = tmp_path / "run"
    run_training(tiny(corpus_dir, 8), run, log=quiet)
    for p in ckpt.list_checkpoints(run):
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])  # every checkpoint truncated
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    rc = main(["train", "--run-dir", str(run), "--resume"])
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "none of the 2 checkpoints" in lines[0], err
    assert "nothing was deleted" in lines[0]
    after = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert after.keys() == before.keys()
    for k in before:
        if k.name not in ("run.json", "config.yaml"):  # rewritten, same content
            assert after[k] == before[k], k
    assert json.loads((run / "run.json").read_text()) == json.loads(before[Path("run.json")])
