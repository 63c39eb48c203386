"""#50 item 1: the client finishes a call during a rollout and over a split fleet, every
sentence from one model version it names.

Real processes: three ``elmo-service serve`` replicas on one real redis-server, behind the
real haproxy running the shipped ``docker/haproxy/haproxy.cfg`` (rendered for loopback as
tests/deploy/test_haproxy.py does). The third replica's disk lacks the new models: on an
activation it keeps its old model and stays ready (documented), so a third of the
balancer's answers keep coming from the old version. The client asks again the chunks
answered by any version other than the fleet's desired one, until its retry deadline.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time

import httpx
import pytest

from elmo_client import Client, ServiceError
from elmo_service.artifact import read_manifest, save_artifact
from elmo_service.embedder import Embedder
from elmo_service.tokenizers import WordTokenizer
from tests.deploy.test_haproxy import HAPROXY_CFG, render
from tests.support.core_fixtures import generated_text, tiny_model
from tests.support.determinism import same_vectors
from tests.support.ports import free_port
from tests.support.procs import terminate
from tests.support.redis_server import RedisServer
from tests.support.replicas import Replica

pytestmark = [pytest.mark.slow, pytest.mark.redis]

ADMIN = {"authorization": "Bearer admin"}


def _until(cond, timeout: float = 60.0, what: str = "") -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout}s: {what}")


def _served(r: Replica) -> str | None:
    try:
        return httpx.get(r.url + "/readyz", timeout=5).json()["model"]["version"]
    except (httpx.HTTPError, KeyError, ValueError):
        return None


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rollout")
    redis = RedisServer(tmp / "redis").start()  # its own: the fleet's keys are this test's
    shared = tmp / "models"
    for name, seed in {"alpha": 0, "beta": 1, "gamma": 2}.items():
        save_artifact(tiny_model(seed), WordTokenizer(), shared / name)
    own = tmp / "models3"  # the third replica has only alpha: it cannot follow
    shutil.copytree(shared / "alpha", own / "alpha")
    reps = []
    for i, models in enumerate([shared, shared, own], 1):
        env = {"REDIS_URL": redis.url, "ELMO_MODELS_DIR": str(models), "ELMO_MODEL": "alpha",
               "ELMO_ADMIN_KEYS": "admin", "ELMO_DATA_DIR": str(tmp / f"data{i}"),
               "ELMO_RUNS_DIR": str(tmp / f"runs{i}"), "ELMO_FLEET_INTERVAL": "0.5",
               "ELMO_FLEET_TTL": "3"}  # fmt: skip
        reps.append(Replica(env, tmp, f"r{i}").start())
    lb_port = free_port()
    cfg = tmp / "haproxy.cfg"
    names = [f"api{i}" for i in range(1, len(reps) + 1)]
    cfg.write_text(render(HAPROXY_CFG.read_text(), lb_port,
                          {n: r.port for n, r in zip(names, reps, strict=True)}))  # fmt: skip
    haproxy = shutil.which("haproxy")
    assert haproxy, "haproxy is needed (apt-get install haproxy)"
    with open(tmp / "haproxy.log", "ab") as log:
        lb = subprocess.Popen([haproxy, "-W", "-db", "-f", str(cfg)], stdout=log,
                              stderr=subprocess.STDOUT)  # fmt: skip
    try:
        for r in reps:
            r.wait_ready(120)
        url = f"http://127.0.0.1:{lb_port}"
        # every replica in rotation (its health checks, rise 2 s apart, passed): each has
        # answered through the balancer
        seen: set[str] = set()
        _until(lambda: _answered_by(url, seen) >= set(names), what=f"haproxy sends to {names}")
        versions = {n: read_manifest(shared / n)["version"] for n in ("alpha", "beta", "gamma")}
        libs = {n: Embedder.load(shared / n, threads=1) for n in versions}
        yield url, reps, versions, libs
    finally:
        terminate(lb)
        for r in reps:
            r.stop()
        redis.stop()


def _answered_by(url: str, seen: set[str]) -> set[str]:
    """``seen`` plus the replica that answers one /readyz through the balancer."""
    try:
        r = httpx.get(url + "/readyz", timeout=5)
    except httpx.HTTPError:
        return seen
    if r.status_code == 200:
        seen.add(r.headers.get("x-elmo-replica", ""))
    return seen


def _activate(reps: list[Replica], name: str, version: str) -> None:
    r = httpx.post(reps[0].url + f"/v1/models/{name}/activate", headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    _until(lambda: all(_served(x) == version for x in reps[:2]), what=f"r1, r2 serve {name}")


def _sentences(n: int, seed: int) -> list[str]:
    lines = [ln for ln in generated_text(n_lines=n + 20, seed=seed).splitlines() if ln.strip()]
    return lines[:n]


def _all_from(got, lib, sentences) -> None:
    want = lib.embed(sentences)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.tokens == w.tokens and same_vectors(g.layers, w.layers), i


def test_a_split_fleet_answers_every_sentence_from_the_desired_version(fleet):
    url, reps, versions, libs = fleet
    _activate(reps, "beta", versions["beta"])
    assert _served(reps[2]) == versions["alpha"]  # the split: r3 keeps alpha, stays ready
    sentences = _sentences(200, seed=1)
    with Client(url, batch_size=8, retry_deadline=120) as c:
        sent = 0
        for _ in range(3):
            got = c.embed(sentences)
            assert got.model_version == versions["beta"]
            _all_from(got, libs["beta"], sentences)
            sent += got.requests
        assert sent > 3 * (200 // 8)  # chunks were asked again: the old replica answered
        # pinned to the old model (which one replica still serves): every chunk from it
        old = c.embed(sentences[:40], model_version=versions["alpha"])
        assert old.model_version == versions["alpha"]
        _all_from(old, libs["alpha"], sentences[:40])


class _PausedClient(Client):
    """The client as shipped, over an httpx client that holds the call after its `after`-th
    answer until `go` is set: the rollout then lands inside the call by an event, whatever the
    machine's speed (no call made long enough to outlast a guess)."""

    def __init__(self, *a, after: int, **kw) -> None:
        self.after, self.answers = after, 0
        self.paused, self.go = threading.Event(), threading.Event()
        super().__init__(*a, **kw)

    def _make_http(self, **kw):
        http = super()._make_http(**kw)
        http.event_hooks = {"response": [self._answered]}
        return http

    def _answered(self, response: httpx.Response) -> None:
        if response.request.url.path != "/v1/embed":
            return
        self.answers += 1
        if self.answers == self.after:
            self.paused.set()
            assert self.go.wait(120), "the rollout never came"


def test_a_rollout_during_a_call_ends_on_one_version(fleet):
    url, reps, versions, libs = fleet
    _activate(reps, "beta", versions["beta"])
    sentences = _sentences(400, seed=2)
    out: dict = {}
    # one request at a time; held after its 10th answer (of 100 at least) until the rollout
    c = _PausedClient(url, batch_size=4, max_in_flight=1, retry_deadline=120, after=10)

    def call() -> None:
        with c:
            try:
                out["got"] = c.embed(sentences)
            except BaseException as e:  # noqa: BLE001 - reported below
                out["error"] = e

    t = threading.Thread(target=call)
    t.start()
    assert c.paused.wait(120), "the call never got under way"
    try:
        r = httpx.post(reps[1].url + "/v1/models/gamma/activate", headers=ADMIN, timeout=60)
        assert r.status_code == 200, r.text
        assert t.is_alive(), "the call ended before the rollout: the test proves nothing"
    finally:
        c.go.set()
    t.join(300)
    assert "error" not in out, out.get("error")
    got = out["got"]
    assert got.model_version == versions["gamma"]
    _all_from(got, libs["gamma"], sentences)


def test_a_call_that_cannot_agree_says_what_it_saw(fleet):
    url, reps, versions, _ = fleet
    nobody = "0" * 16
    with Client(url, batch_size=8, retry_deadline=2) as c, pytest.raises(ServiceError) as e:
        c.embed(_sentences(40, seed=3), model_version=nobody)
    msg = str(e.value)
    assert e.value.code == "model_changed" and e.value.url == url + "/v1/embed"
    assert f"wanted {nobody} (pinned by model_version)" in msg
    assert "answered" in msg and "chunks" in msg and "rounds" in msg
    served = {versions[n] for n in versions}
    assert any(v in msg for v in served)
