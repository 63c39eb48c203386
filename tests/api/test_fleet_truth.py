"""The fleet never rolls back and never claims what it cannot see, and its answers show
no server path: replicas in this process (their agents
are the real ones) on a real ``redis-server`` that is killed, restarted from an older
snapshot and SIGSTOPped, or on a fake Redis answering nonsense, or on none at all."""

from __future__ import annotations

import json
import logging
import threading
import time
from contextlib import ExitStack

import pytest
from fastapi.testclient import TestClient

from elmo_api.fleet_store import FleetStore
from elmo_api.main import create_app
from elmo_api.settings import load_settings
from elmo_service.artifact import read_manifest, save_artifact
from elmo_service.tokenizers import WordTokenizer
from tests.support.core_fixtures import tiny_model
from tests.support.fake_redis import FakeRedis, fake_redis  # noqa: F401 - a fixture
from tests.support.ports import free_port

ADMIN = {"authorization": "Bearer admin"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    for seed, name in enumerate(("alpha", "beta", "gamma")):
        save_artifact(tiny_model(seed), WordTokenizer(), root / name)
    return root


def _version(models, name: str) -> str:
    return read_manifest(models / name)["version"]


def _settings(models, tmp_path, url: str, rid: str, **kw):
    return load_settings(
        models_dir=models, model="alpha", threads=1, data_dir=tmp_path, admin_keys="admin",
        redis_url=url, replica_id=rid, fleet_interval=0.2, fleet_ttl=1.0, **kw,
    )  # fmt: skip


def _served(c: TestClient) -> str:
    return c.get("/readyz").json()["model"]["id"]


def _until(cond, timeout: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_redis_restarted_from_an_older_snapshot_never_rolls_the_fleet_back(
    models, redis_server_factory, tmp_path, caplog
):
    redis = redis_server_factory()
    rc = redis.client()
    with ExitStack() as stack:
        reps = [
            stack.enter_context(TestClient(create_app(_settings(models, tmp_path, redis.url, r))))
            for r in ("r1", "r2")
        ]
        assert reps[0].post("/v1/models/gamma/activate", headers=ADMIN).status_code == 200
        rc.save()  # the snapshot: gamma
        r = reps[0].post("/v1/models/beta/activate", headers=ADMIN)
        assert r.status_code == 200, r.text
        beta_gen = r.json()["fleet"]["recorded"]["generation"]
        _until(lambda: all(_served(c) == "beta" for c in reps), what="both on beta")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="elmo_api.fleet"):
            redis.kill()  # kill -9: the last SAVE holds gamma
            redis.start()
            rc = redis.client()
            seen = set()
            deadline = time.monotonic() + 3.0  # 15 polls: a rollback would show
            while time.monotonic() < deadline:
                seen |= {_served(c) for c in reps}
                time.sleep(0.05)
            desired = json.loads(rc.get("elmo:fleet:desired"))
        assert seen == {"beta"}, f"a replica went back: {seen}"
        assert (desired["name"], desired["generation"]) == ("beta", beta_gen)
        assert int(rc.get("elmo:fleet:generation")) >= beta_gen  # the counter too
        assert any("older than beta" in m and "put back" in m for m in caplog.messages)
        view = reps[1].get("/v1/models").json()["fleet"]
        assert view["desired"]["id"] == "beta" and view["agree"]
        # a later activation never reuses a generation
        r = reps[1].post("/v1/models/alpha/activate", headers=ADMIN)
        assert r.json()["fleet"]["recorded"]["generation"] > beta_gen
        _until(lambda: all(_served(c) == "alpha" for c in reps), what="both on alpha")
    rc.close()


def _activate_during_a_stall(c, redis, name: str, stop_after: float, stall: float) -> tuple:
    """POST activate; SIGSTOP redis ``stop_after`` s after the call, SIGCONT ``stall`` s later."""
    out: dict = {}
    t = threading.Thread(
        target=lambda: out.update(r=c.post(f"/v1/models/{name}/activate", headers=ADMIN))
    )
    t.start()
    time.sleep(stop_after)
    redis.pause()
    time.sleep(stall)
    redis.resume()
    t.join(60)
    return out["r"]


def _check_truth(c, rc, redis, name: str, stop_after: float) -> int:
    """One activation during a 2 s stall: its answer must be true, and a retry safe.
    -> the status code."""
    r = _activate_during_a_stall(c, redis, name, stop_after, 2.0)
    time.sleep(0.5)  # anything the stalled Redis had pending has run
    desired = json.loads(rc.get("elmo:fleet:desired") or '{"name": null, "generation": 0}')
    if r.status_code == 200:  # said recorded: it is, and served here
        assert r.json()["fleet"]["recorded"]["id"] == name == desired["name"]
        assert _served(c) == name
    else:  # never "not recorded" while it is
        assert r.status_code == 503, r.text
        assert r.json()["code"] == "fleet_outcome_unknown" or desired["name"] != name, r.text
    r2 = c.post(f"/v1/models/{name}/activate", headers=ADMIN)  # the retry
    assert r2.status_code == 200, r2.text
    again = json.loads(rc.get("elmo:fleet:desired"))
    assert again["name"] == name and _served(c) == name
    if desired["name"] == name:
        assert again["generation"] == desired["generation"], "a retry made a new generation"
    return r.status_code


@pytest.mark.slow
def _activate_with_its_record_stalled(c, redis, name: str):
    """POST activate with Redis stopped (SIGSTOP) just as the record goes out, and started
    again (SIGCONT) once the agent reads the record back: events, not sleeps, so however
    loaded the machine, the record stalls past its timeout and the read-back finds Redis."""
    store = c.app.state.fleet.store
    record, desired = store.record, store.desired
    failed = threading.Event()

    def stalled_record(*args):
        redis.pause()  # the record is sent on a live connection to a Redis that answers nothing
        try:
            return record(*args)
        except Exception:
            failed.set()
            raise

    def read_back():
        if failed.is_set():
            redis.resume()  # the stalled record lands first, then this read
        return desired()

    store.record, store.desired = stalled_record, read_back
    try:
        r = c.post(f"/v1/models/{name}/activate", headers=ADMIN)
    finally:
        store.record, store.desired = record, desired
        redis.resume()
    assert failed.is_set(), "the record did not stall: the read-back was not exercised"
    return r


def test_an_activation_whose_record_stalled_reads_it_back(models, redis_server_factory, tmp_path):
    """The agent's loops idle (a long interval): the record goes out on a live connection,
    stalls, lands when Redis resumes, and the read-back says so: 200, not 503."""
    redis = redis_server_factory()
    settings = _settings(models, tmp_path, redis.url, "solo")
    settings = settings.model_copy(update={"fleet_interval": 30.0, "fleet_ttl": 60.0})
    with TestClient(create_app(settings)) as c:
        rc = redis.client()
        for name in ("beta", "gamma"):
            r = _activate_with_its_record_stalled(c, redis, name)
            assert r.status_code == 200, r.text
            desired = json.loads(rc.get("elmo:fleet:desired"))
            assert r.json()["fleet"]["recorded"]["id"] == name == desired["name"]
            assert _served(c) == name
            r2 = c.post(f"/v1/models/{name}/activate", headers=ADMIN)  # the retry is safe
            assert r2.status_code == 200, r2.text
            again = json.loads(rc.get("elmo:fleet:desired"))
            assert (again["name"], again["generation"]) == (name, desired["generation"])
        rc.close()


@pytest.mark.slow
def test_an_activation_during_a_redis_stall_tells_what_happened(
    models, redis_server_factory, tmp_path
):
    """Busy agents (a 0.2 s interval): whatever the stall hits, the answer is true; a stall
    past the read-back window answers that the outcome is unknown, and how to check."""
    redis = redis_server_factory()
    with TestClient(create_app(_settings(models, tmp_path, redis.url, "solo"))) as c:
        rc = redis.client()
        for i, stop_after in enumerate((0.0, 0.05, 0.0, 0.05)):
            _check_truth(c, rc, redis, ("beta", "gamma")[i % 2], stop_after)
        r = _activate_during_a_stall(c, redis, "alpha", 0.0, 8.0)
        assert r.status_code == 503 and r.json()["code"] == "fleet_outcome_unknown", r.text
        assert "activating 'alpha' again is safe" in r.json()["message"]
        assert c.post("/v1/models/alpha/activate", headers=ADMIN).status_code == 200
        _until(lambda: _served(c) == "alpha", what="alpha after the retry")
        rc.close()


def _metric(c: TestClient, name: str) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


@pytest.mark.parametrize("redis_kind", ["nonsense", "unreachable"])
@pytest.mark.parametrize("stale_ready", ["ready", "unready"])
def test_a_replica_that_cannot_read_the_fleet_state_never_claims_agreement(
    models,
    tmp_path,
    fake_redis,  # noqa: F811 - the fixture
    redis_kind,
    stale_ready,
):
    url = (
        fake_redis("types").url
        if redis_kind == "nonsense"
        else f"redis://127.0.0.1:{free_port()}/0"
    )
    settings = _settings(models, tmp_path, url, "lost", fleet_stale_ready=stale_ready)
    with TestClient(create_app(settings)) as c:
        view = c.get("/v1/models").json()["fleet"]
        assert view["error"] and not view["agree"]  # it could not read the desired record
        _until(lambda: c.get("/v1/models").json()["fleet"]["stale"], what="stale")
        view = c.get("/v1/models").json()["fleet"]
        assert not view["agree"] and view["state_age"] > 1.0
        assert _metric(c, "elmo_fleet_stale") == 1.0
        assert _metric(c, "elmo_fleet_state_age_seconds") > 1.0
        # it never read the fleet's state since it started: it cannot tell the fleet's
        # model, so whatever ELMO_FLEET_STALE_READY says it is out of rotation (#50 item 8);
        # what is sent to it directly is answered, naming its model
        r = c.get("/readyz")
        assert r.json()["fleet"]["stale"] is True
        assert r.status_code == 503 and r.json()["code"] == "fleet_unjoined", r.text
        e = c.post("/v1/embed", json={"sentences": ["a b"]})
        assert e.status_code == 200 and e.headers["x-model-version"], e.text


@pytest.mark.parametrize("stale_ready", ["ready", "unready"])
def test_a_replica_that_joined_then_lost_redis_follows_the_stale_policy(
    models, redis_server_factory, tmp_path, stale_ready
):
    """Once it has read the fleet's state it serves the model it converged on through an
    outage (a Redis outage must not empty the balancer), ready or not per the policy."""
    redis = redis_server_factory()
    settings = _settings(models, tmp_path, redis.url, "was-in", fleet_stale_ready=stale_ready)
    with TestClient(create_app(settings)) as c:
        # joined and fresh: on a loaded machine the first poll can come after the 1 s TTL
        _until(lambda: c.get("/readyz").status_code == 200, what="ready")
        redis.stop()
        _until(lambda: c.get("/v1/models").json()["fleet"]["stale"], what="stale")
        r = c.get("/readyz")
        assert r.json()["fleet"]["stale"] is True
        assert r.status_code == (200 if stale_ready == "ready" else 503), r.text
        assert c.post("/v1/embed", json={"sentences": ["a b"]}).status_code == 200


def test_a_view_cannot_account_for_a_silent_replica_or_an_unreadable_heartbeat(
    models, redis_server_factory, tmp_path
):
    redis = redis_server_factory()
    store = FleetStore(redis.url)
    with TestClient(create_app(_settings(models, tmp_path, redis.url, "here"))) as c:
        _until(lambda: c.get("/v1/models").json()["fleet"]["agree"], what="agree alone")
        assert _metric(c, "elmo_fleet_stale") == 0.0
        beat = c.get("/v1/models").json()["fleet"]["replicas"][0] | {"id": "ghost"}
        store.heartbeat("ghost", beat, ttl=0.3)  # beats once, then goes silent (no leave)
        time.sleep(0.6)
        view = c.get("/v1/models").json()["fleet"]
        assert view["missing"] == ["ghost"] and not view["agree"]
        store.leave("ghost")  # a replica that left is not missing
        _until(lambda: c.get("/v1/models").json()["fleet"]["agree"], what="agree again")
        rc = redis.client()
        rc.zadd("elmo:fleet:replicas", {"junk": time.time() + 60})
        rc.set("elmo:fleet:replica:junk", b"\xff not json", ex=60)
        view = c.get("/v1/models").json()["fleet"]
        assert view["unreadable"] == 1 and not view["agree"]
        rc.close()
    store.close()


def test_answers_name_artifacts_relative_to_the_models_folder(models, tmp_path):
    settings = load_settings(
        models_dir=models, model="alpha", threads=1, data_dir=tmp_path, admin_keys="admin"
    )
    with TestClient(create_app(settings)) as c:
        listing = c.get("/v1/models")
        activated = c.post("/v1/models/beta/activate", headers=ADMIN)
        assert listing.status_code == activated.status_code == 200
        for r in (listing, activated, c.get("/v1/models/beta")):
            assert str(models) not in r.text and str(tmp_path) not in r.text, r.text[:500]
        assert activated.json()["activated"]["path"] == "beta"
        assert {a["path"] for a in listing.json()["artifacts"]} == {"alpha", "beta", "gamma"}
