"""The frameworks users arrive through, with their defaults, against a real server process.

LangChain's ``OpenAIEmbeddings``, LlamaIndex's OpenAI-like embedding, Haystack's OpenAI
embedders, the ``openai`` SDK (float and base64) and ``huggingface_hub``'s
``InferenceClient`` (TEI's API), each as its users construct it -- base URL, key and model
name, nothing else -- against one ``elmo-service serve`` process on the bundled model. Their
vectors are compared with the library's (the mean of the default mix over the tokens, unit
length). Offline: the frameworks that count tokens with tiktoken get the real cl100k_base
ranks from the same package the server decodes with (``seed_tiktoken_cache``), through
tiktoken's own ``TIKTOKEN_CACHE_DIR``.

docs/frameworks.md's snippets are these calls (``test_the_docs_snippets_run``).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from elmo_api.token_ids import seed_tiktoken_cache
from elmo_service import Embedder
from tests.support.replicas import REPO, Replica

pytestmark = pytest.mark.slow

KEY = "test-key-123"
TEXTS = ["The bank raised its rates.", "We sat on the river bank.", "Ein Café in Köln."]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fw")
    rep = Replica(
        {
            "ELMO_MODEL_PATH": str(REPO / "models" / "default"),
            "ELMO_DATA_DIR": str(tmp / "data"),
            "ELMO_CACHE": "false",
            "ELMO_API_KEYS": KEY,
        },
        tmp,
        "fw",
    ).start()
    try:
        rep.wait_ready(120)
        yield rep
    finally:
        rep.stop()


@pytest.fixture(scope="module", autouse=True)
def offline_tiktoken(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    d = tmp_path_factory.mktemp("tiktoken")
    seed_tiktoken_cache(str(d))
    mp.setenv("TIKTOKEN_CACHE_DIR", str(d))
    yield
    mp.undo()


@pytest.fixture(scope="module")
def expected():
    """The library's answer: mean over tokens of the default mix, unit length."""
    emb = Embedder.load(REPO / "models" / "default", threads=1)
    out = []
    for s in emb.embed(TEXTS):
        mix = s.layers.mean(axis=0)  # the default mix: equal weights, gamma 1
        v = mix.mean(axis=0)
        out.append(v / np.linalg.norm(v))
    return np.array(out)


def _close(got, want, atol=1e-4):
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=atol)
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), 1.0, atol=1e-5)


def test_langchain_openai_embeddings_with_its_defaults(server, expected):
    from langchain_openai import OpenAIEmbeddings

    emb = OpenAIEmbeddings(base_url=server.url + "/v1", api_key=KEY, model="default")
    assert emb.check_embedding_ctx_length  # its default: it sends tiktoken ids
    _close(emb.embed_documents(TEXTS), expected)
    _close([emb.embed_query(TEXTS[1])], expected[1:2])
    many = [f"document number {i} about the river bank" for i in range(3000)]
    got = emb.embed_documents(many)
    assert len(got) == 3000 and all(len(v) == expected.shape[1] for v in got)


def test_the_openai_sdk_float_and_base64(server, expected):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    for fmt in ("float", "base64"):
        r = client.embeddings.create(model="default", input=TEXTS, encoding_format=fmt)
        got = [d.embedding for d in r.data]
        if fmt == "base64":
            import base64

            got = [np.frombuffer(base64.b64decode(g), "<f4") for g in got]
        _close(got, expected)
    r = client.embeddings.create(model="default", input=["x"] * 2048)
    assert len(r.data) == 2048
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="default", input=TEXTS, dimensions=12)
    assert e.value.body["param"] == "dimensions"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong").embeddings.create(
            model="default", input="x"
        )


def test_llamaindex_openai_like_embedding(server, expected):
    from llama_index.embeddings.openai_like import OpenAILikeEmbedding

    emb = OpenAILikeEmbedding(model_name="default", api_base=server.url + "/v1", api_key=KEY)
    _close(emb.get_text_embedding_batch(TEXTS), expected)
    _close([emb.get_query_embedding(TEXTS[0])], expected[:1])


def test_haystack_openai_embedders(server, expected):
    from haystack import Document
    from haystack.components.embedders import OpenAIDocumentEmbedder, OpenAITextEmbedder
    from haystack.utils import Secret

    key = Secret.from_token(KEY)
    text = OpenAITextEmbedder(api_key=key, api_base_url=server.url + "/v1", model="default")
    _close([text.run(TEXTS[2])["embedding"]], expected[2:3])
    docs = OpenAIDocumentEmbedder(api_key=key, api_base_url=server.url + "/v1", model="default")
    out = docs.run([Document(content=t) for t in TEXTS])["documents"]
    _close([d.embedding for d in out], expected)


def test_huggingface_hub_inference_client_speaks_tei(server, expected):
    from huggingface_hub import InferenceClient

    client = InferenceClient(server.url, token=KEY)
    got = client.feature_extraction(TEXTS[0])
    _close(np.asarray(got).reshape(1, -1), expected[:1])


def test_the_docs_snippets_run(server, expected):
    """Every python block of docs/frameworks.md, with its URL and key pointed here."""
    page = (REPO / "docs" / "frameworks.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    assert len(blocks) >= 5, "docs/frameworks.md lost its snippets"
    for code in blocks:
        code = code.replace("http://127.0.0.1:8000", server.url).replace("YOUR_KEY", KEY)
        scope: dict = {}
        exec(compile(code, str(Path("docs/frameworks.md")), "exec"), scope)  # noqa: S102
        vec = np.asarray(scope["vector"], dtype=np.float64).reshape(-1)
        assert vec.shape == (expected.shape[1],)
        np.testing.assert_allclose(np.linalg.norm(vec), 1.0, atol=1e-5)
