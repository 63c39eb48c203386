"""The text rules (``elmo_service/values.py`` ``text_problem``: no lone surrogate, no NUL) on
every surface but HTTP (that is tests/api/test_text_rules_live.py): the library's
``embed``, ``tokenize``, ``embed_document`` and ``tokenize_document``, and the client's
``embed`` and ``embed_document``, which refuse before sending anything (#56 item 3).

The model is a SentencePiece one: sentencepiece is what raised a bare RuntimeError on a
lone surrogate."""

from __future__ import annotations

import asyncio

import pytest

from elmo_client import AsyncClient, Client
from elmo_service.document import tokenize_document
from elmo_service.embedder import Embedder
from elmo_service.errors import InputError
from elmo_service.values import check_text, text_problem
from tests.support.core_fixtures import tiny_artifact, train_sentencepiece
from tests.support.ports import free_port

BAD = [
    ("a\ud800b", "lone surrogate (U+D800) at character 1"),
    ("ab\x00", "NUL character at character 2"),
]


@pytest.fixture(scope="module")
def sp_embedder(tmp_path_factory):
    d = tmp_path_factory.mktemp("sp")
    return Embedder.load(tiny_artifact(d / "model", train_sentencepiece(d)), threads=1)


def test_the_rule_itself():
    assert text_problem("naïve café 日本語 😀 \t\n") is None
    assert "lone surrogate (U+DC80) at character 3" in text_problem("abc\udc80")
    assert "NUL character at character 0" in text_problem("\x00")
    with pytest.raises(InputError) as e:
        check_text(["fine", "bad\ud800"], "document")
    assert e.value.field == "document[1]" and e.value.word == 1
    assert str(e.value).startswith("document[1] holds a lone surrogate")


@pytest.mark.parametrize(("text", "says"), BAD)
def test_the_library_names_the_sentence_and_word(sp_embedder, text, says):
    with pytest.raises(InputError) as e:
        sp_embedder.embed(["fine", f"x {text}"])
    assert e.value.field == "sentences[1]" and e.value.index == 1
    kind = says.split(" at ")[0]  # the position within "x ..." is 2 further on
    assert str(e.value).startswith(f"sentence 1 holds a {kind}")
    with pytest.raises(InputError) as e:
        sp_embedder.embed([["ok", "words"], ["ok", text]])
    assert (e.value.field, e.value.index, e.value.word) == ("sentences[1][1]", 1, 1)
    assert str(e.value).startswith("sentence 1, word 1 holds a") and says in str(e.value)
    with pytest.raises(InputError) as e:
        sp_embedder.tokenize([text], field="input")
    assert e.value.field == "input[0]" and says in str(e.value)


@pytest.mark.parametrize(("text", "says"), BAD)
def test_documents_are_refused_before_the_tokenizer_sees_them(sp_embedder, text, says):
    with pytest.raises(InputError) as e:
        list(sp_embedder.embed_document(f"A long document. {text} And more."))
    assert e.value.field == "document" and says.split(" at ")[0] in str(e.value)
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
