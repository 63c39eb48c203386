"""The served model as the fleet's desired state: real ``elmo-service serve`` processes on
one real redis-server (#29 item 1). Activate through one replica, see all converge; a
restarted replica comes back on the activation; a replica that lacks the model keeps
serving, reports why, and converges once the artifact appears; Redis down -> 503,
nothing changes; racing activations end on the last recorded everywhere."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from elmo_api.encoding import decode_array
from elmo_service.artifact import read_manifest, save_artifact
from elmo_service.tokenizers import WordTokenizer
from tests.support.core_fixtures import tiny_model
from tests.support.replicas import Replica

pytestmark = [pytest.mark.slow, pytest.mark.redis]

ADMIN = {"authorization": "Bearer admin"}
SENTENCE = "the bank of the river"


def _models(root: Path, names: dict[str, int]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, seed in names.items():
        save_artifact(tiny_model(seed), WordTokenizer(), root / name)
    return root


def _replicas(redis_url: str, tmp: Path, dirs: list[Path]) -> list[Replica]:
    out = []
    for i, models in enumerate(dirs, 1):
        env = {
            "REDIS_URL": redis_url,
            "ELMO_MODELS_DIR": str(models),
            "ELMO_MODEL": "alpha",
            "ELMO_ADMIN_KEYS": "admin",
            "ELMO_DATA_DIR": str(tmp / f"data{i}"),
            "ELMO_RUNS_DIR": str(tmp / f"runs{i}"),
            "ELMO_FLEET_INTERVAL": "0.5",
            "ELMO_FLEET_TTL": "3",
            "ELMO_WARMUP": "true",
        }
        out.append(Replica(env, tmp, f"r{i}"))
    for r in out:
        r.start()
    for r in out:
        r.wait_ready()
    return out


def _fleet(r: Replica) -> dict:
    return httpx.get(r.url + "/v1/models", timeout=10).json()["fleet"]


def _served(r: Replica) -> dict:
    return httpx.get(r.url + "/readyz", timeout=10).json()["model"]


def _until(cond, timeout: float = 20.0, what: str = "") -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout}s: {what}")


def _embed(r: Replica) -> tuple[str, str, np.ndarray]:
    resp = httpx.post(
        r.url + "/v1/embed",
        json={"sentences": [SENTENCE], "encoding": "base64"},
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    header = resp.headers["x-model-version"]
    assert header == body["model"]["version"]  # the header and the body agree
    return body["model"]["id"], header, decode_array(body["data"][0]["layers"])


@pytest.fixture
def stop_all():
    started: list[Replica] = []
    yield started
    for r in started:
        r.stop()


def test_three_replicas_converge_on_an_activation_and_a_restart_comes_back_on_it(
    redis_server_factory, tmp_path, stop_all
):
    redis = redis_server_factory()
    models = _models(tmp_path / "models", {"alpha": 0, "beta": 1})
    beta = read_manifest(models / "beta")["version"]
    stop_all += _replicas(redis.url, tmp_path, [models] * 3)
    r1, r2, r3 = stop_all
    fleet = _fleet(r1)
    assert fleet["shared"] and fleet["desired"] is None and fleet["agree"]
    assert sorted(x["id"] for x in fleet["replicas"]) == ["r1", "r2", "r3"]
    assert {x["served"]["id"] for x in fleet["replicas"]} == {"alpha"}

    resp = httpx.post(r2.url + "/v1/models/beta/activate", headers=ADMIN, timeout=60)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["activated"]["version"] == beta and body["previous"]["id"] == "alpha"
    assert body["fleet"]["desired"]["id"] == "beta" and body["fleet"]["converged"] >= 1
    assert _served(r2) == {"id": "beta", "version": beta}  # swapped before it answered

    _until(lambda: all(_served(r)["version"] == beta for r in stop_all), what="3 converged")
    fleet = _fleet(r3)
    _until(lambda: _fleet(r3)["converged"] == 3, what="heartbeats show 3 converged")
    fleet = _fleet(r3)
    assert fleet["agree"] and fleet["replicas_total"] == 3
    assert all(x["state"] == "serving" for x in fleet["replicas"])
    vecs = [_embed(r) for r in stop_all]
    assert {(i, v) for i, v, _ in vecs} == {("beta", beta)}
    for _, _, a in vecs[1:]:  # every replica computes the same vectors
        assert np.abs(a - vecs[0][2]).max() <= 1e-5

    r3.stop()  # ELMO_MODEL is still alpha: the activation must win
    r3.start()
    assert r3.wait_ready()["model"] == {"id": "beta", "version": beta}
    _until(lambda: _fleet(r1)["converged"] == 3, what="the restarted replica rejoined")
    assert _fleet(r1)["replicas_total"] == 3  # it left on shutdown: no ghost entry


def test_a_replica_without_the_model_keeps_serving_and_converges_once_it_appears(
    redis_server_factory, tmp_path, stop_all
):
    redis = redis_server_factory()
    shared = _models(tmp_path / "models", {"alpha": 0, "beta": 1, "gamma": 2})
    own = tmp_path / "models2"  # the second replica's disk lacks gamma
    own.mkdir()
    for name in ("alpha", "beta"):
        shutil.copytree(shared / name, own / name)
    gamma = read_manifest(shared / "gamma")["version"]
    stop_all += _replicas(redis.url, tmp_path, [shared, own])  # two are enough here
    r1, r2 = stop_all

    resp = httpx.post(r1.url + "/v1/models/gamma/activate", headers=ADMIN, timeout=60)
    assert resp.status_code == 200 and _served(r1)["version"] == gamma

    def split() -> bool:
        f = _fleet(r1)
        return f["converged"] == 1 and any(x["state"] == "failed" for x in f["replicas"])

    _until(split, what="the fleet view shows the split")
    fleet = _fleet(r1)
    lacking = next(x for x in fleet["replicas"] if x["id"] == "r2")
    assert not fleet["agree"] and lacking["served"]["id"] == "alpha"
    assert "no model 'gamma'" in lacking["error"]
    assert httpx.get(r2.url + "/readyz").status_code == 200  # stays ready, serves alpha
    assert _embed(r2)[0] == "alpha"

    # the artifact appears (whole: copied aside, renamed in) -> r2 retries and converges
    shutil.copytree(shared / "gamma", own / ".gamma.tmp")
    (own / ".gamma.tmp").rename(own / "gamma")
    _until(lambda: _served(r2)["version"] == gamma, what="r2 converged once gamma appeared")
    _until(lambda: _fleet(r2)["agree"], what="the fleet agrees")

    # Redis down during an activation: 503 naming why, nothing changes, serving goes on
    redis.stop()
    resp = httpx.post(r1.url + "/v1/models/beta/activate", headers=ADMIN, timeout=60)
    assert resp.status_code == 503 and resp.json()["code"] == "fleet_unavailable"
    assert "nothing changed" in resp.json()["message"]
    assert _embed(r1)[:2] == ("gamma", gamma)
    assert httpx.get(r1.url + "/v1/models").json()["fleet"]["error"]  # no 5xx, says why
    redis.start()  # empty (no persistence): the replicas put back what they serve

    def restored() -> bool:
        d = _fleet(r2)["desired"]
        return d is not None and (d["id"], d["version"]) == ("gamma", gamma)

    _until(restored, what="the desired state restored after Redis came back empty")
    assert all(_served(r)["version"] == gamma for r in stop_all)

    # two activations racing through two replicas: the last recorded wins everywhere
    results: dict[str, httpx.Response] = {}

    def activate(r: Replica, name: str) -> None:
        results[name] = httpx.post(r.url + f"/v1/models/{name}/activate", headers=ADMIN, timeout=60)

    threads = [
        threading.Thread(target=activate, args=(r1, "alpha")),
        threading.Thread(target=activate, args=(r2, "beta")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.status_code == 200 for r in results.values()), results
    recorded = [r.json()["fleet"]["recorded"] for r in results.values()]
    assert len({d["generation"] for d in recorded}) == 2  # one order (INCR)
    won = max(recorded, key=lambda d: d["generation"])["version"]

    def all_on_winner() -> bool:
        f = _fleet(r1)
        return f["desired"]["version"] == won and all(
            _served(r)["version"] == won for r in stop_all
        )

    _until(all_on_winner, what="every replica on the last recorded activation")


def test_a_replica_restarted_against_a_redis_it_cannot_read_gets_no_traffic(
    redis_server_factory, tmp_path, stop_all
):
    """#50 item 8, behind the shipped HAProxy config: r3, restarted on ELMO_MODEL=alpha
    against a Redis it cannot reach, is invisible to r1 and r2 (its heartbeat cannot reach
    Redis either), whose views say ``agree: true, converged 2/2``. That is only true if r3
    gets none of the balancer's traffic: its /readyz is 503 ``fleet_unjoined`` (whatever
    ELMO_FLEET_STALE_READY says), so every answer through the balancer is beta. Once it can
    read the fleet's state it converges on beta like any restart."""
    import shutil
    import subprocess

    from tests.deploy.test_haproxy import HAPROXY_CFG, render
    from tests.support.ports import free_port

    redis = redis_server_factory()
    models = _models(tmp_path / "models", {"alpha": 0, "beta": 1})
    beta = read_manifest(models / "beta")["version"]
    alpha = read_manifest(models / "alpha")["version"]
    stop_all += _replicas(redis.url, tmp_path, [models] * 3)
    r1, r2, r3 = stop_all
    resp = httpx.post(r1.url + "/v1/models/beta/activate", headers=ADMIN, timeout=60)
    assert resp.status_code == 200, resp.text
    _until(lambda: _fleet(r1)["converged"] == 3, what="3 converged")

    lb_port = free_port()
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(render(HAPROXY_CFG.read_text(), lb_port, {r.name: r.port for r in stop_all}))
    haproxy = shutil.which("haproxy")
    assert haproxy, "haproxy is needed (apt-get install haproxy)"
    with open(tmp_path / "haproxy.log", "ab") as log:
        lb = subprocess.Popen([haproxy, "-W", "-db", "-f", str(cfg)], stdout=log, stderr=log)
    try:
        r3.stop()
        good_url = r3.env["REDIS_URL"]
        r3.env["REDIS_URL"] = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
        r3.start()

        def unjoined() -> bool:
            try:
                r = httpx.get(r3.url + "/readyz", timeout=5)
            except httpx.HTTPError:
                return False
            return r.status_code == 503 and r.json()["code"] == "fleet_unjoined"

        _until(unjoined, timeout=60, what="r3 up and unjoined")
        ready = httpx.get(r3.url + "/readyz", timeout=5).json()
        assert ready["status"] == "unjoined" and ready["fleet"]["error"]
        # asked directly it answers, naming the model it has; its own view claims nothing
        direct = httpx.post(r3.url + "/v1/embed", json={"sentences": [SENTENCE]}, timeout=30)
        assert direct.status_code == 200 and direct.headers["x-model-version"] == alpha
        own = _fleet(r3)
        assert not own["agree"] and own["error"]
        # haproxy starts with every server in rotation: its checks (503) took r3 out
        hlog = tmp_path / "haproxy.log"
        _until(lambda: "Server api/r3 is DOWN" in hlog.read_text(errors="replace"),
               what="haproxy took r3 out of the rotation")  # fmt: skip
        seen = set()
        with httpx.Client(base_url=f"http://127.0.0.1:{lb_port}", timeout=30) as c:
            for _ in range(60):
                r = c.post("/v1/embed", json={"sentences": [SENTENCE]})
                assert r.status_code == 200, r.text
                seen.add(r.headers["x-model-version"])
        assert seen == {beta}, seen  # none of the 60 from the old model
        for r in (r1, r2):  # the views of the fleet in rotation: true
            view = _fleet(r)
            assert view["agree"] and view["converged"] == view["replicas_total"] == 2, view

        r3.stop()  # Redis readable again: it joins, converges on beta, serves
        r3.env["REDIS_URL"] = good_url
        r3.start()
        assert r3.wait_ready()["model"] == {"id": "beta", "version": beta}
        assert _embed(r3)[1] == beta
    finally:
        lb.terminate()
        lb.wait(10)
