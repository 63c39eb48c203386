"""AllenNLP's ``ElmoEmbedder`` names on ``Embedder``: ``embed_sentence``, a lazy
``embed_sentences``, ``embed_batch``, ``embed_file``; and ``Embedder.load`` leaves torch's
thread count alone unless ``threads=`` is given."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from elmo_cli.main import main
from elmo_service.embedder import EmbeddedSentence, Embedder
from elmo_service.errors import InputError, LimitError
from elmo_service.scalar_mix import MixSpec
from tests.support.core_fixtures import tiny_artifact, train_sentencepiece

LINES = [
    "The bank of the river.",
    "Money flows near the old stone bridge every morning.",
    "Boats!",
    "a naïve café",
    "people walk and watch boats sail slowly past green fields",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("m")
    return tiny_artifact(d / "model", train_sentencepiece(d))


@pytest.fixture(scope="module")
def emb(model_dir):
    return Embedder.load(model_dir, threads=1)


def test_embed_sentence_takes_text_or_tokens(emb):
    want = emb.embed(LINES[:1])[0]
    got = emb.embed_sentence(LINES[0])
    assert isinstance(got, EmbeddedSentence)
    assert got.layers.shape == (emb.n_layers, len(got.tokens), emb.dim)
    np.testing.assert_allclose(got.layers, want.layers, atol=1e-6, rtol=0)
    words = emb.embed_sentence(LINES[0].split(), granularity="word", mix="default")
    assert words.layers.shape[1] == len(LINES[0].split()) == words.mix.shape[0]


def test_embed_batch_answers_in_order(emb):
    got = emb.embed_batch(LINES, mix=MixSpec([-100.0, 100.0, -100.0]))  # layer 1 alone
    for line, g in zip(LINES, got, strict=True):
        alone = emb.embed_sentence(line)
        np.testing.assert_allclose(g.layers, alone.layers, atol=1e-5, rtol=0)
        np.testing.assert_allclose(g.mix, alone.layers[1], atol=1e-5, rtol=0)


def test_embed_sentences_is_lazy_and_names_errors_by_their_place(emb):
    read = []

    def source():
        for i in range(10_000):  # far more than anyone holds
            read.append(i)
            yield LINES[i % len(LINES)]

    it = emb.embed_sentences(source(), batch_size=2)
    first = [next(it) for _ in range(3)]
    assert len(read) <= 4  # two batches of two read, nothing more
    for line, got in zip(LINES[:3], first, strict=True):
        np.testing.assert_allclose(got.layers, emb.embed_sentence(line).layers, atol=1e-5)

    bad = [*LINES[:5], "x " * 10_000]  # sentence 5: over the token limit, in the third batch
    with pytest.raises(LimitError) as e:
        list(emb.embed_sentences(bad, batch_size=2))
    assert e.value.message.startswith("sentence 5 has") and e.value.index == 5
    with pytest.raises(InputError, match="batch_size"):
        next(emb.embed_sentences(LINES, batch_size=0))


def test_embed_file_writes_the_cli_layout(emb, model_dir, tmp_path):
    inp = tmp_path / "in.txt"
    inp.write_text("\n".join(LINES) + "\n")
    assert emb.embed_file(inp, tmp_path / "lib.hdf5", what="average", granularity="word") == 5
    argv = ["embed-file", str(inp), str(tmp_path / "cli.hdf5"), "--model", str(model_dir)]
    assert main([*argv, "--quiet", "--threads", "1", "--average", "--granularity", "word"]) == 0
    with h5py.File(tmp_path / "lib.hdf5") as a, h5py.File(tmp_path / "cli.hdf5") as b:
        assert sorted(a) == sorted(b) and dict(a.attrs) == dict(b.attrs)
        assert a["sentence_to_index"][0] == b["sentence_to_index"][0]
        for i in range(len(LINES)):
            np.testing.assert_allclose(a[str(i)][()], b[str(i)][()], atol=1e-5, rtol=0)
    with pytest.raises(InputError) as e:  # a bad line is named by the file's line, 1-based
        (tmp_path / "bad.txt").write_text("fine\n" + "x " * 10_000 + "\n")
        emb.embed_file(tmp_path / "bad.txt", tmp_path / "bad.hdf5")
    assert e.value.message.startswith(f"line 2 of {tmp_path / 'bad.txt'} has")
    assert not (tmp_path / "bad.hdf5").exists()


def test_load_leaves_the_thread_count_alone_unless_given(model_dir, torch_threads):
    torch_threads(3)
    Embedder.load(model_dir)
    assert torch.get_num_threads() == 3
    Embedder.load(model_dir, threads=2)
    assert torch.get_num_threads() == 2
