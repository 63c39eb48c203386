"""/v1/embed through HTTP: the same sentence gives the same vectors alone, batched,
cached, uncached and through the Python embedder; every output option."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from elmo_api.encoding import decode_array
from elmo_api.main import create_app
from elmo_api.settings import load_settings
from elmo_service.embedder import Embedder, apply_mix, words_of
from elmo_service.scalar_mix import MixSpec
from tests.support.determinism import same_vectors

SENTENCES = [
    "The bank raised its rates.",
    "We sat on the river bank and watched the boats.",
    "Hello!",
    "A much longer sentence, with commas, clauses and a few more words than the others have.",
    "The bank raised its rates.",  # a duplicate inside one request
]


def _app(model_dir, tmp_path, **overrides):
    s = load_settings(model_path=model_dir, threads=1, data_dir=tmp_path, **overrides)
    return create_app(s)


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    return Embedder.load(tiny_model_dir, threads=1)


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    with TestClient(_app(tiny_model_dir, tmp_path_factory.mktemp("data"))) as c:
        yield c


def _layers(resp_json):
    return [decode_array(d["layers"]) for d in resp_json["data"]]


def _post(client, **body):
    r = client.post("/v1/embed", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_same_vectors_alone_batched_cached_uncached_and_python(
    client, ref, tiny_model_dir, tmp_path
):
    expected = [e.layers for e in ref.embed(SENTENCES)]
    batched = _post(client, sentences=SENTENCES)
    assert batched["usage"]["sentences"] == len(SENTENCES)
    alone = [_layers(_post(client, sentences=[s]))[0] for s in SENTENCES]
    cached = _post(client, sentences=SENTENCES)
    assert cached["usage"]["cache_hits"] == 4 and cached["usage"]["cache_misses"] == 0  # 4 distinct
    with TestClient(_app(tiny_model_dir, tmp_path, cache=False)) as c2:
        uncached = _post(c2, sentences=SENTENCES)
        assert uncached["usage"]["cache_hits"] == 0
    for got in (_layers(batched), alone, _layers(cached), _layers(uncached)):
        for g, e in zip(got, expected, strict=True):
            assert same_vectors(g, e)  # the documented bound (tests/support/determinism.py)
    # batched with other sentences of other lengths gives the same vectors as alone
    for a, b in zip(alone, _layers(batched), strict=True):
        assert same_vectors(b, a)


def test_response_shape_tokens_offsets_and_usage(client, ref):
    body = _post(client, sentences=["Don't stop, bank!"])
    assert body["object"] == "embed_result"
    assert body["model"] == {"id": "tiny", "version": ref.version}
    (sent,) = body["data"]
    toks = sent["tokens"]
    text = "Don't stop, bank!"
    assert [t["text"] for t in toks] == [t.text for t in ref.tokenize([text])[0]]
    for t in toks:
        assert text[t["start"] : t["end"]] == t["text"]
    assert sent["layers"]["shape"] == [ref.n_layers, len(toks), ref.dim]
    assert sent["layers"]["indices"] == list(range(ref.n_layers))
    assert body["usage"]["tokens"] == len(toks)


def test_pretokenized_equals_string(client):
    a = _layers(_post(client, sentences=["We sat on the bank ."]))[0]
    b = _post(client, sentences=[["We", "sat", "on", "the", "bank", "."]])
    assert np.abs(_layers(b)[0] - a).max() <= 1e-6
    toks = b["data"][0]["tokens"]
    assert (toks[1]["start"], toks[1]["end"]) == (3, 6)  # offsets into the words joined by spaces


@pytest.mark.parametrize("words, bad", [(["a", ""], 1), ([" ", "b"], 0), (["a", "\t\n"], 1)])
def test_a_pretokenized_word_that_yields_no_token_is_refused_naming_it(client, words, bad):
    """Dropping it would return fewer word vectors than words given, misaligned with the
    caller's labels; a 422 names the word instead."""
    r = client.post("/v1/embed", json={"sentences": [["ok"], words], "granularity": "word"})
    assert r.status_code == 422, r.text
    assert r.json()["field"] == f"sentences[1][{bad}]"


@pytest.mark.parametrize(
    "body_mix, spec",
    [
        ({}, MixSpec.average(3)),
        ({"mix": [0.2, -1.0, 2.0], "gamma": 0.5}, MixSpec([0.2, -1.0, 2.0], 0.5)),
        (
            {"mix": [0.1, 0.3, -0.2, 0.9, 0.0], "per_direction": True},
            MixSpec([0.1, 0.3, -0.2, 0.9, 0.0], 1.0, True),
        ),
        (
            {"mix": [1.0, 0.0, 0.5], "layer_norm": True, "gamma": 2.0},
            MixSpec([1.0, 0.0, 0.5], 2.0, False, True),
        ),
        ({"task": "shipped"}, MixSpec(weights=[0.5, 1.0, -0.5], gamma=0.7)),
    ],
)
def test_mix_matches_python_apply_mix(client, ref, body_mix, spec):
    body = _post(client, sentences=SENTENCES[:3], output="both", **body_mix)
    for d, e in zip(body["data"], ref.embed(SENTENCES[:3]), strict=True):
        want = apply_mix(e.layers, spec)
        got = decode_array(d["mix"])
        assert got.shape == want.shape
        assert np.abs(got - want).max() <= 1e-5
    assert body["task"] == body_mix.get("task")


def test_output_defaults_and_layer_subset(client, ref):
    only_layers = _post(client, sentences=["a b c"])
    assert "mix" not in only_layers["data"][0] and "layers" in only_layers["data"][0]
    only_mix = _post(client, sentences=["a b c"], task="shipped")
    assert "layers" not in only_mix["data"][0] and "mix" in only_mix["data"][0]
    sub = _post(client, sentences=["a b c"], output="layers", layers=[2, 0])
    full = _layers(only_layers)[0]
    got = decode_array(sub["data"][0]["layers"])
    assert sub["data"][0]["layers"]["indices"] == [2, 0]
    assert np.array_equal(got, full[[2, 0]])


def test_word_granularity_and_pooling(client, ref):
    text = "Don't stop-gap it."
    e = ref.embed([text])[0]
    words, want = words_of(e.tokens, e.layers, text)
    body = _post(client, sentences=[text], output="both", granularity="word")
    d = body["data"][0]
    assert [w["text"] for w in d["words"]] == words
    assert np.abs(decode_array(d["layers"]) - want).max() <= 1e-5
    mix_tok = apply_mix(e.layers, MixSpec.average(3))
    _, mix_words = words_of(e.tokens, mix_tok[None], text)
    assert np.abs(decode_array(d["mix"]) - mix_words[0]).max() <= 1e-5

    for how, fn in (("mean", np.mean), ("max", np.max)):
        body = _post(client, sentences=[text], output="both", pooling=how)
        d = body["data"][0]
        assert d["layers"]["shape"] == [3, ref.dim] and d["mix"]["shape"] == [ref.dim]
        assert np.abs(decode_array(d["layers"]) - fn(e.layers, axis=1)).max() <= 1e-5
        assert np.abs(decode_array(d["mix"]) - fn(mix_tok, axis=0)).max() <= 1e-5


def test_base64_and_float16(client, ref):
    e = ref.embed(["Binary please."])[0].layers
    b32 = _post(client, sentences=["Binary please."], encoding="base64")
    arr = b32["data"][0]["layers"]
    assert isinstance(arr["data"], str) and arr["dtype"] == "float32"
    assert np.abs(decode_array(arr) - e).max() <= 1e-5
    raw = np.frombuffer(__import__("base64").b64decode(arr["data"]), dtype="<f4").reshape(
        arr["shape"]
    )
    assert np.array_equal(raw, decode_array(arr))
    for enc in ("base64", "json"):
        b16 = _post(client, sentences=["Binary please."], encoding=enc, dtype="float16")
        arr = b16["data"][0]["layers"]
        assert arr["dtype"] == "float16"
        assert np.abs(decode_array(arr) - e.astype(np.float16).astype(np.float32)).max() == 0


def test_float16_cache_is_consistent(tiny_model_dir, tmp_path, ref):
    """With ELMO_CACHE_DTYPE=float16, cached and uncached answers are identical."""
    with TestClient(_app(tiny_model_dir, tmp_path, cache_dtype="float16")) as c:
        first = _layers(_post(c, sentences=SENTENCES[:2]))
        second = _post(c, sentences=SENTENCES[:2])
        assert second["usage"]["cache_hits"] == 2
        for a, b, e in zip(first, _layers(second), ref.embed(SENTENCES[:2]), strict=True):
            assert np.array_equal(a, b)
            assert np.abs(a - e.layers).max() <= 2e-3
