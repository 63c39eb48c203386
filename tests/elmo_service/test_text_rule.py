"""One text rule on every surface (#56 finding 3); the client's inline mixes are held by
tests/elmo_service/test_client.py (#57 item 7).

A lone surrogate has no UTF-8 form: the tokenizer would fail deep inside (sentencepiece's
RuntimeError), orjson with a bare TypeError. ``elmo_service.values.check_text`` is the rule,
written once; the library (sentences and documents), the API's schemas and the client apply
it and name the field. The routes are held by tests/api/test_document_streams.py and
tests/api/test_errors.py.
"""

from __future__ import annotations

import pytest

from elmo_client import Client
from elmo_client.wire import embed_body
from elmo_service import Embedder
from elmo_service.errors import InputError
from elmo_service.values import check_document, check_text, invalid_text

BAD = "the bank \ud800 of the river"


def test_the_rule():
    assert invalid_text("Ein Café in Köln – 😀") is None
    assert "surrogate at character 9" in invalid_text(BAD)
    with pytest.raises(InputError) as e:
        check_text(BAD, "sentences[3]")
    assert e.value.field == "sentences[3]"
    with pytest.raises(InputError) as e:
        check_document(["fine", "\udfff"])
    assert e.value.field == "document[1]"


@pytest.fixture(scope="module")
def embedder(tiny_model_dir):
    return Embedder.load(tiny_model_dir, threads=1)


def test_the_library_names_the_sentence_and_word(embedder):
    with pytest.raises(InputError) as e:
        embedder.embed(["fine", BAD])
    assert (e.value.field, e.value.index) == ("sentences[1]", 1)
    assert "surrogate" in str(e.value)
    with pytest.raises(InputError) as e:
        embedder.embed([["fine", "words"], ["ok", "\ud83d"]])
    assert (e.value.field, e.value.index, e.value.word) == ("sentences[1][1]", 1, 1)


def test_the_library_refuses_a_document_before_any_work(embedder):
    with pytest.raises(InputError) as e:
        list(embedder.embed_document(BAD))
    assert e.value.field == "document"
    with pytest.raises(InputError) as e:
        list(embedder.embed_document(["a", "\ud800"]))
    assert e.value.field == "document[1]"


def test_the_client_refuses_before_sending():
    # nothing listens here: the refusal comes before any request
    client = Client("http://127.0.0.1:9", retries=0)
    with pytest.raises(InputError) as e:
        next(iter(client.embed_document(BAD)))
    assert e.value.field == "document"
    with pytest.raises(InputError) as e:
        embed_body(["ok", BAD], mix=None, output=None, granularity="token", pooling="none")
    assert e.value.field == "sentences[1]"
