"""Empty input (#51 item 2), one answer on every surface: an empty sentence (``""``, ``"  "``
or ``[]`` tokens) inside a request gets an empty answer (layers ``[L+1, 0, D]``, no tokens,
no words; pooled: the zero vector), never a 422 for the whole call; an empty LIST is a 422
naming the field, and the OpenAPI schema says so (``minItems: 1``)."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from elmo_api.encoding import decode_array
from elmo_api.main import create_app
from elmo_api.settings import load_settings
from elmo_service.embedder import Embedder


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    s = load_settings(model_path=tiny_model_dir, threads=1, data_dir=tmp_path_factory.mktemp("d"))
    with TestClient(create_app(s), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    return Embedder.load(tiny_model_dir, threads=1)


def _ok(r):
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("empty", ["", "   ", []])
def test_an_empty_sentence_gets_empty_layers_and_the_others_are_unchanged(client, ref, empty):
    alone = _ok(client.post("/v1/embed", json={"sentences": ["The bank raised rates."]}))
    body = _ok(client.post("/v1/embed", json={"sentences": ["The bank raised rates.", empty]}))
    assert [d["index"] for d in body["data"]] == [0, 1]
    first, blank = body["data"]
    assert first["tokens"] == alone["data"][0]["tokens"]
    assert np.array_equal(decode_array(first["layers"]), decode_array(alone["data"][0]["layers"]))
    assert blank["tokens"] == []
    assert blank["layers"]["shape"] == [ref.n_layers, 0, ref.dim]
    assert decode_array(blank["layers"]).shape == (ref.n_layers, 0, ref.dim)
    assert body["usage"]["sentences"] == 2
    assert body["usage"]["tokens"] == len(first["tokens"])
    # the library gives the same (#51: a script can swap the two)
    lib = ref.embed(["The bank raised rates.", empty if isinstance(empty, str) else []])
    assert lib[1].layers.shape == (ref.n_layers, 0, ref.dim)


@pytest.mark.parametrize("encoding", ["json", "base64"])
def test_every_output_of_an_empty_sentence(client, ref, encoding):
    base = {"sentences": ["", ["ok", "fine"], []], "encoding": encoding}
    # both, at word granularity: no words, [K, 0, D] layers and a [0, D] mix
    b = _ok(client.post("/v1/embed", json={**base, "output": "both", "granularity": "word"}))
    for i in (0, 2):
        d = b["data"][i]
        assert d["words"] == []
        assert decode_array(d["layers"]).shape == (ref.n_layers, 0, ref.dim)
        assert decode_array(d["mix"]).shape == (0, ref.dim)
    assert len(b["data"][1]["words"]) == 2
    # a layer-normed inline mix over no positions: empty, no NaN
    b = _ok(client.post("/v1/embed", json={**base, "mix": [1, 0, 2], "layer_norm": True}))
    assert decode_array(b["data"][0]["mix"]).shape == (0, ref.dim)
    # pooled: the zero vector (finite), the others' pooled vectors as always
    for how in ("mean", "max"):
        b = _ok(client.post("/v1/embed", json={**base, "output": "both", "pooling": how}))
        for i in (0, 2):
            mix = decode_array(b["data"][i]["mix"])
            layers = decode_array(b["data"][i]["layers"])
            assert mix.shape == (ref.dim,) and layers.shape == (ref.n_layers, ref.dim)
            assert np.isfinite(mix).all() and not mix.any() and not layers.any()
        assert np.abs(decode_array(b["data"][1]["mix"])).max() > 0


def test_only_empty_sentences_never_reach_the_model(client, ref):
    b = _ok(client.post("/v1/embed", json={"sentences": ["", []], "pooling": "mean"}))
    assert [decode_array(d["layers"]).shape for d in b["data"]] == [(ref.n_layers, ref.dim)] * 2
    assert b["usage"] == {"sentences": 2, "tokens": 0, "cache_hits": 0, "cache_misses": 0}


def test_openai_route_an_empty_input_is_the_zero_vector(client, ref):
    ok = {"model": "test-model"}
    models = _ok(client.get("/v1/models"))
    ok["model"] = models["data"][0]["id"]
    b = _ok(client.post("/v1/embeddings", json={**ok, "input": ["a bank", ""]}))
    vecs = [np.asarray(d["embedding"]) for d in b["data"]]
    assert [v.shape for v in vecs] == [(ref.dim,)] * 2
    assert np.isfinite(vecs[1]).all() and not vecs[1].any() and vecs[0].any()
    b = _ok(client.post("/v1/embeddings", json={**ok, "input": "", "encoding_format": "base64"}))
    assert b["usage"]["prompt_tokens"] == 0
    r = client.post("/v1/embeddings", json={**ok, "input": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text


def test_an_empty_list_is_refused_naming_the_field_and_the_schema_says_so(client):
    r = client.post("/v1/embed", json={"sentences": []})
    assert r.status_code == 422 and r.json()["field"] == "sentences", r.text
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    assert schemas["EmbedRequest"]["properties"]["sentences"]["minItems"] == 1
    lists = [
        s for s in schemas["EmbeddingsRequest"]["properties"]["input"]["anyOf"]
        if s.get("type") == "array"
    ]  # fmt: skip
    assert lists and all(s["minItems"] == 1 for s in lists)
