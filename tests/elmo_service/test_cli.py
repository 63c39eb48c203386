import argparse
import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from elmo_cli.core import build_parser, main
from elmo_service.artifact import default_model_dir
from elmo_service.embedder import Embedder
from tests.support.core_fixtures import tiny_artifact

LINES = ["The bank of the river .", "Boats sail", "Rivers bend", "The bank of the river ."]


def test_embed_file_writes_allennlp_layout(tmp_path):
    model = tiny_artifact(tmp_path / "m")
    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(LINES) + "\n")
    out = tmp_path / "out.hdf5"
    assert (
        main(["embed-file", str(inp), str(out), "--model", str(model), "--quiet", "--threads", "1"])
        == 0
    )
    emb = Embedder.load(model, threads=1)
    with h5py.File(out) as f:
        assert sorted(k for k in f if k != "sentence_to_index") == ["0", "1", "2", "3"]
        index = json.loads(f["sentence_to_index"][0])
        assert index == {LINES[0]: "3", LINES[1]: "1", LINES[2]: "2"}
        for i, line in enumerate(LINES):
            want = emb.embed([line])[0].layers
            assert f[str(i)].shape == want.shape
            np.testing.assert_allclose(f[str(i)][()], want, atol=1e-5)


@pytest.mark.slow
def test_embed_file_top_and_average(tmp_path):
    model = tiny_artifact(tmp_path / "m")
    inp = tmp_path / "in.txt"
    inp.write_text("a b c\n")
    emb = Embedder.load(model, threads=1)
    layers = emb.embed(["a b c"])[0].layers
    for flag, want in (("--top", layers[-1]), ("--average", layers.mean(0))):
        out = tmp_path / f"{flag}.hdf5"
        assert main(["embed-file", str(inp), str(out), "--model", str(model), flag, "--quiet"]) == 0
        with h5py.File(out) as f:
            np.testing.assert_allclose(f["0"][()], want, atol=1e-5)


def test_unknown_task_is_a_clear_error(tmp_path, capsys):
    model = tiny_artifact(tmp_path / "m")
    inp = tmp_path / "in.txt"
    inp.write_text("a\n")
    rc = main(
        [
            "embed-file",
            str(inp),
            str(tmp_path / "o.h5"),
            "--model",
            str(model),
            "--task",
            "pos",
            "--quiet",
        ]
    )
    assert rc == 2
    assert "no task 'pos'" in capsys.readouterr().err
    assert not (tmp_path / "o.h5").exists()


def test_info_prints_version(tmp_path, capsys):
    model = tiny_artifact(tmp_path / "m")
    assert main(["info", str(model)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert len(info["version"]) == 16 and info["tokenizer"] == "word"


def test_embed_file_answers_a_blank_line_with_an_empty_dataset(tmp_path, capsys):
    """#51: one answer for an empty sentence on every surface: a blank line's dataset has no
    positions (AllenNLP's `elmo` refuses the whole file); the other lines are the library's."""
    import h5py

    from elmo_service import Embedder

    model = tiny_artifact(tmp_path / "m")
    inp = tmp_path / "in.txt"
    inp.write_text("a b\n\nc d\n   \ne f\n")
    out = tmp_path / "o.h5"
    assert main(["embed-file", str(inp), str(out), "--model", str(model), "--quiet"]) == 0
    capsys.readouterr()
    lib = Embedder.load(model, threads=1).embed(["a b", "", "c d", "   ", "e f"])
    with h5py.File(out) as f:
        for i, want in enumerate(lib):
            got = f[str(i)][()]
            assert got.shape == want.layers.shape, (i, got.shape)
        assert f["1"].shape[1] == 0 and f["3"].shape[1] == 0
    # as documents, a blank line is an empty document: refused, naming the lines
    assert (
        main(["embed-file", str(inp), str(out), "--model", str(model), "--quiet", "--documents"])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert "blank lines (2, 4)" in err and len(err.splitlines()) == 1


def test_embed_file_names_a_bad_input_or_output_path_in_one_line(tmp_path, capsys):
    """Checked before the model loads: a missing input, a folder as input, an output in a
    folder that does not exist. Exit 2, one line, nothing written."""
    model = tiny_artifact(tmp_path / "m")
    good = tmp_path / "in.txt"
    good.write_text("a b\n")
    for inp, out, words in [
        (tmp_path / "missing.txt", tmp_path / "o.h5", "not a file"),
        (tmp_path, tmp_path / "o.h5", "not a file"),
        (good, tmp_path / "nowhere" / "o.h5", "does not exist"),
    ]:
        capsys.readouterr()
        assert main(["embed-file", str(inp), str(out), "--model", str(model), "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and words in err and len(err.splitlines()) == 1, err
        assert not out.exists()


def test_embed_file_names_the_line_a_sentence_fails_on(tmp_path, capsys):
    """Errors about a sentence name its line in the file (not its index in a chunk): a given
    word the tokenizer leaves empty (a zero-width space) is refused; a whole line it empties
    is an empty sentence, stored as [L+1, 0, D] like a blank line (#51)."""
    model = default_model_dir()  # sentencepiece: normalisation removes U+200B
    inp = tmp_path / "in.txt"
    inp.write_text("ok here\nfine\n\u200b\n")
    assert (
        main(["embed-file", str(inp), str(tmp_path / "e.h5"), "--model", str(model), "--quiet"])
        == 0
    )
    capsys.readouterr()
    cases = [("a b\nc \u200b d\n", ["--whitespace"], "line 2 of")]
    for text, flags, words in cases:
        inp.write_text(text)
        out = tmp_path / "o.h5"
        argv = ["embed-file", str(inp), str(out), "--model", str(model), "--quiet", *flags]
        assert main([*argv, "--chunk-lines", "1"]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1, err
        assert not out.exists()
    assert ", word 2 " in err  # the --whitespace case names the word, counted from 1


def test_embed_file_defaults_to_the_model_serve_serves(tmp_path, monkeypatch, capsys):
    for var in ("ELMO_MODEL_PATH", "ELMO_MODELS_DIR", "ELMO_MODEL"):
        monkeypatch.delenv(var, raising=False)
    bundled = Path(__file__).resolve().parents[2] / "models" / "default"
    assert default_model_dir() == bundled and (bundled / "manifest.json").is_file()
    model = tiny_artifact(tmp_path / "models" / "mine")
    monkeypatch.setenv("ELMO_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("ELMO_MODEL", "mine")
    assert default_model_dir() == model
    inp = tmp_path / "in.txt"
    inp.write_text("a b c\n")
    out = tmp_path / "o.h5"
    assert main(["embed-file", str(inp), str(out), "--quiet", "--threads", "1"]) == 0
    assert f"model {model}" in capsys.readouterr().err
    with h5py.File(out) as f:
        want = Embedder.load(model, threads=1).embed(["a b c"])[0].layers
        np.testing.assert_allclose(f["0"][()], want, atol=1e-5)
    monkeypatch.setenv("ELMO_MODEL_PATH", str(tmp_path / "elsewhere"))
    assert default_model_dir() == tmp_path / "elsewhere"


def test_embed_file_arguments_all_have_help():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices["embed-file"]
    missing = [a.dest for a in parser._actions if a.dest != "help" and not a.help]
    assert not missing, missing


def test_documents_at_once_help_says_the_default_and_a_bad_count_fails_first(tmp_path, capsys):
    from elmo_service.document import DOCUMENTS_AT_ONCE

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    (opt,) = [a for a in sub.choices["embed-file"]._actions if a.dest == "documents_at_once"]
    assert f"default {DOCUMENTS_AT_ONCE};" in opt.help
    inp = tmp_path / "in.txt"
    inp.write_text("one document\n")
    # no model exists there: the count is refused before any model is looked for
    argv = ["embed-file", str(inp), str(tmp_path / "o.h5"), "--model", str(tmp_path / "none")]
    assert main([*argv, "--documents", "--documents-at-once", "0"]) != 0
    err = capsys.readouterr().err
    assert "documents_at_once must be an integer >= 1" in err and "none" not in err
