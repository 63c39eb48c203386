"""#50 item 2: the client never returns an answer that does not hold together.

A real server process (``elmo-service serve``) behind a real lying server process
(``tests/support/lying_server.py``) that mangles its answers each way the hostile run
found: a sentence dropped or added, the order reversed, data relabelled float64, a
transposed shape, NaN and inf, a header that contradicts the body, tokens one short, a body
cut short, a missing key. ``Client`` and ``AsyncClient`` must each raise one
``ServiceError`` naming the URL (never return misaligned sentences, never a bare
ValueError/KeyError); through the honest path the answer is the server's.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import numpy as np
import pytest

from elmo_client import AsyncClient, Client, ServiceError
from tests.support.core_fixtures import generated_text, tiny_artifact
from tests.support.ports import free_port
from tests.support.procs import terminate
from tests.support.replicas import REPO, Replica

pytestmark = pytest.mark.slow  # real server processes

MANGLED = ("drop", "extra", "reverse", "float64", "transpose", "nan", "inf", "header", "short",
           "json", "nokey")  # fmt: skip
# the check each mangling must fail (in the error's message)
SAYS = {
    "drop": "sentences answered for", "extra": "sentences answered for",
    "reverse": "out of order", "float64": "dtype 'float64'", "transpose": "has shape",
    "nan": "NaN", "inf": "infinity", "header": "X-Model-Version", "short": "has shape",
    "json": "JSONDecodeError", "nokey": "no model version",
}  # fmt: skip


@pytest.fixture(scope="module")
def liar(tmp_path_factory):
    root = tmp_path_factory.mktemp("liar")
    tiny_artifact(root / "models" / "a")
    rep = Replica(
        {"ELMO_MODELS_DIR": str(root / "models"), "ELMO_MODEL": "a",
         "ELMO_DATA_DIR": str(root / "data"), "ELMO_RUNS_DIR": str(root / "runs")},
        root, "upstream",
    ).start()  # fmt: skip
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.lying_server", "--upstream", rep.url,
         "--port", str(port)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        rep.wait_ready(120)
        assert proc.stdout.readline().strip() == b"ready"
        yield rep, f"http://127.0.0.1:{port}"
    finally:
        terminate(proc)
        rep.stop()


def _sentences() -> list:
    lines = [ln for ln in generated_text(n_lines=40, seed=7).splitlines() if ln.strip()][:30]
    lines[4] = lines[4].split()  # pre-tokenized too
    return lines


def test_through_the_honest_path_the_answer_is_the_servers(liar):
    rep, url = liar
    sentences = _sentences()
    with Client(url + "/honest", batch_size=10) as c, Client(rep.url, batch_size=10) as d:
        got, want = c.embed(sentences), d.embed(sentences)
    assert got.requests >= 3 and got.model_version == want.model_version
    for g, w in zip(got, want, strict=True):
        assert g.tokens == w.tokens and np.array_equal(g.layers, w.layers)


@pytest.mark.parametrize("mode", MANGLED)
def test_a_mangled_answer_is_one_service_error_naming_the_url(liar, mode):
    _, url = liar
    sentences = _sentences()
    with Client(url + f"/{mode}", batch_size=10, retries=0) as c, pytest.raises(ServiceError) as e:
        c.embed(sentences)
    _check(e.value, url, mode)

    async def run():
        async with AsyncClient(url + f"/{mode}", batch_size=10, retries=0) as ac:
            return await ac.embed(sentences)

    with pytest.raises(ServiceError) as e:
        asyncio.run(run())
    _check(e.value, url, mode)


def _check(e: ServiceError, url: str, mode: str) -> None:
    assert e.code == "bad_answer" and e.url == f"{url}/{mode}/v1/embed", (e.code, e.url)
    assert SAYS[mode] in str(e), str(e)
    assert not isinstance(e, ValueError | KeyError | TypeError)  # the client's own error


def test_the_lying_server_does_lie(liar):
    """Guards the test above against passing on answers that were never mangled."""
    rep, url = liar
    body = {"sentences": ["a b c", "d e"], "encoding": "base64"}
    honest = httpx.post(url + "/honest/v1/embed", json=body, timeout=60).json()
    dropped = httpx.post(url + "/drop/v1/embed", json=body, timeout=60).json()
    assert len(honest["data"]) == 2 and len(dropped["data"]) == 1
    r = httpx.post(url + "/header/v1/embed", json=body, timeout=60)
    assert r.headers["x-model-version"] != r.json()["model"]["version"]
