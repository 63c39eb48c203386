"""The task probe runs end to end on a tiny model and learns what it can."""

import json
import random

import numpy as np
import pytest

from elmo_pretrain.probe import ProbeConfig, polarity_probe, pos_probe, results_table, save_task
from elmo_service.artifact import load_artifact
from elmo_service.embedder import Embedder
from elmo_service.scalar_mix import MixSpec
from tests.support.core_fixtures import tiny_artifact


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """Default run folders (runs/probe/...) land in the test's folder, not the checkout."""
    monkeypatch.chdir(tmp_path)


VOCAB = {
    "dog": "NOUN",
    "cat": "NOUN",
    "runs": "VERB",
    "sees": "VERB",
    "the": "DET",
    "a": "DET",
    "red": "ADJ",
}
TAGS = ["NOUN", "VERB", "DET", "ADJ"]


def _pos_data(n, seed):
    rng = random.Random(seed)
    words = list(VOCAB)
    out = []
    for _ in range(n):
        sent = [rng.choice(words) for _ in range(rng.randint(2, 7))]
        out.append((sent, [VOCAB[w] for w in sent]))
    return out


@pytest.mark.slow
def test_pos_probe_end_to_end(tmp_path):
    model = tiny_artifact(tmp_path / "m")
    data = {"train": _pos_data(200, 0), "dev": _pos_data(40, 1), "test": _pos_data(40, 2)}
    cfg = ProbeConfig(epochs=25, batch_size=64, lr=1e-2)
    results, spec = pos_probe(model, data, TAGS, tmp_path / "cache", cfg, log=lambda _: None)
    names = [r.name for r in results]
    assert names == [
        "layer 0 (context-free)", "layer 1 alone", "layer 2 alone", "scalar mix",
        "per-direction mix", "random weights, scalar mix",
    ]  # fmt: skip
    by = {r.name: r for r in results}
    # tags are a function of the word: the token layer alone must get (nearly) all of them
    assert by["layer 0 (context-free)"].test_acc > 0.95
    assert by["scalar mix"].test_acc > 0.9
    assert len(spec.weights) == 3 and spec.meta["task"] == "pos"
    assert "| scalar mix |" in results_table(results)
    # features were cached per model version and split
    assert len(list((tmp_path / "cache").rglob("*.npy"))) == 6

    save_task(spec, "pos", model_dir=model)
    art = load_artifact(model)
    assert art.tasks["pos"].weights == spec.weights
    # the stored task works through the embedder's mix
    emb = Embedder(art, device="cpu")
    from elmo_service.embedder import apply_mix

    layers = emb.embed([["the", "dog"]])[0].layers
    assert apply_mix(layers, art.tasks["pos"]).shape == (2, emb.dim)


@pytest.mark.slow
def test_polarity_probe_runs(tmp_path):
    model = tiny_artifact(tmp_path / "m")
    rng = random.Random(0)
    pos_words, neg_words = ["good", "great", "fine"], ["bad", "awful", "poor"]

    def make(n):
        out = []
        for _ in range(n):
            y = rng.randint(0, 1)
            words = [rng.choice(pos_words if y else neg_words)] + [
                rng.choice(["film", "plot", "the"]) for _ in range(3)
            ]
            rng.shuffle(words)
            out.append((" ".join(words), y))
        return out

    data = {"train": make(200), "dev": make(50), "test": make(50)}
    results, spec = polarity_probe(
        model,
        data,
        tmp_path / "cache",
        ProbeConfig(epochs=40, batch_size=32, lr=1e-2),
        log=lambda _: None,
    )
    assert all(0.0 <= r.test_acc <= 1.0 for r in results)
    assert max(r.test_acc for r in results) > 0.7
    assert np.isfinite(spec.gamma)


@pytest.mark.slow
def test_probe_command_stores_the_task(tmp_path, capsys):
    import json

    from elmo_pretrain.cli import main

    model = tiny_artifact(tmp_path / "m")
    data = tmp_path / "brown"
    data.mkdir()
    for split, n, seed in (("train", 120, 0), ("dev", 30, 1), ("test", 30, 2)):
        with open(data / f"brown.{split}.jsonl", "w") as f:
            for words, tags in _pos_data(n, seed):
                universal = [
                    "NOUN"
                    if t == "NOUN"
                    else "VERB"
                    if t == "VERB"
                    else "DET"
                    if t == "DET"
                    else "ADJ"
                    for t in tags
                ]
                f.write(json.dumps({"words": words, "tags": universal}) + "\n")
    report = tmp_path / "report.md"
    rc = main([
        "probe", "pos", "--model", str(model), "--data", str(data), "--cache", str(tmp_path / "c"),
        "--epochs", "3", "--report", str(report), "--store", "--threads", "1",
    ])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    assert "| scalar mix |" in out and "task stored:" in out
    assert "elmo-pretrain probe pos" in report.read_text()
    assert "pos" in load_artifact(model).tasks

    # a --max-train slice gets its own cache entry: a later full run must not reuse it
    rc = main([
        "probe", "pos", "--model", str(model), "--data", str(data), "--cache", str(tmp_path / "c"),
        "--epochs", "1", "--max-train", "50", "--threads", "1",
    ])  # fmt: skip
    assert rc == 0
    trained = [p for p in (tmp_path / "c").rglob("train-*.npy") if "random" not in str(p)]
    sizes = sorted(np.load(p, mmap_mode="r").shape[0] for p in trained)
    assert len(sizes) == 2 and sizes[0] < sizes[1]


def test_probe_command_without_data_says_how_to_fetch(tmp_path, capsys):
    from elmo_pretrain.cli import main

    model = tiny_artifact(tmp_path / "m")
    rc = main(["probe", "pos", "--model", str(model), "--data", str(tmp_path / "none")])
    assert rc == 2
    assert "--fetch" in capsys.readouterr().err


def test_probe_command_checks_the_model_before_the_data(tmp_path, capsys, monkeypatch):
    """A wrong --model is named at once: no data is read or fetched first."""
    import elmo_pretrain.probe.tasks as tasks
    from elmo_pretrain.cli import main

    def no_fetch(*a, **k):
        raise AssertionError("data read before the model was checked")

    monkeypatch.setattr(tasks, "load_task_data", no_fetch)
    rc = main(["probe", "pos", "--model", str(tmp_path / "nope"), "--fetch"])
    assert rc == 2
    assert "model directory" in capsys.readouterr().err


def _write_jsonl(path, rows):
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.slow
def test_probe_learns_a_users_own_tagging_task(tmp_path, capsys):
    from elmo_pretrain.cli import main

    model = tiny_artifact(tmp_path / "m")
    data = tmp_path / "ner"
    data.mkdir()
    tag = {"dog": "ANIMAL", "cat": "ANIMAL", "red": "COLOUR"}  # every other word: "O"
    for split, n, seed in (("train", 120, 0), ("dev", 30, 1), ("test", 30, 2)):
        rows = [{"words": w, "tags": [tag.get(x, "O") for x in w]} for w, _ in _pos_data(n, seed)]
        _write_jsonl(data / f"{split}.jsonl", rows)
    args = ["probe", "tagging", "--model", str(model), "--data", str(data),
            "--cache", str(tmp_path / "c"), "--epochs", "3", "--threads", "1"]  # fmt: skip

    # the task needs a name before any work starts
    assert main(args) == 2
    assert "--task-name" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()

    assert main([*args, "--task-name", "animals", "--store"]) == 0
    assert "| scalar mix |" in capsys.readouterr().out
    spec = load_artifact(model).tasks["animals"]
    assert spec.meta["task"] == "animals"
    assert spec.meta["labels"] == ["ANIMAL", "COLOUR", "O"]  # from the training data, sorted


@pytest.mark.slow
def test_probe_learns_a_users_own_classification_task(tmp_path, capsys):
    from elmo_pretrain.cli import main

    model = tiny_artifact(tmp_path / "m")
    data = tmp_path / "topic"
    data.mkdir()
    rng = random.Random(0)
    topics = {"pets": ["dog", "cat"], "colours": ["red", "blue"], "moves": ["runs", "sees"]}
    for split, n in (("train", 90), ("dev", 30), ("test", 30)):
        rows = []
        for _ in range(n):
            label = rng.choice(sorted(topics))
            rows.append(
                {"text": " ".join(rng.choice(topics[label]) for _ in range(4)), "label": label}
            )
        _write_jsonl(data / f"{split}.jsonl", rows)
    rc = main([
        "probe", "classification", "--model", str(model), "--data", str(data), "--task-name", "topic",
        "--cache", str(tmp_path / "c"), "--epochs", "5", "--threads", "1", "--store",
    ])  # fmt: skip
    assert rc == 0
    spec = load_artifact(model).tasks["topic"]
    assert spec.meta["labels"] == ["colours", "moves", "pets"]
    assert 0.0 <= spec.meta["test_accuracy"] <= 1.0


@pytest.mark.parametrize(
    ("task", "files", "message"),
    [
        ("tagging", {"train": '{"words": ["a", "b"], "tags": ["X"]}\n'}, "train.jsonl:1: 2 words but 1 tags"),
        ("tagging", {"train": '{"words": ["a b"], "tags": ["X"]}\n'}, "without spaces"),
        ("tagging", {"train": "not json\n"}, "train.jsonl:1: not JSON"),
        ("classification", {"train": '{"text": "fine", "label": 1}\n\n{"text": "", "label": 0}\n'},
         "train.jsonl:3: 'text' must be a non-empty string"),
        ("classification", {"train": '{"text": "a", "label": true}\n'}, "'label' must be a string or an integer"),
        ("classification", {"dev": '{"text": "a", "label": "new"}\n'}, "dev.jsonl:1: classes ['new'] are not in the training data"),
        ("tagging", {"test": ""}, "test.jsonl: no examples"),
        ("tagging", {"dev": None}, "lacks dev.jsonl"),
    ],
)  # fmt: skip
def test_bad_task_data_is_a_clear_error_before_any_embedding(
    tmp_path, capsys, task, files, message
):
    from elmo_pretrain.cli import main

    model = tiny_artifact(tmp_path / "m")
    good = {
        "tagging": '{"words": ["a", "b"], "tags": ["X", "Y"]}\n',
        "classification": '{"text": "a b", "label": "p"}\n{"text": "c", "label": "q"}\n',
    }[task]
    for split in ("train", "dev", "test"):
        content = files.get(split, good)
        if content is not None:
            (tmp_path / f"{split}.jsonl").write_text(content)
    rc = main([
        "probe", task, "--model", str(model), "--data", str(tmp_path), "--task-name", "t",
        "--cache", str(tmp_path / "c"), "--threads", "1",
    ])  # fmt: skip
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


@pytest.mark.slow
def test_probe_registers_the_task_in_a_running_service(tmp_path, capsys):
    import httpx

    from elmo_api.main import create_app
    from elmo_api.settings import load_settings
    from elmo_pretrain.cli import main
    from tests.support.live_server import LiveServer
    from tests.support.ports import free_port

    model = tiny_artifact(tmp_path / "m")
    data = tmp_path / "tags"
    data.mkdir()
    for split, n, seed in (("train", 60, 0), ("dev", 20, 1), ("test", 20, 2)):
        _write_jsonl(
            data / f"{split}.jsonl", [{"words": w, "tags": t} for w, t in _pos_data(n, seed)]
        )

    def probe(*extra):
        return main([
            "probe", "tagging", "--model", str(model), "--data", str(data), "--task-name", "tags",
            "--cache", str(tmp_path / "c"), "--epochs", "2", "--threads", "1", *extra,
        ])  # fmt: skip

    # nothing listens there: refused before any embedding
    assert probe("--service", f"http://127.0.0.1:{free_port()}") == 2
    assert "is not reachable" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()

    settings = load_settings(model_path=model, threads=1, data_dir=tmp_path, admin_keys="admin")
    with LiveServer(create_app(settings)) as srv:
        assert probe("--service", srv.url, "--admin-key", "admin") == 0
        assert f"task stored: {srv.url}/v1/tasks/tags" in capsys.readouterr().out
        got = httpx.get(f"{srv.url}/v1/tasks/tags").json()
        assert got["meta"]["task"] == "tags" and len(got["weights"]) == 3
        r = httpx.post(f"{srv.url}/v1/embed", json={"sentences": [["the", "dog"]], "task": "tags"})
        assert r.status_code == 200

        # a refused PUT keeps what was learned, and says where
        assert probe("--service", srv.url, "--admin-key", "wrong") == 2
        err = capsys.readouterr().err
        assert "answered 401" in err and "runs/probe/tags/task.json" in err
        saved = json.loads((tmp_path / "runs" / "probe" / "tags" / "task.json").read_text())
        assert saved["meta"]["task"] == "tags" and len(saved["weights"]) == 3


@pytest.mark.slow
def test_probe_refuses_a_service_that_serves_another_model(tmp_path, capsys):
    """The mix is learned on --model: a service serving another version is refused
    before any embedding, naming both versions."""
    from elmo_api.main import create_app
    from elmo_api.settings import load_settings
    from elmo_pretrain.cli import main
    from tests.support.live_server import LiveServer

    model = tiny_artifact(tmp_path / "m")
    other = tiny_artifact(tmp_path / "other", seed=1)  # same shape, other weights
    data = tmp_path / "tags"
    data.mkdir()
    for split, n, seed in (("train", 20, 0), ("dev", 10, 1), ("test", 10, 2)):
        _write_jsonl(
            data / f"{split}.jsonl", [{"words": w, "tags": t} for w, t in _pos_data(n, seed)]
        )
    settings = load_settings(model_path=other, threads=1, data_dir=tmp_path, admin_keys="admin")
    with LiveServer(create_app(settings)) as srv:
        rc = main([
            "probe", "tagging", "--model", str(model), "--data", str(data), "--task-name", "tags",
            "--cache", str(tmp_path / "c"), "--threads", "1", "--service", srv.url,
            "--admin-key", "admin",
        ])  # fmt: skip
    assert rc == 2
    err = capsys.readouterr().err
    assert "serves model version" in err
    assert load_artifact(other).version in err and load_artifact(model).version in err
    assert not (tmp_path / "c").exists() and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_probe_writes_to_a_run_folder_and_leaves_the_model_alone(tmp_path, capsys):
    """Without --store the model folder is untouched; --store over a task the model
    ships needs --overwrite."""
    from elmo_pretrain.cli import main

    model = tiny_artifact(tmp_path / "m")
    save_task(MixSpec.average(3), "pos", model_dir=model)
    shipped = (model / "tasks" / "pos.json").read_bytes()
    before = sorted((p.name, p.stat().st_mtime_ns) for p in model.rglob("*"))
    data = tmp_path / "brown"
    data.mkdir()
    for split, n, seed in (("train", 40, 0), ("dev", 10, 1), ("test", 10, 2)):
        _write_jsonl(
            data / f"brown.{split}.jsonl", [{"words": w, "tags": t} for w, t in _pos_data(n, seed)]
        )
    args = ["probe", "pos", "--model", str(model), "--data", str(data),
            "--cache", str(tmp_path / "c"), "--epochs", "1", "--threads", "1"]  # fmt: skip
    assert main(args) == 0
    out = tmp_path / "runs" / "probe" / "pos"
    assert (out / "report.md").is_file() and (out / "report.json").is_file()
    assert json.loads((out / "task.json").read_text())["meta"]["task"] == "pos"
    assert sorted((p.name, p.stat().st_mtime_ns) for p in model.rglob("*")) == before

    # the model ships "pos": --store refuses before any work, --overwrite replaces it
    assert main([*args, "--store", "--cache", str(tmp_path / "c2")]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert not (tmp_path / "c2").exists()
    assert (model / "tasks" / "pos.json").read_bytes() == shipped
    assert main([*args, "--store", "--overwrite"]) == 0
    assert (model / "tasks" / "pos.json").read_bytes() != shipped
