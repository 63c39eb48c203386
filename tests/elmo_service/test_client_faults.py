"""The client against a real misbehaving HTTP server (``tests/support/misbehaving.py``):
what it retries and what it never sends twice (#45 item 5), the whole-request timeout
(#50 item 3), credentials kept out of every message (#50 item 10), and the client side of
priorities and timing headers (#49) and of streamed documents (#48), whose server sides
are built elsewhere: here the server is scripted to the contract."""

from __future__ import annotations

import asyncio
import base64
import time

import numpy as np
import pytest

from elmo_client import AsyncClient, Client, InputError, ServiceError, ServiceUnreachable
from tests.support.misbehaving import Answer, Drip, Drop, Garbage, Scripted, Stream
from tests.support.ports import free_port

LIMITS = {"max_sentences": 2, "max_chars": 10_000, "max_body_bytes": 100_000,
          "max_response_floats": 1_000_000, "max_tokens_per_sentence": 50, "n_layers": 3,
          "dim": 2, "model": {"id": "m", "version": "v1"}}  # fmt: skip
FAST = dict(retries=5, retry_deadline=5.0)


def _array(x: np.ndarray) -> dict:
    x = np.ascontiguousarray(x, "<f4")
    return {"shape": list(x.shape), "dtype": "float32",
            "data": base64.b64encode(x.tobytes()).decode()}  # fmt: skip


def sentence_entry(i: int, text: str, value: float) -> dict:
    words = text.split()
    tokens, pos = [], 0
    for j, w in enumerate(words):
        start = text.index(w, pos)
        pos = start + len(w)
        tokens.append({"text": w, "start": start, "end": pos, "word": j})
    return {"index": i, "tokens": tokens, "layers": _array(np.full((3, len(words), 2), value))}


def embed_answer(sentences: list[str], version: str = "v1") -> dict:
    data = [sentence_entry(i, s, float(len(s))) for i, s in enumerate(sentences)]
    return {"object": "embed_result", "model": {"id": "m", "version": version}, "data": data}


def honest(req) -> Answer:
    """What a well-behaved server answers (limits, embed, the rest)."""
    if req.path == "/v1/limits":
        return Answer(body=LIMITS)
    if req.path == "/v1/embed":
        return Answer(body=embed_answer(req.body["sentences"]))
    if req.path == "/v1/jobs" and req.method == "POST":
        return Answer(body={"id": "j1", "state": "queued"})
    return Answer(body={"data": [], "object": "list"})


def failing_first(n_bad: int, bad, path: str):
    """``bad`` for the first ``n_bad`` requests of ``path``, then honest answers."""
    seen = {"n": 0}

    def handler(req):
        if req.path == path:
            seen["n"] += 1
            if seen["n"] <= n_bad:
                return bad() if callable(bad) else bad
        return honest(req)

    return handler


def _count(srv: Scripted, path: str, method: str | None = None) -> int:
    return sum(r.path == path and (method is None or r.method == method) for r in srv.requests)


BAD_STATUSES = [Answer(408, {"code": "timeout", "message": "request timeout"}),
                Answer(502, b"<html>bad gateway</html>"),
                Answer(504, b"gateway timeout")]  # fmt: skip
FAILURES = {"408": BAD_STATUSES[0], "502": BAD_STATUSES[1], "504": BAD_STATUSES[2],
            "drop": Drop(), "protocol": Garbage()}  # fmt: skip


# ------------------------------------------------------------------ retries (#45 item 5)


@pytest.mark.parametrize("failure", FAILURES)
def test_idempotent_calls_retry_gateway_failures_and_dropped_connections(failure):
    with Scripted(failing_first(2, FAILURES[failure], "/v1/embed")) as srv:
        with Client(srv.url, **FAST) as c:
            got = c.embed(["a b", "c d e"])
        assert [s.layers.shape for s in got] == [(3, 2, 2), (3, 3, 2)]
        assert _count(srv, "/v1/embed") == 3  # two failures, then the answer

    async def run():
        async with AsyncClient(srv2.url, **FAST) as ac:
            return await ac.tasks.list()

    with Scripted(failing_first(2, FAILURES[failure], "/v1/tasks")) as srv2:
        assert asyncio.run(run()) == []
        assert _count(srv2, "/v1/tasks") == 3


@pytest.mark.parametrize("failure", FAILURES)
def test_job_submission_is_never_sent_twice(failure):
    with Scripted(failing_first(1, FAILURES[failure], "/v1/jobs")) as srv:
        with (
            Client(srv.url, "admin", **FAST) as c,
            pytest.raises((ServiceError, ServiceUnreachable)),
        ):
            c.jobs.submit({"corpus": "x"})
        assert _count(srv, "/v1/jobs", "POST") == 1


def test_a_refused_job_submission_is_retried():
    """429 and 503 did nothing: even a job submission goes again."""
    busy = Answer(503, {"code": "busy", "message": "loading"}, {"Retry-After": "0"})
    with Scripted(failing_first(2, busy, "/v1/jobs")) as srv:
        with Client(srv.url, "admin", **FAST) as c:
            assert c.jobs.submit({"corpus": "x"})["id"] == "j1"
        assert _count(srv, "/v1/jobs", "POST") == 3


class StepClock:
    """The retry loop's clock, moved only by its own sleeps: the deadline checks below read
    what the client decided (how long it waited in all), never how busy the machine was."""

    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> StepClock:
    import elmo_client.sync
    import elmo_client.wire

    c = StepClock()
    monkeypatch.setattr(elmo_client.wire, "time", c)  # the retry deadline's clock
    monkeypatch.setattr(elmo_client.sync, "time", c)  # the sync driver's waits
    return c


def test_retries_stop_at_the_deadline_with_the_last_error(clock):
    with Scripted(lambda req: Answer(502, b"down")) as srv:
        with Client(srv.url, retries=50, retry_deadline=1.0) as c, pytest.raises(ServiceError) as e:
            c.tasks.list()
        assert 0 < sum(clock.sleeps) <= 1.0  # waited, never past the deadline
        assert e.value.status == 502 and e.value.url == srv.url + "/v1/tasks"
        assert _count(srv, "/v1/tasks") == len(clock.sleeps) + 1 > 2  # stopped well before 50


def test_a_refused_connection_is_retried_until_the_deadline(clock):
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens
    with Client(url, retries=50, retry_deadline=1.0) as c, pytest.raises(ServiceUnreachable):
        c.tasks.list()
    # it waited and tried again (backoff 0.1, 0.2, ...: past 0.3 s in all), within the deadline
    assert 0.3 < sum(clock.sleeps) <= 1.0 and 2 <= len(clock.sleeps) < 50


# ------------------------------------------------------------------ the whole-request timeout


def test_timeout_bounds_the_whole_request_not_each_read():
    """A server dripping a byte every 2.5 s: with timeout=3 the request ends at ~3 s."""
    with Scripted(lambda req: Drip(every=2.5, total=100)) as srv:
        for make in ("sync", "async"):
            t0 = time.monotonic()
            with pytest.raises(ServiceUnreachable) as e:
                if make == "sync":
                    with Client(srv.url, timeout=3, retries=0) as c:
                        c.tasks.list()
                else:

                    async def run():
                        async with AsyncClient(srv.url, timeout=3, retries=0) as ac:
                            await ac.tasks.list()

                    asyncio.run(run())
            took = time.monotonic() - t0
            # not before the timeout; the upper bound only tells "the whole request" from "each
            # read" (which would run 100 drips, 250 s), so load cannot reach it
            assert 2.9 <= took < 30, (make, took)
            assert srv.url + "/v1/tasks" in str(e.value) and not e.value.retryable


# ------------------------------------------------------------------ credentials


def test_no_message_shows_a_urls_credentials():
    port = free_port()
    secret_url = f"http://alice:s3cr3t-pw@127.0.0.1:{port}"
    with Client(secret_url, retries=0) as c, pytest.raises(ServiceUnreachable) as e:
        c.tasks.list()
    assert "s3cr3t-pw" not in str(e.value) and "s3cr3t-pw" not in e.value.url
    assert f"127.0.0.1:{port}/v1/tasks" in str(e.value) and "***@" in str(e.value)
    assert "s3cr3t-pw" not in repr(c.base_url)
    with Scripted(lambda req: Answer(401, {"code": "unauthorized", "message": "no"})) as srv:
        url = srv.url.replace("http://", "http://bob:hunter2@")
        with Client(url, retries=0) as c, pytest.raises(ServiceError) as e:
            c.tasks.list()
        assert e.value.status == 401 and "hunter2" not in str(e.value)
        # the credentials were still sent (httpx: basic auth from the URL)
        assert srv.requests[0].headers.get("Authorization", "").startswith("Basic ")
    with pytest.raises(InputError) as e:
        Client("ftp://carol:topsecret@h")
    assert "topsecret" not in str(e.value) and e.value.field == "base_url"


# ------------------------------------------------------------------ priorities and timings (#49)

TIMINGS = {"X-Total-Time": "12.5", "X-Tokenization-Time": "0.5", "X-Queue-Time": "2",
           "X-Inference-Time": "9.25"}  # fmt: skip


def lanes(req) -> Answer:
    if req.path == "/v1/embed":
        return Answer(body=embed_answer(req.body["sentences"]), headers=TIMINGS)
    return honest(req)


def test_priority_is_sent_and_a_split_call_is_batch_work():
    with Scripted(lanes) as srv:
        with Client(srv.url, **FAST) as c:
            one = c.embed(["a b"])  # one request: the server's default (interactive)
            split = c.embed(["a", "b c", "d"])  # max_sentences 2: two requests
            asked = c.embed(["a", "b c", "d"], priority="interactive")
            pinned = c.embed(["a"], priority="batch")
            with pytest.raises(InputError) as e:
                c.embed(["a"], priority="urgent")
            assert e.value.field == "priority"
        sent = [r.body.get("priority", "-") for r in srv.requests if r.path == "/v1/embed"]
        assert sent == ["-", "batch", "batch", "interactive", "interactive", "batch"]
    assert one.timings == {"total": 12.5, "tokenization": 0.5, "queue": 2.0, "inference": 9.25}
    assert split.requests == 2 and split.chunk_timings == [one.timings, one.timings]
    assert split.timings == {k: 2 * v for k, v in one.timings.items()}
    assert asked.requests == 2 and pinned.requests == 1


def test_an_older_server_without_lanes_still_embeds():
    """A server that refuses the field (422 naming ``priority``): the client drops it."""

    def old(req):
        if req.path == "/v1/embed" and "priority" in req.body:
            return Answer(422, {"code": "invalid_input", "message": "extra field",
                                "field": "priority"})  # fmt: skip
        return honest(req)

    with Scripted(old) as srv, Client(srv.url, **FAST) as c:
        got = c.embed(["a", "b c", "d"])
        assert got.requests == 3 and got.timings == {}  # one refused (the probe), then 2
        with pytest.raises(ServiceError) as e:  # asked for explicitly: not dropped
            c.embed(["a"], priority="batch")
        assert e.value.field == "priority"


def test_the_async_client_sends_priority_and_reads_timings():
    async def run(url):
        async with AsyncClient(url, **FAST) as ac:
            return await ac.embed(["a", "b c", "d"], priority="interactive")

    with Scripted(lanes) as srv:
        got = asyncio.run(run(srv.url))
        assert [r.body["priority"] for r in srv.requests if r.path == "/v1/embed"] == [
            "interactive", "interactive"
        ]  # fmt: skip
    assert got.timings["inference"] == 18.5


# ------------------------------------------------------------------ documents (#48)

DOC = "the river bank flooded after the long rain"


def doc_chunks(doc: str, per: int) -> list[dict]:
    """The contract's lines for ``doc`` cut every ``per`` words."""
    words, lines, pos = doc.split(), [], 0
    for k in range(0, len(words), per):
        toks = []
        for j, w in enumerate(words[k : k + per]):
            start = doc.index(w, pos)
            pos = start + len(w)
            toks.append({"text": w, "start": start, "end": pos, "word": k + j})
        layers = np.full((3, len(toks), 2), k, "<f4")
        lines.append({"index": 0, "chunk": k // per, "tokens": toks, "layers": _array(layers)})
    return lines


def documents(extra=None, cut=False, drop_done=False):
    def handler(req):
        if req.path != "/v1/embed/document":
            return honest(req)
        doc = req.body["document"]
        doc = doc if isinstance(doc, str) else " ".join(doc)
        lines = doc_chunks(doc, req.body["chunk_tokens"] or 3)
        n, t = len(lines), sum(len(x["tokens"]) for x in lines)
        if extra is not None:
            lines = extra(lines)
        if not drop_done:
            lines.append({"done": True, "chunks": n, "tokens": t})
        return Stream(lines, cut=cut)

    return handler


def test_a_document_streams_chunk_by_chunk_in_order():
    with Scripted(documents()) as srv:
        with Client(srv.url, **FAST) as c:
            chunks = list(c.embed_document(DOC, chunk_tokens=3, priority="batch"))
        body = next(r.body for r in srv.requests if r.path == "/v1/embed/document")
    assert body["document"] == DOC and body["chunk_tokens"] == 3 and body["priority"] == "batch"
    assert body["encoding"] == "base64" and body["output"] == "layers"
    assert [len(s.tokens) for s in chunks] == [3, 3, 2]
    words = [t.text for s in chunks for t in s.tokens]
    assert words == DOC.split() and [t.word for s in chunks for t in s.tokens] == list(range(8))
    assert all(DOC[t.start : t.end] == t.text for s in chunks for t in s.tokens)
    layers = np.concatenate([s.layers for s in chunks], axis=1)
    assert layers.shape == (3, 8, 2) and layers[0, :, 0].tolist() == [0, 0, 0, 3, 3, 3, 6, 6]

    async def run():
        async with AsyncClient(srv2.url, **FAST) as ac:
            return [s async for s in ac.embed_document(DOC.split(), chunk_tokens=3)]

    with Scripted(documents()) as srv2:
        got = asyncio.run(run())
    assert [len(s.tokens) for s in got] == [3, 3, 2]


@pytest.mark.parametrize(
    ("case", "kw", "match"),
    [
        ("no done", dict(drop_done=True), "without its last line"),
        ("cut", dict(cut=True, drop_done=True), "cut after 3 chunks|without its last line"),
        ("out of order", dict(extra=lambda ls: [ls[1], ls[0], *ls[2:]]), "chunk 1 came where"),
        ("wrong count", dict(extra=lambda ls: ls[:-1]), "counts 3 chunks"),
        (
            "error",
            dict(
                extra=lambda ls: [
                    ls[0],
                    {
                        "error": {
                            "code": "limit_exceeded",
                            "message": "document too long",
                            "field": "document",
                        }
                    },
                ]
            ),
            "document too long",
        ),  # fmt: skip
        (
            "nan",
            dict(
                extra=lambda ls: [{**ls[0], "layers": _array(np.full((3, 3, 2), np.nan))}, *ls[1:]]
            ),
            "NaN",
        ),  # fmt: skip
    ],
)
def test_a_document_stream_that_does_not_hold_together_is_an_error(case, kw, match):
    with Scripted(documents(**kw)) as srv:
        for make in ("sync", "async"):
            with pytest.raises(ServiceError, match=match) as e:
                if make == "sync":
                    with Client(srv.url, retries=0) as c:
                        list(c.embed_document(DOC, chunk_tokens=3))
                else:

                    async def run():
                        async with AsyncClient(srv.url, retries=0) as ac:
                            return [s async for s in ac.embed_document(DOC, chunk_tokens=3)]

                    asyncio.run(run())
            assert srv.url + "/v1/embed/document" in str(e.value)
            if case == "error":
                assert e.value.field == "document" and isinstance(e.value, InputError)


def test_a_document_is_checked_before_it_is_sent():
    with Scripted(documents()) as srv:
        with Client(srv.url) as c:
            with pytest.raises(InputError) as e:
                list(c.embed_document(3))
            assert e.value.field == "document"
            with pytest.raises(InputError) as e:
                list(c.embed_document("a b", chunk_tokens=0))
            assert e.value.field == "chunk_tokens"
        assert srv.requests == []
