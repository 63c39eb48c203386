"""`elmo-pretrain finetune`: the CRF, the span metric, a tiny finetune end to end, the
served task mix against the network's input, and bad input refused before any work."""

from __future__ import annotations

import itertools
import json
import math
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from elmo_pretrain.finetune import CRF, FinetuneConfig, build_task, finetune, span_f1, spans
from elmo_pretrain.finetune.data import batches, make_batch
from elmo_service.artifact import load_artifact, write_task
from elmo_service.embedder import Embedder
from elmo_service.scalar_mix import MixSpec
from tests.support.core_fixtures import tiny_artifact

torch.set_num_threads(1)

# tiny but learnable: an entity is a capitalised known name, typed by the word before it
NAMES = {"Ann": "PER", "Bob": "PER", "Rome": "LOC", "Oslo": "LOC"}
FILLER = ["the", "dog", "runs", "sees", "a", "red", "cat"]


def _ner_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words, tags = [], []
        for _ in range(rng.randint(2, 5)):
            if rng.random() < 0.3:
                name = rng.choice(sorted(NAMES))
                words.append(name)
                tags.append("B-" + NAMES[name])
            else:
                words.append(rng.choice(FILLER))
                tags.append("O")
        rows.append({"words": words, "tags": tags})
    return rows


def _write(folder, rows_by_split):
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in rows_by_split.items():
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _ner_data(folder):
    return _write(
        folder, {"train": _ner_rows(60, 0), "dev": _ner_rows(20, 1), "test": _ner_rows(20, 2)}
    )


# ------------------------------------------------------------------ CRF and metric


@torch.no_grad()
def _brute_force(crf: CRF, em: torch.Tensor, n: int):
    """Every tag sequence of length n: its score; log Z and the best path by enumeration."""
    k = em.shape[-1]
    scores = {}
    for path in itertools.product(range(k), repeat=n):
        tags = torch.tensor([path])
        mask = torch.ones(1, n, dtype=torch.bool)
        scores[path] = crf.path_score(em[None, :n], tags, mask)[0]
    all_ = torch.stack(list(scores.values()))
    return torch.logsumexp(all_, 0), max(scores, key=lambda p: float(scores[p]))


def test_crf_forward_algorithm_and_viterbi_match_enumeration():
    torch.manual_seed(0)
    crf = CRF(3)
    for p in crf.parameters():
        torch.nn.init.normal_(p)
    em = torch.randn(2, 4, 3)
    mask = torch.tensor([[True] * 4, [True, True, False, False]])  # the second is 2 long
    log_z = crf.log_partition(em, mask).detach()
    best = crf.decode(em, mask)
    for b, n in enumerate((4, 2)):
        want_z, want_path = _brute_force(crf, em[b], n)
        assert abs(float(log_z[b]) - float(want_z)) < 1e-5
        assert best[b] == list(want_path)
    nll = crf.nll(em, torch.tensor([[0, 1, 2, 0], [2, 2, 0, 0]]), mask)
    assert bool((nll > 0).all())  # a probability below 1


def test_spans_are_exact_bio_spans():
    assert spans(["B-PER", "I-PER", "O", "B-LOC"]) == {(0, 2, "PER"), (3, 4, "LOC")}
    # conlleval: an I- that does not continue its type starts a span
    assert spans(["O", "I-PER", "I-LOC"]) == {(1, 2, "PER"), (2, 3, "LOC")}
    assert span_f1([["B-PER", "I-PER"]], [["B-PER", "I-PER"]]) == 1.0
    # a span cut short is wrong, not half right
    assert span_f1([["B-PER", "I-PER", "O"]], [["B-PER", "O", "O"]]) == 0.0
    assert span_f1([["B-PER", "O", "B-LOC"]], [["B-PER", "O", "O"]]) == pytest.approx(2 / 3)


# ------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_tiny_finetune_reports_both_arms_and_stores_the_mix(tmp_path, capsys):
    from elmo_pretrain.cli import main

    model = tiny_artifact(tmp_path / "m")
    data = _ner_data(tmp_path / "ner")
    out, report = tmp_path / "run", tmp_path / "r" / "ner.md"
    rc = main([
        "finetune", "tagging", "--model", str(model), "--data", str(data), "--task-name", "names",
        "--cache", str(tmp_path / "c"), "--out", str(out), "--report", str(report),
        "--seeds", "2", "--epochs", "1", "--hidden", "8", "--threads", "1", "--store",
    ])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "| ELMo + baseline |" in text and "relative error reduction" in text
    md = report.read_text()
    assert "Metric: span F1 (exact BIO spans)" in md  # the tags are BIO: span F1, with a CRF
    assert "elmo-pretrain finetune tagging" in md
    rows = json.loads(report.with_suffix(".json").read_text())
    assert [r["name"] for r in rows] == ["baseline", "elmo+baseline", "probe"]
    for r in rows:
        assert len(r["seeds"]) == 2 and 0.0 <= r["test"] <= 1.0 and r["std"] >= 0.0
        assert r["test"] == pytest.approx(np.mean([s["test"] for s in r["seeds"]]))
    elmo = rows[1]
    assert elmo["increase"] == pytest.approx(elmo["test"] - rows[0]["test"])
    err = 1 - rows[0]["test"]
    if err > 0:
        assert elmo["relative_error_reduction"] == pytest.approx(elmo["increase"] / err)
    # the run folder holds the same report and the task; the model holds the task too
    assert (out / "report.md").is_file() and json.loads((out / "report.json").read_text()) == rows
    stored = load_artifact(model).tasks["names"]
    assert stored.meta["learned_by"] == "elmo-pretrain finetune"
    assert stored.meta["labels"] == ["B-LOC", "B-PER", "O"]
    assert json.loads((out / "task.json").read_text())["weights"] == stored.weights


@pytest.mark.slow
def test_the_served_task_mix_is_the_finetuned_networks_input(tmp_path):
    """Stored with the model, the task's mix in /v1/embed equals ELMo_k as the trained
    network consumed it, within 1e-5."""
    from fastapi.testclient import TestClient

    from elmo_api.main import create_app
    from elmo_api.settings import load_settings
    from elmo_pretrain.probe.service import save_task
    from elmo_pretrain.probe.tasks import label_set, load_task_data

    model = tiny_artifact(tmp_path / "m")
    data_dir = _ner_data(tmp_path / "ner")
    data = load_task_data("tagging", data_dir, fetch=False)
    classes = label_set("tagging", data)
    cfg = FinetuneConfig(epochs=3, hidden=16, lr=1e-2)
    art = load_artifact(model)
    task = build_task(art, data, classes, True, "span-f1", True, cfg, tmp_path / "c", log=print)
    ft = finetune(art, task, cfg, ["elmo+baseline"], 1, "names", log=lambda _: None)
    net = ft.arm("elmo+baseline").best().network.eval()
    # the mix moved away from its initial uniform weights and gamma 1
    assert ft.spec.weights != [0.0] * 3 or ft.spec.gamma != 1.0
    save_task(ft.spec, "names", model_dir=model)

    split = task.splits["test"]
    idx = np.arange(4)
    with torch.no_grad():
        want = net.elmo_input(make_batch(split, idx, True)).numpy()
    sentences = [data["test"][i][0] for i in idx]
    settings = load_settings(model_path=model, threads=1, data_dir=tmp_path)
    with TestClient(create_app(settings)) as client:
        r = client.post(
            "/v1/embed", json={"sentences": sentences, "task": "names", "granularity": "word"}
        )
        assert r.status_code == 200, r.text
        for j, sent in enumerate(r.json()["data"]):
            got = np.array(sent["mix"]["data"], dtype=np.float32)
            assert got.shape == (len(sentences[j]), want.shape[-1])
            np.testing.assert_allclose(got, want[j, : len(sentences[j])], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_sentence_classification_with_elmo_at_both(tmp_path, capsys):
    from elmo_pretrain.cli import main

    model = tiny_artifact(tmp_path / "m")
    rng = random.Random(0)
    topics = {"pets": ["dog", "cat"], "moves": ["runs", "sees"]}

    def rows(n):
        out = []
        for _ in range(n):
            label = rng.choice(sorted(topics))
            out.append(
                {"text": " ".join(rng.choice(topics[label]) for _ in range(3)), "label": label}
            )
        return out

    data = _write(tmp_path / "topic", {"train": rows(40), "dev": rows(12), "test": rows(12)})
    rc = main([
        "finetune", "classification", "--model", str(model), "--data", str(data),
        "--task-name", "topic", "--cache", str(tmp_path / "c"), "--out", str(tmp_path / "run"),
        "--seeds", "1", "--epochs", "2", "--hidden", "8", "--threads", "1", "--elmo-at", "both",
        "--no-baseline", "--no-probe",
    ])  # fmt: skip
    assert rc == 0
    rows_ = json.loads((tmp_path / "run" / "report.json").read_text())
    assert [r["name"] for r in rows_] == ["elmo+baseline"] and "increase" not in rows_[0]
    assert "Metric: accuracy" in (tmp_path / "run" / "report.md").read_text()
    task = json.loads((tmp_path / "run" / "task.json").read_text())
    assert task["meta"]["elmo_at"].startswith("both") and len(task["weights"]) == 3


def test_batches_cover_every_sentence_once():
    from elmo_pretrain.finetune.data import Vocab, encode

    sents = [["a"] * n for n in (3, 1, 5, 2, 4, 1, 2)]
    split = encode(sents, [[0] * len(s) for s in sents], Vocab.build(sents, 1), 4, None)
    for rng in (None, np.random.default_rng(0)):
        got = np.concatenate(batches(split, 3, rng))
        assert sorted(got.tolist()) == list(range(len(sents)))
    b = make_batch(split, np.array([1, 2]), True)
    assert b.mask.sum().item() == 6 and b.words.shape == (2, 5)


# ------------------------------------------------------------------ bad input


def _finetune(tmp_path, model, data, *extra):
    from elmo_pretrain.cli import main

    return main([
        "finetune", "tagging", "--model", str(model), "--data", str(data), "--task-name", "t",
        "--cache", str(tmp_path / "c"), "--out", str(tmp_path / "run"), "--threads", "1",
        "--epochs", "1", "--seeds", "1", *extra,
    ])  # fmt: skip


GOOD = '{"words": ["a", "b"], "tags": ["B-X", "O"]}\n'


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"train": '{"words": ["a", "b"], "tags": ["O"]}\n'}, "train.jsonl:1: 2 words but 1 tags"),
        ({"dev": ""}, "dev.jsonl: no examples"),
    ],
)  # fmt: skip
def test_bad_data_is_one_line_naming_the_file_and_line_before_any_work(
    tmp_path, capsys, files, message
):
    model = tiny_artifact(tmp_path / "m")
    data = tmp_path / "d"
    data.mkdir()
    for split in ("train", "dev", "test"):
        (data / f"{split}.jsonl").write_text(files.get(split, GOOD))
    assert _finetune(tmp_path, model, data) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "c").exists() and not (tmp_path / "run").exists()


def _with_unseen_test_tags(folder, tags=("SYM", "SYM", "LS")):
    """NER data whose test split has 3 tokens tagged with ``tags``, never seen in training."""
    rows = {"train": _ner_rows(40, 0), "dev": _ner_rows(10, 1), "test": _ner_rows(10, 2)}
    test = rows["test"]
    test[0]["tags"][0], test[3]["tags"][-1], test[5]["tags"][0] = tags
    return _write(folder, rows), sum(len(r["words"]) for r in test)


def test_a_test_tag_never_seen_in_training_is_a_wrong_prediction_counted_in_the_report(
    tmp_path, capsys
):
    """A real split's test file (PTB: LS, SYM) may hold tags the training sentences lack:
    the run goes to the end, and the report says how many test tokens carry one."""
    model = tiny_artifact(tmp_path / "m")
    data, total = _with_unseen_test_tags(tmp_path / "d")
    assert _finetune(tmp_path, model, data, "--metric", "accuracy", "--no-probe") == 0
    out = capsys.readouterr().out
    line = f"3 of {total} test tokens ({100 * 3 / total:.2f} %) carry tags never seen in training (LS, SYM)"
    assert line in out  # said before training, and in the report
    assert line in (tmp_path / "run" / "report.md").read_text()
    rows = json.loads((tmp_path / "run" / "report.json").read_text())
    assert [r["name"] for r in rows] == ["baseline", "elmo+baseline"]
    for r in rows:
        assert r["unseen_labels"]["labels"] == ["LS", "SYM"]
        assert r["unseen_labels"]["test"] == {"count": 3, "of": total}
        assert r["unseen_labels"]["dev"]["count"] == 0
        # those 3 tokens are wrong whatever the network learned
        assert all(s["test"] <= (total - 3) / total + 1e-9 for s in r["seeds"])
    # scores print as percentages, never as bare numbers that read as fractions
    assert re.search(r"\| ELMo \+ baseline \| \d+\.\d\d % \| \d+\.\d\d ± \d+\.\d\d % \|", out)
    assert re.search(r"seed 0 done: dev \d+\.\d\d % test \d+\.\d\d % ", out)


@pytest.mark.parametrize(
    ("metric", "tags"),
    [("accuracy", ("SYM", "SYM", "LS")), ("span-f1", ("B-NEW", "B-NEW", "B-ODD"))],
)
def test_an_unseen_label_is_scored_wrong_even_for_a_perfect_network(tmp_path, metric, tags):
    """An oracle that predicts every trained label right still misses the unseen ones:
    accuracy loses exactly those tokens; span F1 misses the spans they start."""
    from elmo_pretrain.finetune.train import evaluate
    from elmo_pretrain.probe.tasks import label_set, load_task_data

    folder, total = _with_unseen_test_tags(tmp_path / "d", tags)
    data = load_task_data("tagging", folder, fetch=False)
    classes = label_set("tagging", data, allow_unseen=True)
    assert classes == ["B-LOC", "B-PER", "O"]
    cfg = FinetuneConfig(hidden=4)
    task = build_task(
        load_artifact(tiny_artifact(tmp_path / "m")), data, classes, True, metric, False, cfg,
        tmp_path / "c", log=lambda _: None,
    )  # fmt: skip
    assert task.unseen == sorted(set(tags)) and task.unseen_counts["test"] == (3, total)

    class Oracle:
        def eval(self):
            return self

        def predict(self, batch):
            k = len(classes)  # the network's outputs: an unseen label is not among them
            return [
                [t if t < k else classes.index("O") for t in batch.labels[b, :n].tolist()]
                for b, n in enumerate(batch.mask.sum(1).tolist())
            ]

    got = evaluate(Oracle(), task, task.splits["test"])
    if metric == "accuracy":
        assert got == pytest.approx((total - 3) / total)
    else:
        gold = [r[1] for r in data["test"]]
        pred = [[t if t in classes else "O" for t in tags] for tags in gold]
        assert got == pytest.approx(span_f1(gold, pred)) and got < 1.0


def test_the_probe_still_refuses_a_label_never_seen_in_training(tmp_path):
    from elmo_pretrain.probe.tasks import load_for_command
    from elmo_service.errors import InputError

    folder, _ = _with_unseen_test_tags(tmp_path / "d")
    refused = r"test.jsonl:1: tags \['LS', 'SYM'\] are not in the training"
    with pytest.raises(InputError, match=refused):
        load_for_command("tagging", str(folder), fetch=False)


def test_a_task_name_the_model_ships_is_refused_unless_overwrite(tmp_path, capsys):
    model = tiny_artifact(tmp_path / "m")
    write_task(model, "t", MixSpec.average(3))
    data = tmp_path / "d"
    data.mkdir()
    for split in ("train", "dev", "test"):
        (data / f"{split}.jsonl").write_text(GOOD)
    assert _finetune(tmp_path, model, data, "--store") == 2
    err = capsys.readouterr().err
    assert "ships a task named 't'" in err and "--overwrite" in err
    assert not (tmp_path / "c").exists()


def test_a_shipped_task_with_another_layer_count_is_named(tmp_path, capsys):
    model = tiny_artifact(tmp_path / "m")
    (model / "tasks").mkdir()
    (model / "tasks" / "old.json").write_text(json.dumps({"weights": [0.0] * 5, "gamma": 1.0}))
    data = tmp_path / "d"
    data.mkdir()
    for split in ("train", "dev", "test"):
        (data / f"{split}.jsonl").write_text(GOOD)
    assert _finetune(tmp_path, model, data) == 2
    err = capsys.readouterr().err.strip()
    assert "old.json" in err and "3 weights" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "c").exists()


def test_ctrl_c_leaves_no_output_files(tmp_path, monkeypatch):
    """Interrupted in training: no report, no task. Interrupted while the report is
    being committed: the previous report stays whole, and no temporary is left."""
    import elmo_pretrain.finetune.run as run_mod
    from elmo_pretrain.finetune.report import write_report
    from elmo_pretrain.finetune.run import Finetuned
    from elmo_pretrain.finetune.train import ArmResult, Run
    from elmo_service import atomic

    model = tiny_artifact(tmp_path / "m")
    data = _ner_data(tmp_path / "ner")

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_mod, "run_arms", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _finetune(tmp_path, model, data, "--store")
    assert not (tmp_path / "run").exists()
    assert not (model / "tasks").exists()

    # an interrupt at the rename of an atomic write
    monkeypatch.undo()
    report = tmp_path / "r" / "report.md"
    report.parent.mkdir()
    report.write_text("old report\n")
    monkeypatch.setattr(atomic.os, "replace", interrupted)

    task = type("T", (), {"metric": "accuracy", "unseen": []})()  # all the report reads
    ft = Finetuned(
        task, [ArmResult("baseline", [Run("baseline", 0, 0.5, 0.4, 1, 1.0, None)])], None
    )
    with pytest.raises(KeyboardInterrupt):
        write_report(report, "t", ft, "cmd")
    assert report.read_text() == "old report\n"
    assert sorted(p.name for p in report.parent.iterdir()) == ["report.md"]


@pytest.mark.slow
def test_finetune_registers_in_a_service_that_serves_its_model_only(tmp_path, capsys):
    import httpx

    from elmo_api.main import create_app
    from elmo_api.settings import load_settings
    from tests.support.live_server import LiveServer

    model = tiny_artifact(tmp_path / "m")
    other = tiny_artifact(tmp_path / "other", seed=1)
    write_task(model, "shipped", MixSpec.average(3))
    data = _ner_data(tmp_path / "ner")
    settings = load_settings(model_path=model, threads=1, data_dir=tmp_path, admin_keys="admin")
    with LiveServer(create_app(settings)) as srv:
        service = ("--service", srv.url, "--admin-key", "admin")
        # learned on another model version: refused before any work, both versions named
        assert _finetune(tmp_path, other, data, *service) == 2
        err = capsys.readouterr().err
        assert "serves model version" in err and load_artifact(other).version in err
        # a name the served model ships: refused unless --overwrite
        assert _finetune(tmp_path, model, data, *service, "--task-name", "shipped") == 2
        assert "ships a task named 'shipped'" in capsys.readouterr().err
        assert not (tmp_path / "c").exists()

        assert _finetune(tmp_path, model, data, *service, "--hidden", "8") == 0
        assert f"task stored: {srv.url}/v1/tasks/t" in capsys.readouterr().out
        got = httpx.get(f"{srv.url}/v1/tasks/t").json()
        saved = json.loads((tmp_path / "run" / "task.json").read_text())
        assert got["weights"] == saved["weights"] and got["gamma"] == saved["gamma"]
        assert got["meta"]["model_version"] == load_artifact(model).version


# ------------------------------------------------------------------ --adapt (paper §3.4)


def test_the_adaptation_text_is_training_and_dev_never_test(tmp_path):
    from elmo_pretrain.finetune.adapted import task_text
    from elmo_pretrain.probe.tasks import load_task_data

    data = load_task_data("tagging", _ner_data(tmp_path / "ner"), fetch=False)
    text = task_text(data, tokens=True)
    assert text == [" ".join(w) for w, _ in data["train"] + data["dev"]]
    sentences = {"a fine film .": 1, "a dull film .": 0, "the best of the year": 1}
    rows = {s: [(t, y) for t, y in sentences.items()] for s in ("train", "dev")}
    rows["test"] = [("never read", 0)]
    assert task_text(rows, tokens=False) == [*sentences, *sentences]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--no-elmo"], "--no-elmo needs --adapt"),
        (["--adapt", "--no-elmo", "--store"], "--store / --service keep the ELMo + baseline mix"),
        (["--adapt", "--adapt-steps", "0"], "adapt_steps"),
    ],
)
def test_adapt_flags_that_make_no_sense_are_one_line_before_any_work(
    tmp_path, capsys, flags, message
):
    model = tiny_artifact(tmp_path / "m")
    data = _ner_data(tmp_path / "ner")
    assert _finetune(tmp_path, model, data, *flags) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "c").exists() and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_finetune_adapt_adds_the_adapted_row_and_never_adapts_on_test(tmp_path, capsys):
    """--adapt: the biLM is continued (elmo_pretrain.adapt) on the training and dev text only;
    the report gains adapted+baseline with the adaptation's perplexities and time; a second
    run (another seed's process) reuses the same adapted model."""
    from elmo_pretrain.finetune.report import perplexity_text as ppl

    model = tiny_artifact(tmp_path / "m")
    folder = tmp_path / "ner"
    rows = {"train": _ner_rows(60, 0), "dev": _ner_rows(20, 1), "test": _ner_rows(20, 2)}
    for i, r in enumerate(rows["test"]):  # words no other split has: never in the corpus
        r["words"][0] = f"testonly{i}"
    _write(folder, rows)
    flags = ["--adapt", "--adapt-steps", "4", "--adapt-lr", "3e-3", "--no-probe"]
    assert _finetune(tmp_path, model, folder, *flags) == 0
    out = capsys.readouterr().out
    # adapted first, then the arms are trained
    assert out.index("Adaptation (§3.4)") < out.index("seed 0 done")
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert [r["name"] for r in report] == ["baseline", "elmo+baseline", "adapted+baseline"]
    adapted = report[2]
    a = adapted["adaptation"]
    assert a["sentences"] == 80 and a["steps"] == 4 and a["reused"] is False
    assert math.isfinite(a["perplexity_before"]) and math.isfinite(a["perplexity_after"])
    assert a["seconds"] > 0
    assert adapted["increase"] == pytest.approx(adapted["test"] - report[0]["test"])
    md = (tmp_path / "run" / "report.md").read_text()
    assert "| ELMo adapted to the task's text (§3.4) + baseline |" in md
    assert (
        f"held-out perplexity **{ppl(a['perplexity_before'])} → {ppl(a['perplexity_after'])}**"
        in md
    )

    # the adaptation's text: every training and dev sentence, no test word
    corpus = (Path(a["model"]).parent / "corpus.txt").read_text()
    assert corpus.splitlines() == [" ".join(r["words"]) for r in rows["train"] + rows["dev"]]
    assert "testonly" not in corpus
    # the adapted model is another model, and serves: its mix is for it, not the original
    new = load_artifact(Path(a["model"]))
    assert new.version != load_artifact(model).version
    mix = json.loads((tmp_path / "run" / "adapted-task.json").read_text())
    assert mix["meta"]["model_version"] == new.version
    assert np.isfinite(Embedder(new, device="cpu").embed([["the", "dog"]])[0].layers).all()

    # another process (seed 1, the adapted row only) reuses that adaptation
    more = ["--first-seed", "1", "--no-baseline", "--no-elmo", "--out", str(tmp_path / "run1")]
    assert _finetune(tmp_path, model, folder, *flags, *more) == 0
    assert "[adapt] reusing the adapted model" in capsys.readouterr().out
    again = json.loads((tmp_path / "run1" / "report.json").read_text())
    assert [r["name"] for r in again] == ["adapted+baseline"]
    assert again[0]["adaptation"]["reused"] is True
    assert again[0]["adaptation"]["model"] == a["model"]


def test_max_train_spreads_over_a_file_sorted_by_label(tmp_path):
    """The polarity data lists every positive sentence first: the first N would be one
    class (a run that "works" and learns nothing). --max-train takes N spread evenly."""
    from elmo_pretrain.probe.tasks import load_for_command

    rows = [{"text": f"good {i}", "label": "pos"} for i in range(30)]
    rows += [{"text": f"bad {i}", "label": "neg"} for i in range(20)]
    few = [{"text": "good x", "label": "pos"}, {"text": "bad x", "label": "neg"}]
    folder = _write(tmp_path / "d", {"train": rows, "dev": few, "test": few})
    data, classes = load_for_command("classification", str(folder), False, max_train=10)
    got = data["train"]
    assert len(got) == 10 and classes == ["neg", "pos"]
    assert [y for _, y in got].count("neg") == 4  # the file's 40 % negatives, kept
    order = [r["text"] for r in rows]
    assert [t for t, _ in got] == sorted((t for t, _ in got), key=order.index)  # file order
    all_, _ = load_for_command("classification", str(folder), False, max_train=500)
    assert len(all_["train"]) == 50


# ------------------------------------------------------------------ the fast evaluation


def _old_make_batch(split, index, tokens):
    """make_batch as it was (one sentence at a time): the reference for the scatter."""
    from elmo_pretrain.finetune.data import Batch

    lengths = [len(split.words[i]) for i in index]
    b, t = len(index), max(lengths)
    words = torch.zeros(b, t, dtype=torch.long)
    chars = torch.zeros(b, t, split.chars[index[0]].shape[1], dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.bool)
    labels = torch.zeros(b, t, dtype=torch.long) if tokens else torch.zeros(b, dtype=torch.long)
    elmo = None
    if split.elmo is not None:
        elmo = torch.zeros(split.elmo.shape[1], b, t, split.elmo.shape[2])
    for j, (i, n) in enumerate(zip(index, lengths, strict=True)):
        words[j, :n] = torch.from_numpy(split.words[i])
        chars[j, :n] = torch.from_numpy(split.chars[i])
        mask[j, :n] = True
        if tokens:
            labels[j, :n] = torch.from_numpy(split.labels[i])
        else:
            labels[j] = int(split.labels[i][0])
        if elmo is not None:
            rows = split.elmo[split.offsets[i] : split.offsets[i + 1]]
            elmo[:, j, :n] = torch.from_numpy(np.array(rows)).transpose(0, 1)
    return Batch(words, chars, mask, labels, elmo, np.asarray(index))


@torch.no_grad()
def _old_evaluate(net, task, split, batch_size=256):
    """evaluate as it was: the character CNN on every word of every batch."""
    from elmo_pretrain.finetune.train import score

    net.eval()
    gold, pred = [], []
    for idx in batches(split, batch_size, None):
        pred += net.predict(_old_make_batch(split, idx, task.tokens))
        gold += [split.labels[i].tolist() if task.tokens else int(split.labels[i][0]) for i in idx]
    return score(task, gold, pred)


@pytest.mark.parametrize(("tokens", "metric", "crf"), [(True, "accuracy", False),
                                                        (True, "span-f1", True),
                                                        (False, "accuracy", False)])  # fmt: skip
def test_the_fast_evaluation_gives_exactly_the_old_metrics(tmp_path, tokens, metric, crf):
    """The batched evaluation (one scatter per batch, the character CNN once per spelling)
    scores every arm exactly as the per-word evaluation did, and make_batch's tensors are
    the old ones bit for bit (so training is unchanged too)."""
    from elmo_pretrain.finetune.train import evaluate, train_run
    from elmo_pretrain.probe.tasks import label_set, load_task_data

    if tokens:
        folder = _ner_data(tmp_path / "d")
    else:
        rng = random.Random(3)
        vocab = ["dog", "cat", "runs", "sees", "Dogs", "catz", "x"]

        def rows(n):
            return [
                {"text": " ".join(rng.choice(vocab) for _ in range(rng.randint(1, 6))),
                 "label": rng.choice(["a", "b"])} for _ in range(n)
            ]  # fmt: skip

        folder = _write(tmp_path / "d", {"train": rows(40), "dev": rows(25), "test": rows(25)})
    kind = "tagging" if tokens else "classification"
    data = load_task_data(kind, folder, fetch=False)
    classes = label_set(kind, data)
    cfg = FinetuneConfig(epochs=2, hidden=8, lr=1e-2, batch_size=8)
    art = load_artifact(tiny_artifact(tmp_path / "m"))
    task = build_task(art, data, classes, tokens, metric, crf, cfg, tmp_path / "c", log=print)
    for name, split in task.splits.items():
        words = [r[0] if tokens else r[0].split() for r in data[name]]
        for sent, chars in zip(words, split.chars, strict=True):  # encode's old loop
            want = np.zeros((len(sent), cfg.max_word_chars), dtype=np.int64)
            for i, w in enumerate(sent):
                ids = [task.vocab.chars.get(ch, 1) for ch in w[: cfg.max_word_chars]]
                want[i, : len(ids)] = ids
            assert np.array_equal(chars, want)
        for idx in batches(split, 7, np.random.default_rng(1)):
            new, old = make_batch(split, idx, tokens), _old_make_batch(split, idx, tokens)
            for f in ("words", "chars", "mask", "labels", "elmo"):
                assert torch.equal(getattr(new, f), getattr(old, f)), (name, f)
    scores = set()
    for arm in ("baseline", "elmo+baseline", "probe"):
        net = train_run(arm, task, cfg, 0, log=lambda _: None).network
        # the whole splits, and early stopping's head of dev (its own spelling table)
        for name, split in [*task.splits.items(), ("dev head", task.splits["dev"].head(9))]:
            for size in (3, 256):  # a batch of a few sentences, and all in one
                got = evaluate(net, task, split, size)
                assert got == _old_evaluate(net, task, split, size), (arm, name, size)
                scores.add(got)
    assert len(scores) > 1  # the networks differ: the comparison is not of constants


def test_split_layers_are_the_probes_word_features_bit_for_bit(tmp_path, monkeypatch):
    """The finetuner's embedding gives the probe's word vectors exactly (the cached layers
    of earlier runs stay valid): the same batches, and the pieces' averaging bit for bit."""
    import elmo_pretrain.finetune.data as data_mod
    from elmo_pretrain.probe.features import word_features
    from elmo_service.values import Token, average_words

    # the averaging, on words cut into 1-4 pieces (the tiny model's tokenizer cuts none)
    g = np.random.default_rng(0)
    for _ in range(20):
        pieces = g.integers(1, 5, size=int(g.integers(1, 8)))
        ts = [Token("p", 0, 1, w) for w, n in enumerate(pieces) for _ in range(n)]
        layers = g.standard_normal((3, len(ts), 8)).astype(np.float32)
        got = data_mod.average_pieces(layers, ts)
        assert got.shape == (3, len(pieces), 8)
        assert np.array_equal(got, average_words(layers, ts, axis=1))

    art = load_artifact(tiny_artifact(tmp_path / "m"))
    rng = random.Random(5)
    sents = [
        [rng.choice(["dog", "Antidisestablishment", "x", "catalogue", "runs"]) for _ in range(n)]
        for n in (rng.randint(1, 9) for _ in range(40))
    ]
    monkeypatch.setattr(data_mod, "CHUNK_SENTENCES", 7)  # several chunks, several batches

    def fresh():  # the same token cache history on both sides
        return Embedder(art, batch_tokens=24, max_sentence_tokens=10_000)

    want = word_features(fresh(), sents, chunk=7, dtype=np.float32)
    got = data_mod.split_layers(fresh(), sents)
    assert got.shape == (sum(map(len, sents)), 3, fresh().dim)
    assert np.array_equal(got, want)
