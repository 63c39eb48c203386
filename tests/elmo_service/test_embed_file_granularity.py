"""``embed-file`` with a sub-word model: pre-tokenized (``--whitespace``) input gives one
vector per given word by default, as AllenNLP's ``elmo`` command does; the sub-word
pieces stay one flag away, and raw text keeps its per-token default."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from elmo_cli.main import main
from elmo_service.embedder import Embedder, words_of
from tests.support.core_fixtures import tiny_artifact, train_sentencepiece

LINES = ["the naïve people walk slowly", "boats sail past green fields ."]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("sp")
    return tiny_artifact(d / "model", tokenizer=train_sentencepiece(d))


def _embed(tmp_path, model, *flags):
    inp, out = tmp_path / "in.txt", tmp_path / "out.hdf5"
    inp.write_text("\n".join(LINES) + "\n")
    argv = ["embed-file", str(inp), str(out), "--model", str(model), "--quiet", "--threads", "1"]
    assert main([*argv, *flags]) == 0
    with h5py.File(out, "r") as f:
        return [f[str(i)][()] for i in range(len(LINES))], f.attrs["granularity"]


def test_whitespace_input_gives_one_vector_per_word_by_default(tmp_path, sp_model):
    emb = Embedder.load(sp_model, threads=1)
    pieces = emb.tokenize([line.split() for line in LINES])
    assert any(len(p) > len(line.split()) for p, line in zip(pieces, LINES, strict=True)), (
        "the test needs words split into several pieces"
    )
    default, kind = _embed(tmp_path, sp_model, "--whitespace")
    assert kind == "word"
    assert [d.shape[1] for d in default] == [len(line.split()) for line in LINES]
    explicit, _ = _embed(tmp_path, sp_model, "--whitespace", "--granularity", "word")
    for a, b in zip(default, explicit, strict=True):
        np.testing.assert_array_equal(a, b)
    # each word's vector is the mean of its pieces' vectors
    for toks, got in zip(pieces, default, strict=True):
        (ref,) = emb.embed_tokens([[t.piece for t in toks]])
        np.testing.assert_allclose(got, words_of(toks, ref)[1], atol=1e-5, rtol=0)


def test_pieces_stay_available_and_raw_text_keeps_the_token_default(tmp_path, sp_model, capsys):
    emb = Embedder.load(sp_model, threads=1)
    pieces, kind = _embed(tmp_path, sp_model, "--whitespace", "--granularity", "token")
    assert kind == "token"
    assert [p.shape[1] for p in pieces] == [
        len(t) for t in emb.tokenize([line.split() for line in LINES])
    ]
    raw, kind = _embed(tmp_path, sp_model)
    assert kind == "token" and [r.shape[1] for r in raw] == [len(t) for t in emb.tokenize(LINES)]
    assert "--granularity word gives one per word" in capsys.readouterr().err
