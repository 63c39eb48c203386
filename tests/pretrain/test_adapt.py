"""`elmo-pretrain adapt`: continue pretraining a model on new text (ELMo section 3.4).

A tiny model is trained here (sentencepiece, 40 steps), exported, then adapted to text of
another seed; a random-weight word-tokenized artifact stands for a converted published ELMo
(no softmax shipped)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from elmo_service.artifact import load_artifact
from elmo_service.embedder import Embedder
from elmo_service.errors import InputError
from pretrain import train as train_mod
from pretrain.adapt import SOFTMAX_FILE, adapt
from pretrain.adapt_options import ADAPT_FILE, AdaptOptions
from pretrain.cli import main
from pretrain.config import load_config
from pretrain.data import Corpus
from pretrain.export import export
from pretrain.prepare import PrepareOptions, prepare
from pretrain.sources.synthetic import write_corpus
from pretrain.train import TrainingDiverged, run_training
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
    """A converted published ELMo: word tokenizer, biLM only."""
    model = tiny_artifact(tmp_path / "published")
    res = adapt(model, [str(domain)], tmp_path / "out", opts(tmp_path, steps=40), log=quiet)
    assert res.softmax.startswith("initialised from the model's token vectors")
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
    with pytest.raises(TrainingDiverged):
        adapt(base_model, [str(domain)], tmp_path / "out", opts(tmp_path, lr=1e6), log=quiet)
    assert not (tmp_path / "out").exists()


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
