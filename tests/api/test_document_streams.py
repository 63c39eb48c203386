"""Documents on a real server process: bounded, stopped when their client leaves, refused
cleanly when their text has no UTF-8 form (#56 findings 1-3).

One ``elmo-service serve`` process on the bundled model, one document stream at a time
(``ELMO_MAX_DOCUMENT_STREAMS=1``) and its spills in a folder of the test's. A document of
~60k tokens spills (~150 MB) and its pass 1 takes seconds, so a client can leave while it
runs; what the server holds is read from ``/proc``: its threads, and its open files in the
spill folder. Every wait is a poll with a deadline, never a sleep then an assert.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from tests.support.replicas import REPO, Replica

pytestmark = pytest.mark.slow

LONG = " ".join(["The river bank was steep and the water ran fast ."] * 20000)  # ~220k tokens
SHORT = "A short document. It has two sentences."


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _spill_files(pid: int, spill: Path) -> list[str]:
    """Files the process holds open in the spill folder (they are unlinked: their links
    read ``<path> (deleted)``)."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(spill)):
            out.append(target)
    return out


def _until(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout}s: {what}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("docs")
    spill = tmp / "spill"
    rep = Replica(
        {
            "ELMO_MODEL_PATH": str(REPO / "models" / "default"),
            "ELMO_DATA_DIR": str(tmp / "data"),
            "ELMO_CACHE": "false",
            "ELMO_MAX_DOCUMENT_STREAMS": "1",
            "ELMO_DOCUMENT_SPILL_DIR": str(spill),
        },
        tmp,
        "docs",
    ).start()
    try:
        rep.wait_ready(120)
        yield rep, spill / str(rep.proc.pid)
    finally:
        rep.stop()


def _document(url: str, text: str, **extra) -> httpx.Response:
    r = httpx.post(url + "/v1/embed/document", json={"document": text, **extra}, timeout=120)
    return r


def test_a_short_document_streams_with_timings(server):
    rep, _ = server
    r = _document(rep.url, SHORT, output="mix")
    assert r.status_code == 200, r.text
    assert float(r.headers["x-tokenization-time"]) >= 0
    lines = [httpx.Response(200, content=x).json() for x in r.content.splitlines()]
    done = lines[-1]
    assert done["done"] is True and done["chunks"] == len(lines) - 1
    t = done["timings"]
    assert set(t) == {"total_ms", "tokenization_ms", "contextualize_ms", "answer_ms"}
    assert t["total_ms"] >= t["contextualize_ms"] > 0


def test_a_client_that_leaves_stops_its_work_and_frees_its_slot(server):
    rep, spill = server
    pid = rep.proc.pid
    assert _document(rep.url, SHORT).status_code == 200  # the server's own threads exist now
    # the server at rest: the least count over a second (a finished document's thread may
    # still be on its way out)
    baseline = min(_threads(pid) for _ in range(20) if time.sleep(0.05) is None)
    with (
        httpx.Client(timeout=120) as c,
        c.stream("POST", rep.url + "/v1/embed/document", json={"document": LONG}) as r,
    ):
        assert r.status_code == 200
        # pass 1 is running: its spill files are open (no line exists yet)
        _until(lambda: _spill_files(pid, spill), 60, "the document's spill files open")
    # the client left before any line
    _until(lambda: not _spill_files(pid, spill), 10, "the spill files closed")
    _until(lambda: _threads(pid) <= baseline, 30, f"threads back to {baseline}")
    # the slot is free again: the one stream allowed is granted
    assert _until(lambda: _document(rep.url, SHORT).status_code == 200, 30, "a slot again")


def test_a_stream_past_the_limit_is_429_with_retry_after(server):
    rep, spill = server
    pid = rep.proc.pid
    with (
        httpx.Client(timeout=120) as c,
        c.stream("POST", rep.url + "/v1/embed/document", json={"document": LONG}) as r,
    ):
        assert r.status_code == 200
        _until(lambda: _spill_files(pid, spill), 60, "the first document running")
        second = _document(rep.url, SHORT)
        assert second.status_code == 429, second.text
        assert int(second.headers["retry-after"]) >= 1
        err = second.json()
        assert err["code"] == "overloaded" and err["field"] == "document"
        assert "ELMO_MAX_DOCUMENT_STREAMS" in err["message"]
        # /v1/embed is not a document: it still answers, with the library's vectors
        e = httpx.post(rep.url + "/v1/embed", json={"sentences": ["the bank"]}, timeout=60)
        assert e.status_code == 200
    _until(lambda: not _spill_files(pid, spill), 30, "the first document's spills closed")


def test_a_lone_surrogate_in_a_document_is_a_422_naming_the_field(server):
    rep, _ = server
    for doc in ('"the bank \\ud800 of the river"', '["the", "bank", "\\udfff"]'):
        body = ('{"document": ' + doc + "}").encode()
        r = httpx.post(
            rep.url + "/v1/embed/document",
            content=body,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        assert r.status_code == 422, r.text
        err = r.json()
        assert err["field"].startswith("document"), err
        assert "surrogate" in err["message"]
    # and the server is fine: its log has no traceback
    assert "Traceback" not in rep.log.read_text()
