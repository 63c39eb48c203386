"""Embedder behaviour as users see it: inputs, limits, determinism, options."""

import numpy as np
import pytest

from elmo_service.embedder import Embedder, apply_mix
from elmo_service.errors import InputError, LimitError
from elmo_service.scalar_mix import MixSpec
from tests.support.core_fixtures import tiny_artifact, train_sentencepiece

SENTS = [
    "The bank of the river.",
    "Money flows near the old stone bridge every morning and evening.",
    "",
    "Boats!",
    ["pre", "tokenized", "café"],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("m")
    return tiny_artifact(d / "model", train_sentencepiece(d))


def test_shapes_tokens_and_offsets(model_dir):
    emb = Embedder.load(model_dir, threads=1)
    out = emb.embed(SENTS)
    assert len(out) == len(SENTS)
    for s, r in zip(SENTS, out, strict=True):
        assert r.layers.shape == (emb.n_layers, len(r.tokens), emb.dim)
        assert r.layers.dtype == np.float32
        text = s if isinstance(s, str) else " ".join(s)
        for t in r.tokens:
            assert text[t.start : t.end] == t.text.replace("\u2581", "")
    assert out[2].layers.shape == (emb.n_layers, 0, emb.dim)


def test_empty_list_gives_empty_result(model_dir):
    assert Embedder.load(model_dir, threads=1).embed([]) == []


def test_same_vectors_alone_in_any_batch_and_with_or_without_cache(model_dir):
    emb = Embedder.load(model_dir, threads=1, batch_tokens=64)
    nocache = Embedder.load(model_dir, threads=1, token_cache_size=0, batch_tokens=10_000)
    batch = emb.embed(SENTS)
    again = emb.embed(list(reversed(SENTS)))[::-1]  # now served from the token cache
    assert emb.cache_hits > 0
    for i, s in enumerate(SENTS):
        alone = nocache.embed([s])[0].layers
        for other in (batch[i].layers, again[i].layers):
            assert np.abs(alone - other).max(initial=0) <= 1e-5


def test_batches_respect_token_budget(model_dir):
    emb = Embedder.load(model_dir, threads=1, batch_tokens=40, max_batch_sentences=3)
    lengths = [3, 30, 5, 5, 5, 5, 1, 12]
    batches = list(emb.plan_batches(lengths))
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        width = max(lengths[i] for i in b) + 2
        assert len(b) == 1 or len(b) * width <= 40
        assert len(b) <= 3
        assert [lengths[i] for i in b] == sorted((lengths[i] for i in b), reverse=True)


def test_sentence_over_limit_names_limit_and_field(model_dir):
    emb = Embedder.load(model_dir, threads=1, max_sentence_tokens=5)
    with pytest.raises(LimitError, match="limit is 5") as e:
        emb.embed(["ok", "this sentence is certainly much longer than five tokens"])
    assert e.value.field == "sentences[1]"


def test_bad_input_types(model_dir):
    emb = Embedder.load(model_dir, threads=1)
    with pytest.raises(InputError) as e:
        emb.embed(["fine", 3])
    assert e.value.field == "sentences[1]"
    with pytest.raises(InputError):
        emb.embed([["a", None]])
    # a caller's own name for the list (an HTTP route's field) is in the field and the message
    with pytest.raises(InputError) as e:
        emb.tokenize(["fine", ["ok", " "]], field="input")
    assert e.value.field == "input[1][1]" and e.value.message.startswith("input[1][1] is empty")
    with pytest.raises(InputError) as e:
        emb.tokenize(["fine", ["ok", " "]])
    assert e.value.message.startswith("sentence 1, word 1 is empty")


def test_long_tokens_are_cut_not_refused(tmp_path):
    emb = Embedder.load(tiny_artifact(tmp_path / "w"), threads=1)  # word tokens: one token each
    a = emb.embed([["x" * 48]])[0].layers
    b = emb.embed([["x" * 300]])[0].layers  # bilm-tf cuts at 48 bytes
    # equal up to fp32 rounding: the CNN ran in batches of different sizes
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_bf16_is_close_to_fp32(model_dir):
    fp32 = Embedder.load(model_dir, threads=1).embed(SENTS[:2])
    bf16 = Embedder.load(model_dir, threads=1, precision="bf16").embed(SENTS[:2])
    for a, b in zip(fp32, bf16, strict=True):
        assert np.abs(a.layers - b.layers).max() < 0.1 * max(1.0, np.abs(a.layers).max())


def test_average_mix_equals_layer_mean(model_dir):
    emb = Embedder.load(model_dir, threads=1)
    layers = emb.embed(SENTS[:1])[0].layers
    np.testing.assert_allclose(
        apply_mix(layers, MixSpec.average(emb.n_layers)), layers.mean(0), atol=1e-6
    )


def test_word_granularity_and_mix_options(model_dir):
    emb = Embedder.load(model_dir, threads=1)
    text = "The riverbank, naïve café!"
    tok = emb.embed([text])[0]
    word = emb.embed([text], granularity="word", mix=MixSpec([0.0, 1.0, 0.0]))[0]
    # punctuation is its own word, as AllenNLP users expect
    assert [w.text for w in word.tokens] == ["The", "riverbank", ",", "naïve", "café", "!"]
    for w in word.tokens:
        assert text[w.start : w.end] == w.text
    # a word's vector is the mean of its pieces'
    pieces = [i for i, t in enumerate(tok.tokens) if t.word == 1]
    np.testing.assert_allclose(word.layers[:, 1], tok.layers[:, pieces].mean(1), atol=1e-6)
    assert word.mix.shape == (len(word.tokens), emb.dim)
    np.testing.assert_allclose(
        word.mix, apply_mix(word.layers, MixSpec([0.0, 1.0, 0.0])), atol=1e-6
    )


def test_mix_option_errors_name_the_field(model_dir):
    emb = Embedder.load(model_dir, threads=1)
    with pytest.raises(InputError, match="no task 'pos'") as e:
        emb.embed(["a"], mix="pos")
    assert e.value.field == "mix"
    with pytest.raises(Exception, match="needs 3 weights"):
        emb.embed(["a"], mix=MixSpec([1.0]))
    with pytest.raises(InputError) as e:
        emb.embed(["a"], granularity="char")
    assert e.value.field == "granularity"


def test_precision_is_part_of_the_cache_key(model_dir):
    # a bf16 replica must never serve an fp32 replica's vectors from a shared cache
    fp32 = Embedder.load(model_dir, threads=1)
    bf16 = Embedder.load(model_dir, threads=1, precision="bf16")
    auto = Embedder.load(model_dir, threads=1, precision="auto")
    assert fp32.cache_key_prefix != bf16.cache_key_prefix
    assert auto.precision in ("fp32", "bf16")
    assert auto.cache_key_prefix == (fp32 if auto.precision == "fp32" else bf16).cache_key_prefix
