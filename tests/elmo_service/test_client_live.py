"""``elmo_client.Client`` and ``AsyncClient`` against real ``elmo-service serve`` processes.

The model: tiny, with a sentencepiece tokenizer (words cut into pieces, so word
granularity averages something) and three tasks (plain, layer-normalised, per
direction). Every answer is compared with ``Embedder.embed`` on the same artifact, within
the project's one bound (1e-5 x max(1, |value|), tests/support/determinism.py): the server
batches sentences differently from the library, so equal to the bit is not promised.
"""

from __future__ import annotations

import asyncio
import re
from itertools import product
from pathlib import Path

import httpx
import numpy as np
import pytest

from elmo_client import JobFailed, ServiceError, ServiceUnreachable
from elmo_service import AsyncClient, Client, Embedder
from elmo_service.artifact import write_task
from elmo_service.embedder import EmbeddedSentence
from elmo_service.errors import InputError
from elmo_service.scalar_mix import MixSpec
from tests.jobs.test_jobs import PREPARE, TINY_CONFIG, write_corpus
from tests.support.core_fixtures import generated_text, tiny_artifact, train_sentencepiece
from tests.support.determinism import REL
from tests.support.ports import free_port
from tests.support.replicas import Replica

pytestmark = pytest.mark.slow  # real server processes

TOL = REL  # of max(1, the library's largest |value|): largest_difference scales by it
TASKS = {
    "plain": MixSpec([0.5, 1.0, -0.5], gamma=0.7),
    "ln": MixSpec([0.3, 1.0, -0.5], gamma=1.7, layer_norm=True),
    "pd": MixSpec([0.1, 0.4, -0.2, 0.3, 0.0], gamma=1.2, per_direction=True),
}
INLINE = MixSpec([0.2, -0.3, 0.6, 0.1, 0.5], gamma=0.9, per_direction=True, layer_norm=True)
MIXES = {"none": None, "plain": "plain", "ln": "ln", "pd": "pd", "inline": INLINE}


def _sentences(n: int, seed: int = 0) -> list:
    lines = [ln for ln in generated_text(n_lines=n + 5, seed=seed).splitlines() if ln.strip()]
    out: list = lines[:n]
    out[1] = out[1].split()  # pre-tokenized words too
    out[2] = "Unusualness, reconsiderations: antidisestablishment!"  # many pieces per word
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("client")
    (root / "spm").mkdir()
    models = root / "models"
    tok = train_sentencepiece(root / "spm")
    a = tiny_artifact(models / "a", tokenizer=tok)
    tiny_artifact(models / "b", tokenizer=tok, seed=3)
    for name, spec in TASKS.items():
        write_task(a, name, spec)
    write_corpus(root / "data" / "corpora" / "book.txt")
    return root, a


def _serve(root: Path, name: str, **env: str) -> Replica:
    data = "data" if name == "main" else f"data-{name}"  # its own tasks and jobs
    base = {
        "ELMO_MODELS_DIR": str(root / "models"),
        "ELMO_MODEL": "a",
        "ELMO_DATA_DIR": str(root / data),
        "ELMO_RUNS_DIR": str(root / f"runs-{name}"),
        "ELMO_ADMIN_KEYS": "admin",
        "ELMO_JOBS_POLL_INTERVAL": "0.2",
    }
    rep = Replica({**base, **env}, root, name).start()
    try:
        rep.wait_ready(120)
    except BaseException:
        rep.stop()
        raise
    return rep


@pytest.fixture(scope="module")
def server(setup):
    root, _ = setup
    rep = _serve(root, "main")
    yield rep
    rep.stop()


@pytest.fixture(scope="module")
def lib(setup):
    return Embedder.load(setup[1], threads=1)


def _pool(x: np.ndarray | None, how: str, axis: int) -> np.ndarray | None:
    if x is None or how == "none":
        return x
    if x.shape[axis] == 0:  # an empty sentence pools to the zero vector (#51)
        return np.zeros(x.shape[:axis] + x.shape[axis + 1 :], np.float32)
    if how == "mean":
        return x.mean(axis=axis, dtype=np.float64).astype(np.float32)
    return x.max(axis=axis)


def expected(lib, sentences, mix, granularity, output, pooling) -> list[EmbeddedSentence]:
    """What the client must return, from the library: the mix the server applies when none
    is named (output mix/both) is the layer average (the model has no 'default' task)."""
    out = output or ("layers" if mix is None else "both")
    spec = mix
    if spec is None and out != "layers":
        spec = MixSpec.average(lib.n_layers)
    got = lib.embed(sentences, granularity=granularity, mix=spec)
    return [
        EmbeddedSentence(
            s.tokens,
            None if out == "mix" else _pool(s.layers, pooling, 1),
            None if out == "layers" else _pool(s.mix, pooling, 0),
        )
        for s in got
    ]


def largest_difference(got, want) -> float:
    """The largest |got - want| over every array, each scaled by max(1, |want|'s largest)."""
    assert len(got) == len(want)
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert isinstance(g, EmbeddedSentence)
        assert g.tokens == w.tokens, f"sentence {i}: tokens differ"
        for what in ("layers", "mix"):
            a, b = getattr(g, what), getattr(w, what)
            assert (a is None) == (b is None), f"sentence {i}: {what} {a is None} vs {b is None}"
            if a is not None:
                assert a.dtype == np.float32 and a.shape == b.shape, (i, what, a.shape, b.shape)
                assert np.isfinite(a).all() and np.isfinite(b).all(), (i, what)  # max() skips NaN
                scale = max(1.0, float(np.abs(b).max(initial=0.0)))
                worst = max(worst, float(np.abs(a - b).max(initial=0.0)) / scale)
    return worst


COMBOS = [
    (out, gran, pool, mix)
    for out, gran, pool, mix in product(
        (None, "layers", "mix", "both"), ("token", "word"), ("none", "mean", "max"), MIXES
    )
    if not (out == "layers" and mix != "none")  # a mix with output 'layers' is refused (below)
]


@pytest.mark.parametrize(("output", "granularity", "pooling", "mix"), COMBOS)
def test_every_combination_equals_the_library(server, lib, output, granularity, pooling, mix):
    sentences = _sentences(12)
    with Client(server.url, batch_size=5) as c:  # three requests, sent together
        got = c.embed(
            sentences, mix=MIXES[mix], granularity=granularity, output=output, pooling=pooling
        )
    assert got.model_version == lib.version
    want = expected(lib, sentences, MIXES[mix], granularity, output, pooling)
    assert largest_difference(got, want) <= TOL


def test_words_and_the_model_version_are_the_librarys(server, lib):
    sentences = _sentences(6)
    with Client(server.url) as c:
        got = c.embed(sentences)
    want = lib.embed(sentences)
    assert got.model == {"id": "a", "version": lib.version}
    for g, w in zip(got, want, strict=True):
        gw, gv = g.words()
        ww, wv = w.words()
        scale = max(1.0, float(np.abs(wv).max()))
        assert gw == ww and np.abs(gv - wv).max() <= TOL * scale
    assert Client(server.url).embed([]) == []


@pytest.mark.parametrize("pooling", ["none", "mean"])
def test_empty_sentences_get_the_librarys_empty_answer(server, lib, pooling):
    """#51: one blank line never fails a call: its answer is empty (zero tokens), pooled
    the zero vector, as the library answers it; an empty list is [] without a request."""
    sentences = ["the river bank", "", "   ", "a b"]
    with Client(server.url, batch_size=2) as c:
        got = c.embed(sentences, mix="plain", pooling=pooling)
        assert c.embed([]) == [] and c.embed([]).requests == 0
        only_empty = c.embed(["", " "])
    want = expected(lib, sentences, "plain", "token", None, pooling)
    assert largest_difference(got, want) <= TOL
    assert got[1].tokens == [] and got[1].layers.shape[0] == lib.n_layers
    assert got.model_version == lib.version
    assert only_empty.requests == 0 and only_empty.model_version == lib.version
    assert only_empty[0].layers.shape == (lib.n_layers, 0, lib.dim)


def test_a_mix_with_output_layers_and_bad_requests_name_the_field(server, lib):
    long = " ".join(["word"] * (lib.max_sentence_tokens + 5))
    sentences = _sentences(20)
    sentences[13] = long
    with Client(server.url, batch_size=3) as c:
        with pytest.raises(ServiceError) as e:
            c.embed(sentences)  # the 5th request holds it, as its 2nd sentence
        assert e.value.status == 413 and e.value.code == "limit_exceeded"
        assert isinstance(e.value, InputError)  # what the library raises for it, too
        assert e.value.field == "sentences[13]" and "sentence 13 " in e.value.message
        with pytest.raises(ServiceError) as e:
            c.embed(["a b"], mix="plain", output="layers")
        assert e.value.status == 422 and e.value.field == "task"
        with pytest.raises(ServiceError) as e:
            c.embed(["a b"], mix=MixSpec([1.0, 2.0]))  # 2 weights for 3 layers
        assert e.value.status == 422 and e.value.field == "mix"
        with pytest.raises(ServiceError) as e:
            c.embed(["a b"], mix="nope")
        assert e.value.code == "unknown_task" and e.value.field == "task"
        assert e.value.url == f"{server.url}/v1/embed" and "nope" in str(e.value)
        with pytest.raises(ServiceError) as e:
            c.embed(["a b"], granularity="letters")
        assert e.value.status == 422 and e.value.field == "granularity"
        with pytest.raises(ServiceError) as e:
            c.tasks.put("x", {"weights": [1.0]})  # no admin key
        assert e.value.status == 401


def test_an_unreachable_server_is_named():
    url = f"http://127.0.0.1:{free_port()}"
    # a refused connection is retried (to the retry deadline: kept short here)
    with (
        Client(url, timeout=5, retry_deadline=1) as c,
        pytest.raises(ServiceUnreachable, match=re.escape(url)),
    ):
        c.embed(["a"])

    async def run():
        async with AsyncClient(url, timeout=5, retry_deadline=1) as ac:
            await ac.tasks.list()

    with pytest.raises(ServiceUnreachable, match=re.escape(url + "/v1/tasks")):
        asyncio.run(run())


def test_a_flooded_tiny_queue_ends_with_every_sentence_embedded(setup, lib):
    """16 requests in flight against a queue of 6 sentences: the server refuses most with
    429 + Retry-After; the client retries them until every sentence is embedded. Answers
    too large for the server's bound (413) are split and sent again."""
    root, _ = setup
    rep = _serve(
        root, "tiny", ELMO_MAX_QUEUE="6", ELMO_MAX_SENTENCES="6", ELMO_MAX_RESPONSE_FLOATS="3000"
    )
    try:
        sentences = _sentences(150, seed=4)
        with Client(rep.url, max_in_flight=16, retry_deadline=300) as c:
            assert c.limits().max_sentences == 6
            got = c.embed(sentences)
            want = expected(lib, sentences, None, "token", None, "none")
            assert largest_difference(got, want) <= TOL
            # words of many pieces: more positions than estimated, so answers too large
            # for the bound come back 413 and are split until they fit
            pieces = ["antidisestablishmentarianism supercalifragilistic"] * 6
            got = c.embed(pieces)
        assert largest_difference(got, expected(lib, pieces, None, "token", None, "none")) <= TOL
        metrics = httpx.get(rep.url + "/metrics").text
        statuses = _embed_statuses(metrics)
        assert statuses.get("429", 0) > 0, statuses  # the queue did overflow
        assert statuses.get("413", 0) > 0, statuses  # and some answers had to be split
        # a server without priority lanes refuses the field once (the client then drops it)
        assert statuses.pop("422", 0) <= 1, statuses
        assert set(statuses) <= {"200", "413", "429"}, statuses
    finally:
        rep.stop()


def _embed_statuses(metrics: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in metrics.splitlines():
        if line.startswith("elmo_requests_total{") and 'route="/v1/embed"' in line:
            status = re.search(r'status="(\d+)"', line).group(1)
            out[status] = out.get(status, 0) + int(float(line.rsplit(" ", 1)[1]))
    return out


def test_the_async_client_gives_the_same_answers(server, lib):
    sentences = _sentences(12, seed=2)

    async def run():
        async with AsyncClient(server.url, "admin", batch_size=4) as ac:
            a = await ac.embed(sentences, mix="ln", output="both")
            b = await ac.embed(sentences, granularity="word", pooling="mean", mix=INLINE)
            tasks = await ac.tasks.list()
            fleet = await ac.models.fleet()
            limits = await ac.limits()
            return a, b, tasks, fleet, limits

    a, b, tasks, fleet, limits = asyncio.run(run())
    with Client(server.url, batch_size=4) as c:
        sa = c.embed(sentences, mix="ln", output="both")
        sb = c.embed(sentences, granularity="word", pooling="mean", mix=INLINE)
        assert tasks == c.tasks.list() and limits == c.limits()
    assert largest_difference(a, sa) == 0.0 and largest_difference(b, sb) == 0.0
    assert a.model_version == sa.model_version == lib.version
    assert largest_difference(a, expected(lib, sentences, "ln", "token", "both", "none")) <= TOL
    assert fleet["agree"] and fleet["replicas"][0]["served"]["version"] == lib.version


def test_tasks_and_models_through_the_client(setup, lib):
    root, _ = setup
    rep = _serve(root, "admin")
    try:
        with Client(rep.url, "admin") as c:
            assert {"plain", "ln", "pd"} <= {t["name"] for t in c.tasks.list()}
            stored = c.tasks.put("mine", MixSpec([0.0, 1.0, 2.0], gamma=0.5))
            assert stored["name"] == "mine" and stored["source"] == "store"
            assert c.tasks.get("mine")["weights"] == [0.0, 1.0, 2.0]
            got = c.embed(["the river bank"], mix="mine")
            want = lib.embed(["the river bank"], mix=MixSpec([0.0, 1.0, 2.0], gamma=0.5))
            assert largest_difference(got, want) <= TOL
            assert c.tasks.delete("mine")["deleted"] == "mine"
            with pytest.raises(ServiceError) as e:
                c.tasks.get("mine")
            assert e.value.status == 404

            listed = c.models.list()
            assert {"a", "b"} <= {a["id"] for a in listed["artifacts"]}
            assert c.models.get("a")["version"] == lib.version
            before = c.embed(["the river"])
            act = c.models.activate("b")
            assert act["changed"] and act["previous"]["id"] == "a"
            after = c.embed(["the river"])  # the version is on the result
            assert after.model["id"] == "b" and after.model_version != before.model_version
            assert c.models.fleet()["replicas"][0]["served"]["id"] == "b"
    finally:
        rep.stop()


def test_a_job_submitted_and_waited_on_through_the_client(server, capsys):
    body = {
        "name": "client-lm",
        "corpus": "corpora/book.txt",
        "config": TINY_CONFIG,
        "budget": {"steps": 40},
        "prepare": PREPARE,
    }
    with Client(server.url, "admin") as c:
        job = c.jobs.submit(body)
        assert job["state"] == "queued" and c.jobs.get(job)["id"] == job["id"]
        rec = c.jobs.wait(job, progress=True, poll=0.2, timeout=240)
        assert rec["state"] == "succeeded" and rec["artifact"]["name"] == "client-lm"
        assert rec["progress"]["step"] == 40
        assert job["id"] in {j["id"] for j in c.jobs.list(state="succeeded")}
        bar = capsys.readouterr().err
        assert f"job {job['id']}" in bar and "40/40" in bar and "loss=" in bar

        # a cancelled job: wait raises its record
        long = c.jobs.submit({**body, "name": "client-long", "budget": {"steps": 100_000}})
        cancelled = c.jobs.cancel(long)
        assert cancelled["state"] == "cancelled" or cancelled["cancel_requested"]
        with pytest.raises(JobFailed) as e:
            c.jobs.wait(long, progress=False, poll=0.2, timeout=120)
        assert e.value.record["state"] == "cancelled"
        assert c.jobs.retry(long)["state"] == "queued"
        c.jobs.cancel(long)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_a_document_through_the_client_equals_the_library(server, lib, chunk):
    """#48 on the client's surface, against the real route: the chunks' layers joined are the
    library's document, whatever the chunk size."""
    text = " ".join(s for s in _sentences(8) if isinstance(s, str))
    with Client(server.url) as c:
        got = list(c.embed_document(text, chunk_tokens=chunk, mix="plain"))
    want = list(lib.embed_document(text, chunk_tokens=64, mix=MIXES["plain"]))
    g = np.concatenate([x.layers for x in got], axis=1)
    w = np.concatenate([x.layers for x in want], axis=1)
    assert g.shape == w.shape
    assert np.abs(g - w).max() <= TOL * max(1.0, float(np.abs(w).max()))
    assert [t.start for x in got for t in x.tokens] == [t.start for x in want for t in x.tokens]


def test_priority_and_the_servers_timings_reach_the_results(server, lib):
    """#49 on the client's surface: both lanes answer the same vectors; every result carries
    the server's four timings (ms), each part within the total."""
    sentences = _sentences(10)
    with Client(server.url, batch_size=4) as c:
        fast = c.embed(sentences, priority="interactive")
        slow = c.embed(sentences, priority="batch")
    assert largest_difference(fast, list(slow)) <= TOL
    for res in (fast, slow):
        assert res.requests == 3 and len(res.chunk_timings) == 3
        for t in res.chunk_timings:
            assert set(t) == {"total", "tokenization", "queue", "inference"}, t
            assert all(np.isfinite(v) and v >= 0 for v in t.values()), t
            assert t["tokenization"] + t["queue"] + t["inference"] <= t["total"] * 1.05 + 1, t
