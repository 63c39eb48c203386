"""The fleet agent in one process on a real redis-server (quick; the multi-process test is
tests/api/test_fleet.py): what activation records, the heartbeat, a desired model this
replica lacks, and leaving the fleet on shutdown."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import threading
import time

import pytest
import torch
from fastapi.testclient import TestClient

from elmo_api.fleet import Desired, FleetStore
from elmo_api.main import create_app
from elmo_api.settings import load_settings
from elmo_service.artifact import read_manifest, save_artifact
from elmo_service.tokenizers import WordTokenizer
from elmo_storage import StoreUnavailable
from tests.support.core_fixtures import tiny_model

torch.set_num_threads(1)
ADMIN = {"authorization": "Bearer admin"}


def _until_state(c: TestClient, text: str, timeout: float = 10.0) -> dict:
    """This replica's fleet entry once its state or error mentions ``text``."""
    deadline = time.monotonic() + timeout
    while True:
        (me,) = c.get("/v1/models").json()["fleet"]["replicas"]
        if text in f"{me['state']} {me['error']}" or time.monotonic() > deadline:
            return me
        time.sleep(0.05)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    for seed, name in enumerate(("alpha", "beta")):
        save_artifact(tiny_model(seed), WordTokenizer(), root / name)
    return root


def test_activation_records_the_desired_model_and_the_replica_heartbeats(
    models, redis_server, tmp_path
):
    redis_server.flushall()
    settings = load_settings(
        models_dir=models, model="alpha", threads=1, data_dir=tmp_path, admin_keys="admin",
        redis_url=redis_server.url, replica_id="solo", fleet_interval=0.2, fleet_ttl=2,
    )  # fmt: skip
    store = FleetStore(redis_server.url)
    rc = redis_server.client()
    with TestClient(create_app(settings)) as c:
        r = c.post("/v1/models/beta/activate", headers=ADMIN)
        assert r.status_code == 200, r.text
        fleet = r.json()["fleet"]
        assert fleet["recorded"]["generation"] == 1 and fleet["converged"] == 1
        desired = json.loads(rc.get("elmo:fleet:desired"))
        assert (desired["name"], desired["by"]) == ("beta", "solo")
        assert desired["version"] == r.json()["activated"]["version"]
        assert 0 < rc.pttl("elmo:fleet:replica:solo") <= 2000  # the heartbeat expires

        # a stray entry in the index (another program, an older version) is left out, no 500
        rc.zadd("elmo:fleet:replicas", {"stray": time.time() + 60, "junk": time.time() + 60})
        rc.set("elmo:fleet:replica:stray", json.dumps({"id": "stray", "pid": "x"}), ex=60)
        rc.set("elmo:fleet:replica:junk", b"\xff not json", ex=60)
        r = c.get("/v1/models")
        assert r.status_code == 200 and r.json()["fleet"]["replicas_total"] == 1

        # a record this replica cannot serve: it keeps beta, stays ready, says why
        store.record("gamma", "0" * 16, "elsewhere")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            (me,) = c.get("/v1/models").json()["fleet"]["replicas"]
            if me["state"] == "failed":
                break
            time.sleep(0.05)
        assert me["state"] == "failed" and "no model 'gamma'" in me["error"]
        assert me["served"]["id"] == "beta" and c.get("/readyz").status_code == 200
        fleet = c.get("/v1/models").json()["fleet"]
        assert fleet["desired"]["generation"] == 2 and fleet["converged"] == 0
        assert not fleet["agree"]
        assert c.post("/v1/embed", json={"sentences": ["a b"]}).status_code == 200

        # a folder of that name holding another version: refused, named
        store.record("alpha", "f" * 16, "elsewhere")
        me = _until_state(c, "holds version")
        assert f"the fleet serves {'f' * 16}" in me["error"] and me["served"]["id"] == "beta"

        # a broken copy (truncated weights) is refused; once repaired it is served
        delta = models / "delta"
        shutil.copytree(models / "alpha", delta)
        weights = delta / "weights.safetensors"
        good = weights.read_bytes()
        weights.write_bytes(good[:100])
        store.record("delta", read_manifest(delta)["version"], "elsewhere")
        me = _until_state(c, "weights.safetensors")
        assert me["state"] == "failed" and me["served"]["id"] == "beta"
        weights.write_bytes(good)  # repaired (another mtime): retried
        me = _until_state(c, "serving")
        assert me["served"] == {"id": "delta", "version": read_manifest(delta)["version"]}
        shutil.rmtree(delta)

        # a record written without its notice (a missed pub/sub message): polling finds it
        gen = rc.incr("elmo:fleet:generation")
        alpha = read_manifest(models / "alpha")["version"]
        record = {"name": "alpha", "version": alpha, "generation": gen, "at": 0, "by": "x"}
        rc.set("elmo:fleet:desired", json.dumps(record))
        deadline = time.monotonic() + 10
        while c.get("/readyz").json()["model"]["id"] != "alpha" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.get("/readyz").json()["model"] == {"id": "alpha", "version": alpha}
    assert rc.get("elmo:fleet:replica:solo") is None  # left on shutdown
    assert store.replicas() == []
    store.close()
    rc.close()


class _NonsenseRedis:
    """A real socket speaking RESP that answers ``+OK`` to every command (a misbehaving
    proxy or Redis-compatible server)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.sock.getsockname()[1]}/0"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    @staticmethod
    def _answer(conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                # one +OK per command in the buffer (each starts with a RESP array header)
                conn.sendall(b"+OK\r\n" * max(1, data.count(b"\r\n*") + data.startswith(b"*")))

    def close(self) -> None:
        self.sock.close()


def test_a_redis_answering_nonsense_is_a_fleet_failure_never_a_crash():
    fake = _NonsenseRedis()
    store = FleetStore(fake.url)
    try:
        for call in (
            store.desired,
            lambda: store.record("beta", "0" * 16, "me"),
            store.replicas,
            lambda: store.restore(Desired("beta", "0" * 16, 3, 0.0, "me")),
        ):  # never a made-up record, never another exception
            with pytest.raises(StoreUnavailable):
                call()
        with contextlib.suppress(StoreUnavailable):
            store.heartbeat("me", {"id": "me"}, 5.0)
    finally:
        store.close()
        fake.close()
