"""OpenAI's ``/v1/embeddings`` as the SDK and frameworks call it, and TEI's routes (#55).

The frameworks themselves, against a real server process: tests/e2e/test_frameworks.py.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from fastapi.testclient import TestClient

from elmo_api import token_ids
from elmo_api.main import create_app
from elmo_api.settings import load_settings
from elmo_service import Embedder
from elmo_service.scalar_mix import MixSpec, apply_mix

TEXTS = ["The bank raised its rates .", "We sat on the river bank .", "Ein Café in Köln ."]


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    s = load_settings(
        model_path=tiny_model_dir,
        threads=1,
        cache=False,
        data_dir=tmp_path_factory.mktemp("data"),
        max_sentences=2,  # parts of two inputs: a 2,048-input request is many parts
        max_tokens_per_sentence=12,
    )
    with TestClient(create_app(s), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    return Embedder.load(tiny_model_dir, threads=1)


def _pooled(ref, texts):
    out = [apply_mix(e.layers, MixSpec.average(3)).mean(axis=0) for e in ref.embed(texts)]
    return np.array([v / np.linalg.norm(v) for v in out])


def _vectors(r):
    assert r.status_code == 200, r.text
    return np.array([d["embedding"] for d in r.json()["data"]])


def test_token_ids_give_the_vectors_of_their_text(client, ref):
    enc = token_ids.encoding("cl100k_base")  # the real ranks, shipped (no download)
    assert enc.encode("hello world") == [15339, 1917]  # cl100k_base's own ids
    ids = [enc.encode(t) for t in TEXTS]
    by_ids = _vectors(client.post("/v1/embeddings", json={"input": ids, "model": "tiny"}))
    by_text = _vectors(client.post("/v1/embeddings", json={"input": TEXTS, "model": "tiny"}))
    np.testing.assert_allclose(by_ids, by_text, atol=1e-6)
    np.testing.assert_allclose(by_text, _pooled(ref, TEXTS), atol=1e-5)
    one = _vectors(client.post("/v1/embeddings", json={"input": ids[0], "model": "tiny"}))
    np.testing.assert_allclose(one, by_text[:1], atol=1e-6)


def test_an_unknown_id_and_a_missing_decoder_are_named(client, monkeypatch):
    r = client.post("/v1/embeddings", json={"input": [[15339], [100300]], "model": "tiny"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[1]", r.text
    token_ids.encoding.cache_clear()
    monkeypatch.setattr(token_ids, "_offline", lambda name: None)
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # not installed
    try:
        r = client.post("/v1/embeddings", json={"input": [[15339]], "model": "tiny"})
        err = r.json()["error"]
        assert r.status_code == 400 and "elmo-service[openai]" in err["message"], r.text
    finally:
        token_ids.encoding.cache_clear()


def test_2048_inputs_in_parts_in_order(client, ref):
    texts = [f"bank {i % 7} ." for i in range(2048)]
    got = _vectors(client.post("/v1/embeddings", json={"input": texts, "model": "tiny"}))
    assert got.shape[0] == 2048
    want = _pooled(ref, texts[:7])
    np.testing.assert_allclose(got[:7], want, atol=1e-5)
    np.testing.assert_allclose(got[2044], want[2044 % 7], atol=1e-5)
    # an error names its input in the whole request, not in its part
    bad = [*texts[:5], "x " * 20]
    r = client.post("/v1/embeddings", json={"input": bad, "model": "tiny"})
    assert r.status_code == 413 and r.json()["error"]["param"] == "input[5]", r.text


def test_a_request_is_tokenized_once_and_names_its_input(client, monkeypatch):
    from elmo_api.served import ServedModel

    calls: list[int] = []
    real = ServedModel.tokenize

    def spy(self, sentences, field="sentences"):
        calls.append(len(sentences))
        return real(self, sentences, field)

    monkeypatch.setattr(ServedModel, "tokenize", spy)
    ok = client.post("/v1/embeddings", json={"input": ["bank 1 .", "bank 2 ."], "model": "tiny"})
    assert ok.status_code == 200 and calls == [2], (ok.text, calls)  # one part (of 2): once
    calls.clear()
    r = client.post("/v1/embeddings", json={"input": ["bank .", "x " * 20], "model": "tiny"})
    assert r.status_code == 413 and r.json()["error"]["param"] == "input[1]", r.text
    calls.clear()
    three = client.post("/v1/embeddings", json={"input": ["a .", "b .", "c ."], "model": "tiny"})
    assert three.status_code == 200 and calls == [3], calls  # the whole, once: parts reuse it


def test_normalisation_is_a_setting(tiny_model_dir, tmp_path, ref):
    s = load_settings(
        model_path=tiny_model_dir, threads=1, cache=False, data_dir=tmp_path, openai_normalize=False
    )
    with TestClient(create_app(s)) as c:
        got = _vectors(c.post("/v1/embeddings", json={"input": TEXTS[:1], "model": "tiny"}))
    raw = apply_mix(ref.embed(TEXTS[:1])[0].layers, MixSpec.average(3)).mean(axis=0)
    np.testing.assert_allclose(got[0], raw, atol=1e-5)
    assert abs(np.linalg.norm(raw) - 1) > 1e-3  # so the default's unit length means something


def test_tei_embed_normalize_truncate_and_embed_all(client, ref):
    r = client.post("/embed", json={"inputs": TEXTS[:2]})
    assert r.status_code == 200
    np.testing.assert_allclose(np.array(r.json()), _pooled(ref, TEXTS[:2]), atol=1e-5)
    assert float(r.headers["x-total-time"]) > 0  # TEI's timing headers
    raw = np.array(client.post("/embed", json={"inputs": "a b", "normalize": False}).json()[0])
    want = apply_mix(ref.embed(["a b"])[0].layers, MixSpec.average(3)).mean(axis=0)
    np.testing.assert_allclose(raw, want, atol=1e-5)
    per_token = client.post("/embed_all", json={"inputs": [TEXTS[0]]}).json()
    want = apply_mix(ref.embed(TEXTS[:1])[0].layers, MixSpec.average(3))
    np.testing.assert_allclose(np.array(per_token[0]), want, atol=1e-5)
    long = " ".join(["bank"] * 30)
    r = client.post("/embed", json={"inputs": long})
    assert r.status_code == 413 and r.json()["error_type"] == "Validation", r.text
    cut = client.post("/embed", json={"inputs": long, "truncate": True})
    assert cut.status_code == 200
    np.testing.assert_allclose(
        np.array(cut.json()[0]), _pooled(ref, [" ".join(["bank"] * 12)])[0], atol=1e-5
    )


def test_tei_tokenize_info_and_errors(client):
    toks = client.post("/tokenize", json={"inputs": "Ein Café."}).json()[0]
    text = "Ein Café."
    assert [t["text"] for t in toks] == [text[t["start"] : t["stop"]] for t in toks]
    assert all(t["special"] is False for t in toks)
    info = client.get("/info").json()
    assert info["model_id"] == "tiny" and info["max_input_length"] == 12
    r = client.post("/embed", json={"inputs": []})
    assert r.status_code == 422 and set(r.json()) == {"error", "error_type"}
