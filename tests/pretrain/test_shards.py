"""Prepared shards are checked at load (checksums, id range, offsets) with one-line errors
naming the file; a corpus deleted while training stops the run at once; a full disk
during a checkpoint is one line naming the file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from elmo_pretrain import checkpoint as ckpt
from elmo_pretrain.cli import main
from elmo_pretrain.config import TrainConfig, apply_overrides
from elmo_pretrain.data import Corpus
from elmo_pretrain.run_dir import checkpoint_step
from elmo_pretrain.train import CorpusMissing, run_training
from elmo_service.atomic import sha256_file
from elmo_service.errors import InputError
from tests.support.corpora import prepared_corpus

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.yaml"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return prepared_corpus(tmp_path_factory.mktemp("corpus"), 300, 120, seed=3)


@pytest.fixture
def corpus(pristine, tmp_path):
    """A private copy to damage."""
    return Path(shutil.copytree(pristine, tmp_path / "prepared"))


def shard_file(corpus: Path, kind: str) -> Path:
    return corpus / "shards" / f"train-00000.{kind}.npy"


def rehash(corpus: Path) -> None:
    """Record the damaged files' sums, as someone who edits shards by hand might:
    the structural checks must catch what the checksum then cannot."""
    mpath = corpus / "manifest.json"
    m = json.loads(mpath.read_text())
    for sh in m["shards"]["train"]:
        for kind in ("tokens", "offsets"):
            sh["sha256"][kind] = sha256_file(corpus / "shards" / f"{sh['name']}.{kind}.npy")
    mpath.write_text(json.dumps(m))


def load_error(corpus: Path) -> str:
    with pytest.raises(InputError) as e:
        Corpus(corpus).split("train")
    assert "\n" not in e.value.message
    return e.value.message


def test_manifest_records_a_checksum_per_shard_file(pristine):
    m = json.loads((pristine / "manifest.json").read_text())
    for split in ("train", "heldout"):
        for sh in m["shards"][split]:
            for kind in ("tokens", "offsets"):
                path = pristine / "shards" / f"{sh['name']}.{kind}.npy"
                assert sh["sha256"][kind] == sha256_file(path)
    assert len(Corpus(pristine).split("train")) == m["summary"]["train_sentences"]


def test_shuffled_in_range_tokens_fail_the_checksum(corpus):
    p = shard_file(corpus, "tokens")
    tokens = np.load(p)
    np.save(p, np.random.default_rng(0).permutation(tokens))  # same ids, wrong order
    assert load_error(corpus).startswith(f"{p}: content does not match the sha256")


def test_truncated_npy_is_one_line_naming_it(corpus):
    p = shard_file(corpus, "tokens")
    p.write_bytes(p.read_bytes()[:100])
    assert "does not match the sha256" in load_error(corpus)
    rehash(corpus)
    msg = load_error(corpus)
    assert msg.startswith(f"{p}: not a readable .npy file")


def test_ids_outside_the_vocabulary_are_refused(corpus):
    p = shard_file(corpus, "tokens")
    tokens = np.load(p)
    tokens[5] = 10_000
    np.save(p, tokens)
    rehash(corpus)
    msg = load_error(corpus)
    low = int(tokens.min())  # the corpus' smallest id (the sentencepiece settings decide it)
    assert msg.startswith(f"{p}: token ids from {low} to 10000, outside the vocabulary's 0..")


@pytest.mark.parametrize("damage", ["decreasing", "past_the_end"])
def test_bad_offsets_are_refused(corpus, damage):
    p = shard_file(corpus, "offsets")
    off = np.load(p)
    if damage == "decreasing":
        off[3], off[4] = off[4], off[3]
    else:
        off[-1] += 7  # a last sentence reading past the shard
    np.save(p, off)
    rehash(corpus)
    assert load_error(corpus).startswith(f"{p}: sentence offsets must start at 0")


def test_training_on_a_damaged_corpus_fails_before_any_step(corpus, tmp_path, capsys):
    p = corpus / "shards" / "heldout-00000.tokens.npy"  # read only at the end, before
    p.write_bytes(p.read_bytes()[:-8])
    run = tmp_path / "run"
    sets = [f"data.path={corpus}", "train.progress=false", "train.steps=5"]
    rc = main(["train", str(TINY), "--run-dir", str(run), *sum((["--set", s] for s in sets), [])])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and str(p) in err
    assert not ckpt.list_checkpoints(run)


def test_a_corpus_deleted_while_training_stops_the_run_at_once(corpus, tmp_path, capsys):
    def delete_on_start(msg: str) -> None:
        if msg.startswith("training "):  # fit() has begun: the next step sees it gone
            shutil.rmtree(corpus)

    raw = yaml.safe_load(TINY.read_text())
    cfg = TrainConfig.from_dict(
        apply_overrides(raw, [f"data.path={corpus}", "train.progress=false", "train.steps=200"])
    )
    run = tmp_path / "run"
    with pytest.raises(CorpusMissing, match="disappeared during training .at step 1;"):
        run_training(cfg, run, log=delete_on_start)
    assert [checkpoint_step(p) for p in ckpt.list_checkpoints(run)] == [1]
    stop = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert stop["event"] == "stop" and stop["reason"] == "error" and "disappeared" in stop["detail"]


def _can_mount_tmpfs(where: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {where}"],
        capture_output=True,
    )
    return probe.returncode == 0


def test_a_full_disk_during_a_checkpoint_is_one_line_naming_the_file(pristine, tmp_path):
    """A real full file system: the run folder on a 96 KiB tmpfs (a private mount namespace)."""
    run = tmp_path / "run"
    run.mkdir()
    if not _can_mount_tmpfs(run):
        pytest.skip("needs `unshare -rm` to mount a small tmpfs (user and mount namespaces)")
    sets = [f"data.path={pristine}", "train.progress=false", "train.steps=4"]
    sets += ["checkpoint.every_steps=2"]
    train = [sys.executable, "-m", "elmo_pretrain.cli", "train", str(TINY), "--run-dir", str(run)]
    train += sum((["--set", s] for s in sets), [])
    script = f"mount -t tmpfs -o size=96k tmpfs {run} && exec " + " ".join(train)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 2, out.stderr
    err = out.stderr.strip().splitlines()
    assert len(err) == 1, out.stderr
    assert "cannot write checkpoint" in err[0] and "step-00000002.pt" in err[0]
    assert "No space left on device (ENOSPC)" in err[0]
