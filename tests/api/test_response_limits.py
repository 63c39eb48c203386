"""Response amplification: a bound on the floats an answer carries,
streamed answers, and a send deadline for clients that never read.

The bound is computed from the request before any embedding (413 naming the
request's size and ``ELMO_MAX_RESPONSE_FLOATS``); big answers are streamed a
sentence at a time and equal the buffered ones; a real socket that sends a request
and never reads is dropped after ``ELMO_HTTP_SEND_TIMEOUT`` by a live uvicorn.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time

import httpx
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from elmo_api.encoding import decode_array
from elmo_api.http_protocol import uvicorn_options
from elmo_api.main import create_app
from elmo_api.settings import load_settings
from elmo_service.embedder import Embedder
from tests.support.live_server import LiveServer

torch.set_num_threads(1)

DIM, LAYERS = 16, 3  # the tiny model (tests/conftest.py)
THREE = ["one two three", "four five six", "seven eight nine"]  # 3 word tokens each


def _settings(model_dir, tmp_path, **kw):
    return load_settings(model_path=model_dir, threads=1, data_dir=tmp_path, **kw)


def _tokens_run(c) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith("elmo_tokens_total "):
            return float(line.split()[1])
    return 0.0


@pytest.mark.parametrize(
    ("extra", "floats"),
    [
        ({}, 3 * 3 * LAYERS * DIM),  # every layer of every token
        ({"layers": [0, 2]}, 3 * 3 * 2 * DIM),
        ({"output": "mix"}, 3 * 3 * DIM),
        ({"output": "both"}, 3 * 3 * (LAYERS + 1) * DIM),
        ({"pooling": "mean"}, 3 * LAYERS * DIM),
        ({"output": "mix", "pooling": "max"}, 3 * DIM),
    ],
)
def test_the_bound_is_exact_and_checked_before_embedding(tiny_model_dir, tmp_path, extra, floats):
    body = {"sentences": THREE, **extra}
    with TestClient(
        create_app(_settings(tiny_model_dir, tmp_path, max_response_floats=floats))
    ) as c:
        assert c.post("/v1/embed", json=body).status_code == 200  # exactly at the bound
    small = _settings(tiny_model_dir, tmp_path, max_response_floats=floats - 1)
    with TestClient(create_app(small)) as c:
        before = _tokens_run(c)
        r = c.post("/v1/embed", json=body)
        assert r.status_code == 413, r.text
        err = r.json()
        assert err["code"] == "response_too_large" and err["field"] == "sentences"
        assert f"{floats:,} floats" in err["message"]
        assert "3 sentences" in err["message"] and "ELMO_MAX_RESPONSE_FLOATS" in err["message"]
        assert _tokens_run(c) == before  # refused before the model ran


def test_word_granularity_counts_words(tiny_model_dir, tmp_path):
    s = _settings(tiny_model_dir, tmp_path, max_response_floats=2 * LAYERS * DIM)
    with TestClient(create_app(s)) as c:
        body = {"sentences": [["two", "words"]], "granularity": "word"}
        assert c.post("/v1/embed", json=body).status_code == 200


def test_embeddings_route_is_bounded_too(tiny_model_dir, tmp_path):
    s = _settings(tiny_model_dir, tmp_path, max_response_floats=2 * DIM)
    with TestClient(create_app(s)) as c:
        ok = c.post("/v1/embeddings", json={"input": THREE[:2], "model": "tiny"})
        assert ok.status_code == 200
        r = c.post("/v1/embeddings", json={"input": THREE, "model": "tiny"})
        err = r.json()["error"]  # OpenAI's body on OpenAI's route
        assert r.status_code == 413 and err["param"] == "input"
        assert "ELMO_MAX_RESPONSE_FLOATS" in err["message"]


def _big_request(n: int = 256, words: int = 60) -> dict:
    rng = np.random.default_rng(0)
    vocab = [f"w{i}" for i in range(500)]
    return {"sentences": [" ".join(rng.choice(vocab, words)) for _ in range(n)]}


def test_big_answers_are_streamed_and_equal_the_model(tiny_model_dir, tmp_path):
    req = _big_request(60, 60)  # 60 x 60 x (48 + 16) = 230,400 floats: streamed
    req["output"] = "both"
    ref = Embedder.load(tiny_model_dir, threads=1)
    with TestClient(create_app(_settings(tiny_model_dir, tmp_path))) as c:
        r = c.post("/v1/embed", json=req)
        assert r.status_code == 200
        assert "content-length" not in r.headers  # streamed (chunked)
        body = r.json()
        assert body["usage"]["sentences"] == 60 and len(body["data"]) == 60
        for d, e in zip(body["data"], ref.embed(req["sentences"]), strict=True):
            assert np.abs(decode_array(d["layers"]) - e.layers).max() <= 1e-5
            assert d["mix"]["shape"] == [60, DIM]
        small = c.post("/v1/embed", json={"sentences": THREE})
        assert "content-length" in small.headers  # small answers are sent whole


# -- a live server, real sockets ------------------------------------------------------------

SEND_S = 0.6


@pytest.fixture(scope="module")
def live(tiny_model_dir, tmp_path_factory):
    s = load_settings(
        model_path=tiny_model_dir, threads=1, data_dir=tmp_path_factory.mktemp("d"),
        http_send_timeout=SEND_S, cache=False,
    )  # fmt: skip
    with LiveServer(create_app(s), **uvicorn_options(s)) as srv:
        yield srv


def _post_raw(live, body: dict, rcvbuf: int = 4096) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: a small window
    sock.connect(("127.0.0.1", live.port))
    data = json.dumps(body).encode()
    sock.sendall(
        b"POST /v1/embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data
    )
    return sock


def _connections(live) -> int:
    return len(live.server.server_state.connections)


@pytest.mark.slow
def test_a_client_that_never_reads_is_dropped_after_the_send_deadline(live):
    for _ in range(2):  # one after the other (the admission bound would refuse them together)
        sock = _post_raw(live, _big_request(128))  # ~5 MB of JSON
        try:
            t0 = time.monotonic()
            while not _connections(live) and time.monotonic() - t0 < 10:
                time.sleep(0.01)
            while _connections(live) and time.monotonic() - t0 < 60:
                time.sleep(0.05)
            assert _connections(live) == 0, "the server still holds the unread answer"
            # what the client had been sent: the start of the answer, never its end
            sock.settimeout(5)
            got = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := sock.recv(1 << 20):
                    got += chunk
            assert got.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding: chunked" in got
            assert not got.endswith(b"\r\n0\r\n\r\n")  # cut off: the last chunk never came
        finally:
            sock.close()
    assert httpx.get(live.url + "/healthz").status_code == 200


@pytest.mark.slow
def test_a_slow_reader_that_keeps_reading_gets_the_whole_answer(live):
    """The deadline runs between two reads, not on the whole answer: pauses of a quarter of
    the deadline (half left a loaded machine's scheduling too little room), many deadlines
    in all."""
    sock = _post_raw(live, _big_request(128), rcvbuf=256 * 1024)  # ~5 MB, streamed
    got = b""
    pauses = 0
    try:
        sock.settimeout(10)
        while not got.endswith(b"\r\n0\r\n\r\n"):  # the last chunk of a chunked answer
            chunk = sock.recv(256 * 1024)
            assert chunk, f"the server closed a reader that kept reading, after {len(got)} bytes"
            got += chunk
            time.sleep(SEND_S / 4)
            pauses += 1
    finally:
        sock.close()
    assert got.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding: chunked" in got
    assert len(got) > 4 << 20 and pauses * SEND_S / 4 > 3 * SEND_S
