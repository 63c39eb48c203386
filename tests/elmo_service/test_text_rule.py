"""One text rule on every surface (#56 finding 3); the client's inline mixes are held by
tests/elmo_service/test_client.py (#57 item 7).

``elmo_service.values.invalid_text`` is the rule, written once: a lone surrogate has no
UTF-8 form (the tokenizer would fail deep inside: sentencepiece's RuntimeError, orjson a
bare TypeError), a NUL is never text. The library (sentences and documents), the API's
schemas and the client apply it (``check_text`` / ``check_document``) and name the field.
The routes are held by tests/api/test_text_rules_live.py (a real server). The model is a
SentencePiece one: sentencepiece is what raised a bare RuntimeError on a lone surrogate.
"""

from __future__ import annotations

import asyncio

import pytest

from elmo_client import AsyncClient, Client
from elmo_service.document import tokenize_document
from elmo_service.embedder import Embedder
from elmo_service.errors import InputError
from elmo_service.values import check_document, check_text, invalid_text
from tests.support.core_fixtures import tiny_artifact, train_sentencepiece
from tests.support.ports import free_port

BAD = [
    ("a\ud800b", "lone surrogate at character 1"),
    ("ab\x00", "NUL character at character 2"),
]


@pytest.fixture(scope="module")
def sp_embedder(tmp_path_factory):
    d = tmp_path_factory.mktemp("sp")
    return Embedder.load(tiny_artifact(d / "model", train_sentencepiece(d)), threads=1)


def test_the_rule():
    assert invalid_text("Ein Café in Köln – 😀 \t\n") is None
    assert "lone surrogate at character 9" in invalid_text("the bank \ud800 of the river")
    assert "NUL character at character 0" in invalid_text("\x00")
    with pytest.raises(InputError) as e:
        check_text("x\x00", "sentences[3]")
    assert e.value.field == "sentences[3]"
    with pytest.raises(InputError) as e:
        check_document(["fine", "\udfff"])
    assert e.value.field == "document[1]"
    assert str(e.value).startswith("document[1] is not valid Unicode")


@pytest.mark.parametrize(("text", "says"), BAD)
def test_the_library_names_the_sentence_and_word(sp_embedder, text, says):
    with pytest.raises(InputError) as e:
        sp_embedder.embed(["fine", f"x {text}"])
    assert (e.value.field, e.value.index) == ("sentences[1]", 1)
    assert says.split(" at ")[0] in str(e.value)  # the position within "x ..." is 2 further on
    with pytest.raises(InputError) as e:
        sp_embedder.embed([["ok", "words"], ["ok", text]])
    assert (e.value.field, e.value.index, e.value.word) == ("sentences[1][1]", 1, 1)
    assert says in str(e.value)
    with pytest.raises(InputError) as e:
        sp_embedder.tokenize([text], field="input")
    assert e.value.field == "input[0]" and says in str(e.value)


@pytest.mark.parametrize(("text", "says"), BAD)
def test_documents_are_refused_before_the_tokenizer_sees_them(sp_embedder, text, says):
    with pytest.raises(InputError) as e:
        list(sp_embedder.embed_document(f"A long document. {text} And more."))
    assert e.value.field == "document" and says.split(" at ")[0] in str(e.value)
    with pytest.raises(InputError) as e:
        list(sp_embedder.embed_document(["a", text]))
    assert e.value.field == "document[1]" and says in str(e.value)
    with pytest.raises(InputError) as e:
        tokenize_document(sp_embedder.tokenizer, ["one", "two", text], max_tokens=None)
    assert e.value.field == "document[2]" and says in str(e.value)


@pytest.mark.parametrize(("text", "says"), BAD)
def test_the_client_refuses_before_sending(text, says):
    # nothing listens there: a request would be ServiceUnreachable, not an InputError
    url = f"http://127.0.0.1:{free_port()}"
    with Client(url, retries=0) as client:
        with pytest.raises(InputError) as e:
            next(iter(client.embed_document(["one", text])))
        assert e.value.field == "document[1]" and says in str(e.value)
        with pytest.raises(InputError) as e:
            client.embed(["fine", text])
        assert e.value.field == "sentences[1]" and says in str(e.value)

    async def run():
        async with AsyncClient(url, retries=0) as client:
            with pytest.raises(InputError) as e:
                async for _ in client.embed_document(text):
                    pass
            assert e.value.field == "document" and says in str(e.value)

    asyncio.run(run())
