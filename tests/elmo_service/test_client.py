"""The client's protocol without a server (``clients/python/elmo_client/wire.py``): splitting under
every limit, the retry rule, errors and their positions. The live server: test_client_live.py."""

from __future__ import annotations

import base64
import random
import re

import numpy as np
import orjson
import pytest

from elmo_client import Client, ServiceError
from elmo_client.shared import decode_array
from elmo_client.wire import (
    Limits,
    RetryPolicy,
    check_sentences,
    embed_body,
    error_from,
    plan_chunks,
    shift_error,
)
from elmo_service.errors import InputError

LIMITS = Limits(
    max_sentences=4,
    max_chars=100,
    max_body_bytes=1024 + 200,  # 200 bytes of sentences once the overhead is kept free
    max_response_floats=10_000,
    max_tokens_per_sentence=50,
    n_layers=3,
    dim=16,
)


def _sizes(sentences, chunks):
    return [sentences[a:b] for a, b in chunks]


def _check_cover(sentences, chunks):
    """Contiguous, in order, every sentence once."""
    assert chunks[0][0] == 0 and chunks[-1][1] == len(sentences)
    assert all(b0 == a1 for (_, b0), (a1, _) in zip(chunks, chunks[1:], strict=False))
    assert all(a < b for a, b in chunks)


@pytest.mark.parametrize("batch_size", [1, 3, 100])
def test_chunks_stay_under_the_sentence_limit_and_the_batch_size(batch_size):
    sentences = [f"s{i}" for i in range(11)]
    chunks = plan_chunks(
        sentences, LIMITS, batch_size=batch_size, floats_per_position=1, pooled=False
    )
    _check_cover(sentences, chunks)
    assert max(b - a for a, b in chunks) == min(batch_size, LIMITS.max_sentences)


def test_chunks_stay_under_the_character_and_byte_limits():
    rng = random.Random(0)
    sentences = ["x" * rng.randint(1, 60) for _ in range(40)]
    sentences[5] = ["pre", "tokenized", "words"]
    chunks = plan_chunks(sentences, LIMITS, batch_size=64, floats_per_position=1, pooled=False)
    _check_cover(sentences, chunks)
    for part in _sizes(sentences, chunks):
        chars = sum(len(s) if isinstance(s, str) else len(" ".join(s)) for s in part)
        assert chars <= LIMITS.max_chars or len(part) == 1
        assert len(orjson.dumps(part)) <= 200 or len(part) == 1
    # the byte limit binds where characters take several bytes (UTF-8)
    wide = ["\u00e9\u00e8\u00ea" * 8] * 20  # 24 chars, 48+ bytes each
    chunks = plan_chunks(wide, LIMITS, batch_size=64, floats_per_position=1, pooled=False)
    assert all(len(orjson.dumps(p)) <= 200 for p in _sizes(wide, chunks))
    assert max(b - a for a, b in chunks) == 3  # 4 would fit the characters, not the bytes


def test_chunks_stay_under_the_estimated_answer_size():
    sentences = ["one two three four five"] * 10  # 11 estimated positions each
    chunks = plan_chunks(sentences, LIMITS, batch_size=64, floats_per_position=400, pooled=False)
    assert max(b - a for a, b in chunks) == 2  # 3 x 11 x 400 > 10,000
    pooled = plan_chunks(sentences, LIMITS, batch_size=64, floats_per_position=400, pooled=True)
    assert max(b - a for a, b in pooled) == 4  # one position each: the sentence limit binds


def test_a_sentence_over_a_limit_goes_alone():
    sentences = ["a", "x" * 500, "b"]
    chunks = plan_chunks(sentences, LIMITS, batch_size=64, floats_per_position=1, pooled=False)
    assert chunks == [(0, 1), (1, 2), (2, 3)]


def test_a_chunks_error_is_named_in_the_whole_input():
    e = ServiceError(413, "limit_exceeded", "sentence 1 has 70 tokens; the limit is 64",
                     "sentences[1]", "http://h/v1/embed")  # fmt: skip
    moved = shift_error(e, 12)
    assert moved.field == "sentences[13]" and moved.message.startswith("sentence 13 has 70")
    assert moved.status == 413 and moved.code == "limit_exceeded"
    word = ServiceError(422, "invalid_input", "sentence 0, word 2 is empty", "sentences[0][2]", "u")
    assert shift_error(word, 5).field == "sentences[5][2]"
    assert shift_error(word, 5).message == "sentence 5, word 2 is empty"
    other = ServiceError(422, "invalid_input", "bad", "mix", "u")
    assert shift_error(other, 5) is other


def test_the_retry_rule():
    p = RetryPolicy(retries=5, deadline=10.0, base=0.1, cap=1.0, rng=random.Random(1))
    assert p.delay(0, 400, None, 0.0) is None and p.delay(0, 500, "1", 0.0) is None
    for attempt in range(5):
        backoff = min(1.0, 0.1 * 2**attempt)
        d = p.delay(attempt, 429, "2", 0.0)
        assert 2.0 <= d <= 2.0 + backoff  # Retry-After, plus jitter
        d = p.delay(attempt, 503, None, 0.0)
        assert 0 < d <= 2 * backoff  # no Retry-After: backoff plus jitter
    assert p.delay(5, 429, "1", 0.0) is None  # retries spent
    assert p.delay(0, 429, "3", 8.0) is None  # would pass the deadline
    assert p.delay(0, 429, "Wed, 21 Oct 2015 07:28:00 GMT", 0.0) is not None  # a date: backoff
    delays = {round(p.delay(3, 429, "1", 0.0), 6) for _ in range(20)}
    assert len(delays) > 10  # jittered: clients refused together come back apart


def test_errors_carry_the_servers_code_message_and_field():
    e = error_from(422, b'{"code":"invalid_input","message":"no","field":"mix[1]"}', "http://h/x")
    assert (e.status, e.code, e.message, e.field, e.url) == (
        422,
        "invalid_input",
        "no",
        "mix[1]",
        "http://h/x",
    )
    assert str(e) == "http://h/x answered 422 invalid_input: no (field mix[1])"
    assert isinstance(e, InputError)  # as the library raises for the same input
    e = error_from(502, b"<html>Bad gateway</html>", "http://h/x")
    assert not isinstance(e, InputError)
    assert e.code == "http_502" and "Bad gateway" in e.message and e.field is None


def test_sentences_the_library_refuses_are_refused_before_any_request():
    with pytest.raises(InputError) as e:
        check_sentences(["ok", 3])
    assert e.value.field == "sentences[1]"
    with pytest.raises(InputError) as e:
        check_sentences([["a", None]])
    assert e.value.field == "sentences[0]"


def test_the_body_asks_for_base64_floats_and_the_mix():
    from elmo_service.scalar_mix import MixSpec

    body = embed_body(["a"], mix=None, output=None, granularity="word", pooling="mean")
    assert body["encoding"] == "base64" and body["dtype"] == "float32"
    assert body["output"] == "layers" and "task" not in body and "mix" not in body
    body = embed_body([("a", "b")], mix="pos", output=None, granularity="token", pooling="none")
    assert body["task"] == "pos" and body["output"] == "both" and body["sentences"] == [["a", "b"]]
    spec = MixSpec([0.0, 1.0, 2.0], gamma=0.5, layer_norm=True)
    body = embed_body(["a"], mix=spec, output="mix", granularity="token", pooling="none")
    assert body["mix"] == [0.0, 1.0, 2.0] and body["gamma"] == 0.5 and body["layer_norm"] is True


def test_arrays_decode_bit_exactly():
    x = np.random.default_rng(0).standard_normal((3, 5, 4)).astype(np.float32)
    obj = {
        "shape": [3, 5, 4],
        "dtype": "float32",
        "data": base64.b64encode(x.astype("<f4").tobytes()).decode(),
    }
    assert np.array_equal(decode_array(obj), x)
    half = {
        "shape": [2],
        "dtype": "float16",
        "data": base64.b64encode(np.array([1.5, -2], "<f2").tobytes()).decode(),
    }
    got = decode_array(half)
    assert got.dtype == np.float32 and got.tolist() == [1.5, -2.0]


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "ftp://h", "http://"])
def test_a_base_url_that_is_not_one_is_named(url):
    with pytest.raises(InputError) as e:
        Client(url)
    assert e.value.field == "base_url" and url in e.value.message


# ------------------------------------------------------------------ ops.embed, driven by hand


class FakeServer:
    """Answers ``ops.embed``'s requests as the server would (one token per word, layers
    filled with the sentence's global number), with the version and refusals a test sets."""

    def __init__(self, versions=None, too_large_over: int | None = None, refuse=None):
        self.versions = versions or (lambda n_call, first: "v1")
        self.too_large_over, self.refuse = too_large_over, refuse
        self.embed_calls: list[list] = []
        self.served = "v1"

    def answer(self, call):
        if call.path == "/v1/models":  # the fleet converges on the served model
            return {"fleet": {"desired": {"id": "m", "version": self.served}}}
        if call.path == "/v1/limits":
            return {"max_sentences": 4, "max_chars": 10_000, "max_body_bytes": 100_000,
                    "max_response_floats": 1_000_000, "max_tokens_per_sentence": 50,
                    "n_layers": 3, "dim": 2, "model": {"id": "m", "version": self.served}}  # fmt: skip
        sentences = call.json["sentences"]
        self.embed_calls.append(sentences)
        if self.refuse is not None and (err := self.refuse(sentences)) is not None:
            return err
        if self.too_large_over is not None and len(sentences) > self.too_large_over:
            return ServiceError(413, "response_too_large", "too many floats", "sentences", "u")
        version = self.versions(len(self.embed_calls), sentences[0])
        data = []
        for i, s in enumerate(sentences):
            words = s.split()
            n = int(words[0][1:])  # "s17 ..." -> 17
            layers = np.full((3, len(words), 2), n, dtype="<f4")
            b64 = base64.b64encode(layers.tobytes()).decode()
            data.append({
                "index": i,
                "tokens": [{"text": w, "start": 0, "end": len(w), "word": j} for j, w in enumerate(words)],
                "layers": {"shape": list(layers.shape), "dtype": "float32", "data": b64},
            })  # fmt: skip
        return {"model": {"id": "m", "version": version}, "data": data}


def drive(op, server: FakeServer):
    """Run an ``ops`` generator against ``server`` (what Client._run does over HTTP)."""
    from elmo_client.wire import Many, Reply, Sleep

    value = None
    while True:
        try:
            step = op.send(value)
        except StopIteration as stop:
            return stop.value
        if isinstance(step, Sleep):  # a round's backoff: not waited here
            value = None
            continue
        calls = step.calls if isinstance(step, Many) else [step]
        answers = [server.answer(c) for c in calls]
        reply = Reply(200, {}, b"", "http://h")
        answers = [a if c.parse is None or isinstance(a, ServiceError) else c.parse(a, reply)
                   for c, a in zip(calls, answers, strict=True)]  # fmt: skip
        if isinstance(step, Many):
            value = answers
        elif isinstance(answers[0], ServiceError):
            raise answers[0]
        else:
            value = answers[0]


def _embed(server, sentences, batch_size=4):
    from elmo_client import ops

    return drive(ops.embed(ops.Session(batch_size), sentences), server)


def _numbers(result) -> list[int]:
    return [int(s.layers[0, 0, 0]) for s in result]


def test_answers_are_reassembled_in_input_order():
    sentences = [f"s{i} w" for i in range(11)]
    server = FakeServer()
    got = _embed(server, sentences, batch_size=3)
    assert len(server.embed_calls) == 4 and _numbers(got) == list(range(11))
    assert got.model_version == "v1" and got[3].tokens[0].text == "s3"


def test_answers_too_large_are_split_until_they_fit():
    sentences = [f"s{i} w" for i in range(8)]
    server = FakeServer(too_large_over=1)
    got = _embed(server, sentences)
    assert _numbers(got) == list(range(8))
    assert sorted(len(c) for c in server.embed_calls) == [1] * 8 + [2] * 4 + [4] * 2


def test_a_model_swapped_mid_call_is_asked_again_on_the_new_version():
    # the first request is answered by the old model, the rest by the new one
    server = FakeServer(versions=lambda n, first: "v1" if n == 1 else "v2")
    server.served = "v2"
    got = _embed(server, [f"s{i} w" for i in range(8)])
    assert got.model_version == "v2" and _numbers(got) == list(range(8))
    assert [c[0] for c in server.embed_calls] == ["s0 w", "s4 w", "s0 w"]  # s0..s3 again


def test_an_error_names_the_sentence_in_the_whole_input():
    def refuse(sentences):
        if "s9 bad" in sentences:
            k = sentences.index("s9 bad")
            return ServiceError(
                422, "invalid_input", f"sentence {k} is bad", f"sentences[{k}]", "u"
            )
        return None

    sentences = [f"s{i} w" for i in range(12)]
    sentences[9] = "s9 bad"
    with pytest.raises(ServiceError) as e:
        _embed(FakeServer(refuse=refuse), sentences)
    assert e.value.field == "sentences[9]" and e.value.message == "sentence 9 is bad"


def test_a_swap_and_a_split_together_keep_every_sentence_once():
    # the old model answered the first request; the new one's answers are too large for 4
    server = FakeServer(versions=lambda n, first: "v1" if n == 1 else "v2")
    server.served = "v2"
    first = [True]

    def refuse(sentences):
        if first[0]:
            first[0] = False
            return None
        if len(sentences) > 2:
            return ServiceError(413, "response_too_large", "too many floats", "sentences", "u")
        return None

    server.refuse = refuse
    got = _embed(server, [f"s{i} w" for i in range(8)])
    assert got.model_version == "v2" and _numbers(got) == list(range(8))


def _records(*states):
    """Job records as the server answers them, one per poll."""
    out = []
    for state, step, loss in states:
        progress = {"step": step, "total_steps": 40, "loss": loss}
        out.append({"id": "j1", "state": state, "phase": None, "progress": progress,
                    "error": "trainer diverged" if state == "failed" else None})  # fmt: skip
    return out


def _poll(records, **kw):
    """``jobs.wait``'s generator against a scripted server: the records in turn, no sleeping."""
    from elmo_client import ops
    from elmo_client.wire import Call, Sleep

    op = ops._wait("j1", kw.pop("progress", True), kw.pop("poll", 0.01), kw.pop("timeout", None))
    polls, value = iter(records), None
    while True:
        try:
            step = op.send(value)
        except StopIteration as stop:
            return stop.value
        if isinstance(step, Call):
            assert step.path == "/v1/jobs/j1"
            value = next(polls)
        else:
            assert isinstance(step, Sleep)
            value = None


def test_wait_shows_steps_and_loss_and_ends_with_the_result(capsys):
    recs = _records(("queued", 0, None), ("running", 10, 5.25), ("succeeded", 40, 3.5))
    assert _poll(recs)["state"] == "succeeded"
    bar = capsys.readouterr().err
    assert "job j1" in bar and "10/40" in bar and "40/40" in bar and "loss=3.5" in bar


def test_wait_raises_the_jobs_error():
    from elmo_client import JobFailed

    with pytest.raises(JobFailed, match="j1 failed: trainer diverged") as e:
        _poll(_records(("running", 5, 9.0), ("failed", 7, None)), progress=False)
    assert e.value.record["progress"]["step"] == 7


def test_wait_gives_up_at_its_timeout():
    with pytest.raises(TimeoutError, match="still running"):
        _poll(_records(*[("running", 1, 1.0)] * 3), progress=False, timeout=0)


# ------------------------------------------------------------------ an inline mix (#57)
def test_a_mix_is_a_list_a_dict_or_a_mixspec_and_they_send_one_body():
    from elmo_client.wire import output_body
    from elmo_service.scalar_mix import MixSpec

    def body(mix):
        return output_body(mix=mix, output="mix", granularity="token", pooling="none")

    want = {"mix": [0.0, 1.0, 2.0], "gamma": 1.0, "per_direction": False, "layer_norm": False}
    assert {k: body([0, 1, 2])[k] for k in want} == want
    assert body((0.0, 1.0, 2.0)) == body(np.array([0.0, 1.0, 2.0])) == body([0, 1, 2])
    spec = {"weights": [0.0, 1.0, 2.0], "gamma": 0.5, "layer_norm": True}
    assert body(spec) == body(MixSpec([0.0, 1.0, 2.0], gamma=0.5, layer_norm=True))
    assert body(spec)["gamma"] == 0.5 and body(spec)["layer_norm"] is True
    assert body("pos")["task"] == "pos" and "mix" not in body("pos")


@pytest.mark.parametrize(
    "mix, says",
    [
        ({"weight": [1.0]}, "no key 'weight'"),
        ({"gamma": 2.0}, "needs 'weights'"),
        ({"weights": [1.0], "layer_norm": "yes"}, "layer_norm must be true or false"),
        ({"weights": [1.0], "gamma": "big"}, "gamma must be a number"),
        ([], "non-empty list"),
        (["a", 1.0], "weights[0] must be a number"),
        ([1.0, float("inf")], "weights[1] must be finite"),
        (3, "not int"),
        (object(), "not object"),
    ],
)
def test_a_bad_mix_is_a_value_error_naming_mix_before_any_request(mix, says):
    # nothing listens on port 9: a request would be ServiceUnreachable, not this
    with Client("http://127.0.0.1:9", retries=0) as c, pytest.raises(ValueError) as e:
        c.embed(["the river bank"], mix=mix)
    assert isinstance(e.value, InputError) and e.value.field == "mix"
    assert says in e.value.message


def test_a_task_is_stored_from_a_list_a_dict_or_a_mixspec():
    from elmo_client.ops import Tasks
    from elmo_service.scalar_mix import MixSpec

    sent = []

    def run(op):
        sent.append(next(op))

    tasks = Tasks(run)
    tasks.put("a", [0.1, 0.5, 0.4])
    tasks.put("b", {"weights": [0.1, 0.5, 0.4], "gamma": 0.8, "meta": {"by": "me"}})
    tasks.put("c", MixSpec([0.1, 0.5, 0.4], gamma=0.8))
    a, b, c = (call.json for call in sent)
    assert a == {"weights": [0.1, 0.5, 0.4], "gamma": 1.0, "per_direction": False,
                 "layer_norm": False}  # fmt: skip
    assert b == {**a, "gamma": 0.8, "meta": {"by": "me"}} and c == {**a, "gamma": 0.8}
    assert [call.path for call in sent] == ["/v1/tasks/a", "/v1/tasks/b", "/v1/tasks/c"]
    with pytest.raises(InputError) as e:
        tasks.put("d", {"weights": "0.1"})
    assert e.value.field == "spec"


def test_the_docs_name_every_package_the_client_installs():
    """README.md, docs/client.md, docs/architecture.md and the client's README say what
    ``pip install ./clients/python`` brings (#57: orjson was missing)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    project = (root / "clients" / "python" / "pyproject.toml").read_text()
    listed = re.search(r"^dependencies = \[(.*?)^\]", project, flags=re.M | re.S).group(1)
    deps = {re.split(r"[<>=!~ \[]", d)[0] for d in re.findall(r'^\s*"([^"]+)"', listed, re.M)}
    assert deps == {"httpx", "numpy", "orjson"}
    for page in ("README.md", "docs/client.md", "docs/architecture.md", "clients/python/README.md"):
        text = (root / page).read_text(encoding="utf-8")
        said = [
            line for line in text.splitlines() if "clients/python" in line or "elmo_client" in line
        ]
        said = " ".join(said + [s for s in text.split("\n\n") if "no torch" in s])
        assert all(d in said for d in deps), (page, sorted(d for d in deps if d not in said))
