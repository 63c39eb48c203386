"""Every Redis client of the project honours a password (``storage.connect``): in the URL
(``redis://:PW@host:port/0``) or from ``ELMO_REDIS_PASSWORD``, against a real
``redis-server --requirepass``; a wrong or missing one fails closed: a store says so
(StoreUnavailable naming the password), ``serve`` and ``worker`` exit with one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import SecretStr

from elmo_api.cache import RedisCache
from elmo_api.fleet import FleetStore
from elmo_api.tasks_store import RedisTaskStore
from elmo_jobs.backend import RqBackend
from elmo_jobs.state import JobRecord, new_job_id
from elmo_storage import StoreUnavailable, check_auth
from tests.support.ports import free_port
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.redis
ROOT = Path(__file__).resolve().parents[2]
PW = "s3cret-pw"


@pytest.fixture(scope="module")
def locked(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis-auth"), password=PW).start()
    yield server
    server.stop()


def _stores(url: str, password, runs: Path):
    settings = SimpleNamespace(
        redis_url=url, redis_password=password, redis_prefix="pw", jobs_queue="pw-q",
        jobs_store_timeout=1.0, runs_dir=runs,
    )  # fmt: skip
    return (
        RedisCache(url, password=password, timeout=1.0),
        RedisTaskStore(url, "m", prefix="pw", password=password, timeout=1.0),
        FleetStore(url, "pw", timeout=1.0, password=password),
        RqBackend(settings),
    )


@pytest.mark.parametrize("how", ["url", "setting", "secret"])
def test_every_store_reads_and_writes_with_the_password(locked, how, tmp_path):
    url = locked.auth_url if how == "url" else locked.url
    password = {"url": None, "setting": PW, "secret": SecretStr(PW)}[how]
    cache, tasks, fleet, rq = _stores(url, password, tmp_path)
    try:
        cache.set_many([("pw:k", b"v")], ttl=60)
        assert cache.get_many(["pw:k"]) == [b"v"] and cache.state()["state"] == "ok"
        tasks.put("t", {"weights": [1.0]})
        assert tasks.get("t") == {"weights": [1.0]}
        rec = fleet.record("alpha", "v1", "me")
        assert fleet.desired() == rec
        client, ps = fleet.pubsub()  # the listener's own connection
        try:
            assert ps.get_message(timeout=1.0) is None  # subscribed, nothing published
        finally:
            ps.close()
            client.close()
        job = JobRecord(id=new_job_id(), name="m", backend="rq", spec={}, train_config={},
                        run_dir=str(tmp_path / "run"))  # fmt: skip
        rq.store.create(job)
        assert rq.store.get(job.id).id == job.id
        rq.queue.enqueue("os.getcwd")  # rq's own client carries it too
        assert rq.queue.count >= 1
    finally:
        for s in (cache, tasks, fleet, rq):
            s.close()


@pytest.mark.parametrize("password", [None, "wrong"])
def test_a_wrong_or_missing_password_fails_every_store_closed(locked, password, tmp_path):
    cache, tasks, fleet, rq = _stores(locked.url, password, tmp_path)
    try:
        assert cache.get_many(["pw:k"]) == [None]  # the cache serves uncached, never raises
        assert cache.state()["state"] == "down" and "Authentication" in cache.state()["last_error"]
        for call in (lambda: tasks.get("t"), fleet.desired, lambda: rq.store.get("j" + "0" * 12)):
            with pytest.raises(StoreUnavailable, match="refused the password"):
                call()
        with pytest.raises(Exception, match="requires a password|refused the password"):
            check_auth(locked.url, password)
    finally:
        for s in (cache, tasks, fleet, rq):
            s.close()


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(
        [sys.executable, "-m", "elmo_cli.main", *args], env=full, capture_output=True, text=True,
        timeout=120, cwd=ROOT,
    )  # fmt: skip


@pytest.mark.parametrize("password", [None, "wrong"])
@pytest.mark.parametrize("command", ["serve", "worker"])
def test_serve_and_worker_refuse_to_start_in_one_line(
    locked, tiny_model_dir, tmp_path, command, password
):
    env = {"REDIS_URL": locked.url, "ELMO_DATA_DIR": str(tmp_path), "ELMO_RUNS_DIR": str(tmp_path)}
    env["ELMO_REDIS_PASSWORD"] = password or ""
    args = ["serve", "--model", str(tiny_model_dir), "--port", str(free_port())]
    r = _run(args if command == "serve" else ["worker", "--burst"], env)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    want = (
        "requires a password: set ELMO_REDIS_PASSWORD" if not password else "refused the password"
    )
    assert want in line and locked.url.split("//")[1] in line, line
