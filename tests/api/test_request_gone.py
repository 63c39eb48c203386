"""Work belongs to a live request (#56): a large ``/v1/embed`` whose HTTP client leaves while
its first batch is in the model is dropped there, the rest of its sentences never reach the
model, on both lanes (``priority=batch`` is the bulk lane). A real server; the test waits on
events (the model entered, the server answered the gone client 499), never on a clock.
Documents are held by tests/api/test_document_streams.py."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from elmo_api.main import create_app
from elmo_api.settings import load_settings
from tests.support.live_server import LiveServer

pytestmark = pytest.mark.slow  # a live uvicorn server

N, PER_BATCH = 24, 4


def _until(cond, what: str, limit: float = 30.0) -> None:
    """Wait for ``cond``; ``limit`` only turns a hang into a failure."""
    end = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < end, f"never: {what}"
        time.sleep(0.01)


def _send_and_leave(url: str, body: dict, entered: threading.Event) -> None:
    """POST ``body`` on a raw connection and close it once the model has its first batch."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/embed HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(head + data)
        assert entered.wait(30)
    # closed: the client left


@pytest.mark.parametrize("priority", ["interactive", "batch"])
def test_a_large_request_whose_client_leaves_stops_within_one_batch(
    tiny_model_dir, tmp_path, priority
):
    s = load_settings(
        model_path=tiny_model_dir,
        threads=1,
        data_dir=tmp_path,
        cache=False,
        max_batch_sentences=PER_BATCH,
    )
    app = create_app(s)
    with LiveServer(app) as srv:
        runner = app.state.holder.current.runner
        real = runner.embed_fn
        gate, entered, seen = threading.Event(), threading.Event(), []

        def gated(sentences):
            seen.extend(tuple(x) for x in sentences)
            if any(x[0].startswith("big") for x in sentences):  # the large request's batches
                entered.set()
                assert gate.wait(30)
            return real(sentences)

        runner.embed_fn = gated
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            assert http.post("/v1/embed", json={"sentences": ["hello"]}).status_code == 200
            threads = threading.active_count()
            gone = app.state.metrics.requests.labels("/v1/embed", "POST", "499")
            large = [f"big{i} x{i}" for i in range(N)]
            _send_and_leave(srv.url, {"sentences": large, "priority": priority}, entered)
            _until(lambda: gone._value.get() == 1, "the server answered the gone client 499")
            gate.set()
            after = http.post("/v1/embed", json={"sentences": ["after"], "priority": priority})
            assert after.status_code == 200
            metrics = http.get("/metrics").text
        first = [x for x in seen if x[0].startswith("big")]
        assert 0 < len(first) <= PER_BATCH, first  # the batch in the model when it left
        assert ("after",) in seen
        assert f'elmo_dropped_sentences_total{{reason="cancelled"}} {N - len(first)}.0' in metrics
        assert runner.depth == 0 and threading.active_count() <= threads
