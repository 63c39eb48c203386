"""`elmo-pretrain adapt`: continue pretraining a model on new text (ELMo section 3.4).

A tiny model is trained here (sentencepiece, 40 steps), exported, then adapted to text of
another seed; a random-weight word-tokenized artifact stands for a converted published ELMo
(no softmax shipped)."""

from __future__ import annotations

import errno
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from elmo_pretrain import export as export_mod
from elmo_pretrain import train as train_mod
from elmo_pretrain.adapt import SOFTMAX_FILE, UNIGRAM, adapt
from elmo_pretrain.adapt_options import ADAPT_FILE, AdaptOptions
from elmo_pretrain.checkpoint import list_checkpoints
from elmo_pretrain.cli import main
from elmo_pretrain.config import load_config
from elmo_pretrain.data import Corpus
from elmo_pretrain.export import export
from elmo_pretrain.prepare import PrepareOptions, prepare
from elmo_pretrain.sources.synthetic import write_corpus
from elmo_pretrain.train import TrainingDiverged, run_training
from elmo_service.artifact import load_artifact, write_task
from elmo_service.embedder import Embedder
from elmo_service.errors import InputError
from elmo_service.scalar_mix import MixSpec
from tests.support.core_fixtures import tiny_artifact

ROOT = Path(__file__).resolve().parents[2]


def quiet(*_a, **_k):
    pass


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    """A tiny sentencepiece model this project trained (no softmax in the artifact)."""
    d = tmp_path_factory.mktemp("base")
    text = write_corpus(d / "book.txt", n_sentences=400, seed=3)
    opts = PrepareOptions(vocab_size=120, byte_fallback=False)
    prepare([str(text)], d / "prep", opts, progress=False, log=quiet)
    sets = [f"data.path={d / 'prep'}", "train.progress=false", "train.threads=1"]
    run_training(load_config(ROOT / "configs" / "tiny.yaml", sets), d / "run", log=quiet)
    export(d / "run", d / "model")
    return d / "model"


@pytest.fixture(scope="module")
def domain(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("domain") / "domain.txt", 300, seed=11)


def opts(tmp: Path, **kw) -> AdaptOptions:
    base = dict(
        steps=30,
        lr=3e-3,
        warmup_steps=3,
        tokens_per_batch=256,
        n_samples=64,
        threads=1,
        split="none",
        progress=False,
        work_dir=str(tmp / "work"),
    )
    return AdaptOptions(**{**base, **kw})


def avg(ev: dict) -> float:
    return ev["avg_ppl"]


def test_adapt_lowers_heldout_perplexity_and_writes_a_model_that_embeds(
    base_model, domain, tmp_path, capsys
):
    out = tmp_path / "new"
    flags = ["--steps", "30", "--lr", "3e-3", "--warmup-steps", "3", "--tokens-per-batch", "256"]
    flags += ["--n-samples", "64", "--threads", "1", "--split", "none", "--no-progress"]
    rc = main(
        [
            "adapt",
            str(base_model),
            str(domain),
            "--out",
            str(out),
            "--work-dir",
            str(tmp_path / "w"),
        ]
        + flags
    )
    printed = capsys.readouterr().out
    assert rc == 0
    assert "held-out perplexity before:" in printed and "held-out perplexity after:" in printed
    prov = json.loads((out / "config.json").read_text())["provenance"]
    before, after = prov["adapt"]["heldout_before"], prov["heldout"]
    assert avg(after) < avg(before), (before, after)
    assert prov["adapt"]["from"]["version"] == load_artifact(base_model).version
    assert "token vectors" in prov["adapt"]["softmax"]  # the base ships no softmax
    # the same artifact format: loads as serving loads it, and embeds finite vectors
    load_artifact(out)  # hashes, shapes, finite weights
    assert (out / "tokenizer.model").read_bytes() == (base_model / "tokenizer.model").read_bytes()
    layers = Embedder.load(out, threads=1).embed(["the old man walked to the river ."])[0].layers
    assert layers.shape[1] > 3 and np.isfinite(layers).all()
    assert (out / SOFTMAX_FILE).is_file()


def test_adapting_an_adapted_model_continues_its_softmax_exactly(base_model, domain, tmp_path):
    first = adapt(base_model, [str(domain)], tmp_path / "a", opts(tmp_path / "1"), log=quiet)
    again = adapt(
        tmp_path / "a", [str(domain)], tmp_path / "b", opts(tmp_path / "2", steps=5), log=quiet
    )
    assert again.softmax.startswith("MODEL's softmax")
    # the same held-out slice, the same weights and head: the perplexity it ended at
    assert math.isclose(avg(again.heldout_before), avg(first.heldout_after), rel_tol=1e-6)


def test_a_model_without_a_softmax_word_tokenized_adapts(domain, tmp_path):
    """A converted published ELMo: word tokenizer, biLM only. Its random weights give token
    vectors no row norm beats the unigram model with: the "before" line says so."""
    model = tiny_artifact(tmp_path / "published")
    lines: list[str] = []
    res = adapt(model, [str(domain)], tmp_path / "out", opts(tmp_path, steps=40), log=lines.append)
    assert res.softmax.startswith("initialised from the model's token vectors")
    assert UNIGRAM in res.softmax  # row norm 0 won
    ev = res.heldout_before
    assert ev["forward_ppl"] == ev["backward_ppl"]  # a unigram head: the biLM plays no part
    (before,) = [x for x in lines if x.startswith("held-out perplexity before:")]
    assert "the unigram model" in before and "not MODEL's own perplexity" in before, before
    assert all(math.isfinite(avg(e)) for e in (res.heldout_before, res.heldout_after))
    assert avg(res.heldout_after) < avg(res.heldout_before)
    assert load_artifact(tmp_path / "out").config == load_artifact(model).config


def test_the_heldout_slice_never_trains(base_model, domain, tmp_path, monkeypatch):
    seen: list[tuple[str, list[tuple[int, ...]]]] = []

    class Recording(train_mod.BucketBatcher):
        def __init__(self, corpus, split, **kw):
            super().__init__(corpus, split, **kw)
            self._split = split

        def batch(self, epoch, index):
            b = super().batch(epoch, index)
            rows = [
                tuple(r[1 : n - 1].tolist()) for r, n in zip(b.ids, b.lengths, strict=True) if n > 0
            ]
            seen.append((self._split, rows))
            return b

    monkeypatch.setattr(train_mod, "BucketBatcher", Recording)
    adapt(base_model, [str(domain)], tmp_path / "out", opts(tmp_path, steps=40), log=quiet)
    corpus = Corpus(tmp_path / "work" / "corpus")
    held = corpus.split("heldout")
    heldout = {tuple(np.asarray(held.sentence(i)).tolist()) for i in range(len(held))}
    assert heldout and seen
    assert {s for s, _ in seen} == {"train"}
    trained = {row for _, rows in seen for row in rows}
    assert len(trained) > 50 and not (trained & heldout)


def test_stop_and_resume_then_export(base_model, domain, tmp_path):
    o = opts(tmp_path, steps=20, checkpoint_every_steps=5)
    part = adapt(base_model, [str(domain)], tmp_path / "out", o, stop_after=8, log=quiet)
    assert not part.exported and not (tmp_path / "out").exists()
    done = adapt(base_model, [str(domain)], tmp_path / "out", o, resume=True, log=quiet)
    assert done.exported and done.step == 20
    assert done.heldout_before == part.heldout_before  # measured once, before any step
    assert load_artifact(tmp_path / "out").version == done.version
    with pytest.raises(InputError, match="already holds an adaptation"):
        adapt(base_model, [str(domain)], tmp_path / "elsewhere", o, log=quiet)
    again = adapt(base_model, [str(domain)], tmp_path / "out", o, overwrite=True, log=quiet)
    assert again.exported and again.heldout_before == part.heldout_before  # started over


def test_divergence_stops_it_and_nothing_is_exported(base_model, domain, tmp_path):
    with pytest.raises(TrainingDiverged) as e:
        adapt(base_model, [str(domain)], tmp_path / "out", opts(tmp_path, lr=1e6), log=quiet)
    assert not (tmp_path / "out").exists()
    # the remedy is in adapt's own flags (train's are `--set optim.lr=...`)
    assert "lower --lr and start over (--force)" in e.value.message, e.value.message
    assert_flags_exist(e.value.message)


def adapt_flags() -> set[str]:
    from elmo_pretrain.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {f for a in sub.choices["adapt"]._actions for f in a.option_strings}


def assert_flags_exist(message: str) -> None:
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", message))
    assert named and named <= adapt_flags(), (named - adapt_flags(), message)


def cli(base_model, domain, tmp_path, *extra: str) -> list[str]:
    flags = ["--steps", "6", "--lr", "3e-3", "--warmup-steps", "1", "--tokens-per-batch", "256"]
    flags += ["--n-samples", "64", "--threads", "1", "--split", "none", "--no-progress"]
    flags += ["--checkpoint-every-steps", "3", "--work-dir", str(tmp_path / "w")]
    return ["adapt", str(base_model), str(domain), "--out", str(tmp_path / "out"), *flags, *extra]


def test_a_resume_with_other_options_names_force_and_force_starts_over(
    base_model, domain, tmp_path, capsys
):
    assert main(cli(base_model, domain, tmp_path, "--stop-after", "3")) == 0
    capsys.readouterr()
    assert main([*cli(base_model, domain, tmp_path, "--resume"), "--lr", "1e-3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "pass --force to start over" in err, err
    assert_flags_exist(err)
    assert main([*cli(base_model, domain, tmp_path, "--force"), "--lr", "1e-3"]) == 0
    prov = json.loads((tmp_path / "out" / "config.json").read_text())["provenance"]
    assert prov["adapt"]["options"]["lr"] == 1e-3 and prov["adapt"]["steps"] == 6


@pytest.mark.parametrize("damage", ["truncated", "not_an_object", "no_figures", "binary"])
def test_a_damaged_adapt_json_on_resume_is_one_line(base_model, domain, tmp_path, capsys, damage):
    assert main(cli(base_model, domain, tmp_path, "--stop-after", "3")) == 0
    record = tmp_path / "w" / ADAPT_FILE
    text = record.read_text()
    record.write_bytes(
        {
            "truncated": text[: len(text) // 2].encode(),
            "not_an_object": b"[1, 2]",
            "no_figures": json.dumps({"model": "x"}).encode(),
            "binary": b"\xff\xfe\x00garbage",
        }[damage]
    )
    capsys.readouterr()
    assert main(cli(base_model, domain, tmp_path, "--resume")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is damaged" in err and str(record) in err, err
    assert_flags_exist(err)
    assert main(cli(base_model, domain, tmp_path, "--force")) == 0  # what it says works
    assert (tmp_path / "out" / "manifest.json").is_file()


def test_a_full_disk_during_the_export_is_one_line_and_resume_exports(
    base_model, domain, tmp_path, capsys, monkeypatch
):
    real = export_mod.save_artifact

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export_mod, "save_artifact", full)
    assert main(cli(base_model, domain, tmp_path)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "No space left on device" in err and "--resume" in err and "step-00000006" in err, err
    assert not (tmp_path / "out").exists()  # nothing half-written
    monkeypatch.setattr(export_mod, "save_artifact", real)
    lines: list[str] = []
    res = adapt(
        base_model,
        [str(domain)],
        tmp_path / "out",
        opts(
            tmp_path,
            steps=6,
            warmup_steps=1,
            work_dir=str(tmp_path / "w"),
            checkpoint_every_steps=3,
        ),
        resume=True,
        log=lines.append,
    )
    assert res.exported and res.step == 6  # the last checkpoint, exported: no step retrained
    assert any(x.startswith("resumed from step-00000006") for x in lines), lines
    assert load_artifact(tmp_path / "out").version == res.version


def test_a_full_disk_while_checkpointing_is_one_line(
    base_model, domain, tmp_path, capsys, monkeypatch
):
    from elmo_pretrain import checkpoint as ckpt_mod

    real = ckpt_mod.torch.save
    calls = []

    def save(obj, f, *a, **k):  # the second checkpoint (step 6) finds the disk full
        calls.append(1)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *a, **k)

    monkeypatch.setattr(ckpt_mod.torch, "save", save)
    assert main(cli(base_model, domain, tmp_path)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "No space left on device" in err and "already there are intact" in err, err
    assert [p.name for p in list_checkpoints(tmp_path / "w" / "run")] == ["step-00000003.pt"]


def test_the_base_models_tasks_are_kept(base_model, domain, tmp_path):
    """A request's `"task": "pos"` still answers on the adapted model (same layers)."""
    base = tmp_path / "base"
    shutil.copytree(base_model, base)
    mix = MixSpec(weights=[0.5, -1.0, 2.0], gamma=1.5, meta={"task": "pos", "labels": ["N"]})
    write_task(base, "pos", mix)  # tasks/ is not part of the version
    lines: list[str] = []
    res = adapt(base, [str(domain)], tmp_path / "out", opts(tmp_path, steps=3), log=lines.append)
    kept = load_artifact(tmp_path / "out").tasks
    assert set(kept) == {"pos"} and res.extra["tasks"] == ["pos"]
    assert kept["pos"].weights == mix.weights and kept["pos"].gamma == mix.gamma
    assert kept["pos"].meta["learned_on"] == {
        "model": "base",
        "version": load_artifact(base).version,
    }
    assert kept["pos"].meta["labels"] == ["N"]
    assert any(x.startswith("kept MODEL's tasks pos") for x in lines), lines
    emb = Embedder.load(tmp_path / "out", threads=1)
    plain = emb.embed(["the old man walked ."])[0]
    assert plain.layers.shape[0] == 3


@pytest.mark.parametrize("case", ["not_an_artifact", "missing", "nothing_but_unk", "out_in_use"])
def test_bad_input_is_one_line(base_model, domain, tmp_path, capsys, case):
    model, corpus, out = str(base_model), str(domain), tmp_path / "out"
    if case == "not_an_artifact":
        (tmp_path / "folder").mkdir()
        (tmp_path / "folder" / "notes.txt").write_text("hello\n")
        model, want = str(tmp_path / "folder"), "is not a model artifact"
    elif case == "missing":
        model, want = str(tmp_path / "nope"), "no such folder"
    elif case == "nothing_but_unk":  # characters the model's pieces never saw
        text = tmp_path / "thai.txt"
        text.write_text("\n\n".join(f"ภาษาไทย เป็น ภาษา ที่ สวยงาม {'มาก' * i}" for i in range(40)))
        corpus, want = str(text), "nothing but <unk>"
    else:
        out.mkdir()
        (out / "x").write_text("taken")
        want = "exists and is not empty"
    work = ["--work-dir", str(tmp_path / "w"), "--no-progress"]
    rc = main(["adapt", model, corpus, "--out", str(out), *work])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and want in err, err
    assert not (tmp_path / "w" / ADAPT_FILE).exists()
