"""The text rules on a live server (#56 item 3): a lone surrogate or a NUL in ``/v1/embed``,
``/v1/embed/document`` and TEI's routes is a 422 naming the field
(``/v1/embeddings``: a 400, OpenAI's), never a 500 with sentencepiece's traceback in the log. The library and the client:
tests/elmo_service/test_text_rule.py; the one rule: ``elmo_service/values.py``
``invalid_text``."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from elmo_api.main import create_app
from elmo_api.settings import load_settings
from tests.support.core_fixtures import tiny_artifact, train_sentencepiece
from tests.support.live_server import LiveServer

pytestmark = pytest.mark.slow  # a live uvicorn server

# JSON escapes: what any client's body carries for these characters
BAD = {"surrogate": ("a\ud800b", "lone surrogate"), "nul": ("ab\x00", "NUL character")}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    d = tmp_path_factory.mktemp("sp")
    model = tiny_artifact(d / "model", train_sentencepiece(d))  # sentencepiece: it used to 500
    s = load_settings(model_path=model, threads=1, data_dir=tmp_path_factory.mktemp("data"))
    with LiveServer(create_app(s)) as srv:
        yield srv


@pytest.mark.parametrize("bad", sorted(BAD))
def test_every_route_answers_422_naming_the_field(live, bad, caplog):
    text, says = BAD[bad]
    cases = [
        ("/v1/embed", {"sentences": ["fine", f"x {text}"]}, "sentences[1]"),
        ("/v1/embed", {"sentences": [["ok", text]]}, "sentences[0]"),
        ("/v1/embed/document", {"document": f"A document. {text} More."}, "document"),
        ("/v1/embed/document", {"document": ["one", text]}, "document[1]"),
    ]
    caplog.set_level(logging.WARNING)
    with httpx.Client(base_url=live.url, timeout=60) as http:
        for path, body, field in cases:
            raw = json.dumps(body).encode()  # ASCII escapes: "\\ud800", as hostile bodies carry
            r = http.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 422, (path, body, r.status_code, r.text)
            got = r.json()
            # the field (a list item where the route names it: sentences[1], document)
            assert got["field"] in (field, field.split("[")[0]), (path, got)
            assert says in got["message"], (path, got)
        for inp in (["fine", text], text):  # OpenAI's dialect: 400 and its error body
            raw = json.dumps({"input": inp, "model": "tiny"}).encode()
            r = http.post(
                "/v1/embeddings", content=raw, headers={"content-type": "application/json"}
            )
            assert r.status_code == 400, (inp, r.status_code, r.text)
            err = r.json()["error"]
            assert err["param"] == "input" and says in err["message"], err
        for path in ("/embed", "/embed_all", "/tokenize"):  # TEI's dialect: its error body
            raw = json.dumps({"inputs": ["fine", text]}).encode()
            r = http.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 422, (path, r.status_code, r.text)
            assert says in r.json()["error"], (path, r.text)
        # the server still serves, and logged no failure
        assert http.post("/v1/embed/document", json={"document": "A document."}).status_code == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
