"""``ELMO_TOKENIZE_OFF_LOOP_SENTENCES``: a large request is tokenized on a thread of its own
(not the event loop), with the same tokens, vectors and errors as one tokenized on the loop."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from fastapi.testclient import TestClient

from elmo_api.main import create_app
from elmo_api.settings import load_settings

SENTENCES = [f"sentence number {i} of the request ." for i in range(9)]


def _client(tiny_model_dir, tmp_path, off_loop: int) -> TestClient:
    options = {"threads": 1, "cache": False, "tokenize_off_loop_sentences": off_loop}
    s = load_settings(model_path=tiny_model_dir, data_dir=tmp_path, **options)
    return TestClient(create_app(s), raise_server_exceptions=False)


@pytest.fixture
def tokenizing_threads(monkeypatch):
    """The names of the threads each tokenize call ran on."""
    from elmo_api.served import ServedModel

    seen: list[str] = []
    real = ServedModel.tokenize

    def spy(self, sentences, field="sentences"):
        seen.append(threading.current_thread().name)
        return real(self, sentences, field)

    monkeypatch.setattr(ServedModel, "tokenize", spy)
    return seen


def test_a_large_request_is_tokenized_off_the_loop_with_the_same_answer(
    tiny_model_dir, tmp_path, tokenizing_threads
):
    answers = {}
    for off_loop in (0, 8):
        tokenizing_threads.clear()
        with _client(tiny_model_dir, tmp_path / str(off_loop), off_loop) as c:
            big = c.post("/v1/embed", json={"sentences": SENTENCES, "output": "mix"})
            small = c.post("/v1/embed", json={"sentences": SENTENCES[:2], "output": "mix"})
            bad = c.post("/v1/embed", json={"sentences": [*SENTENCES[:8], "x " * 600]})
        assert big.status_code == small.status_code == 200, big.text
        # the 422/413 names the sentence, wherever it was tokenized
        assert bad.status_code in (413, 422) and "sentences[8]" in bad.text, bad.text
        answers[off_loop] = big.json()["data"]
        # the small request on the loop; the warm-up (which starts the thread) and the two of
        # 9 sentences on the tokenizing thread
        big_threads = [t for t in tokenizing_threads if t.startswith("elmo-tokenize")]
        assert len(big_threads) == (3 if off_loop else 0), tokenizing_threads
    for a, b in zip(answers[0], answers[8], strict=True):
        assert a["tokens"] == b["tokens"]
        assert np.array_equal(np.array(a["mix"]), np.array(b["mix"]))


def test_a_negative_count_is_refused_naming_the_variable(tiny_model_dir, tmp_path):
    from elmo_service.errors import ConfigError

    with pytest.raises((ConfigError, ValueError), match="ELMO_TOKENIZE_OFF_LOOP_SENTENCES"):
        load_settings(model_path=tiny_model_dir, data_dir=tmp_path, tokenize_off_loop_sentences=-1)


def test_a_large_requests_cache_entries_written_off_the_loop_are_read_back(
    tiny_model_dir, tmp_path
):
    s = load_settings(  # the memory cache
        model_path=tiny_model_dir, threads=1, data_dir=tmp_path, tokenize_off_loop_sentences=8
    )
    with TestClient(create_app(s)) as c:
        first = c.post("/v1/embed", json={"sentences": SENTENCES, "output": "mix"}).json()
        again = c.post("/v1/embed", json={"sentences": SENTENCES, "output": "mix"}).json()
    assert first["usage"]["cache_misses"] == again["usage"]["cache_hits"] == len(SENTENCES)
    assert first["data"] == again["data"]
