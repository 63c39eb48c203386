"""Fixtures any test may share: a tiny model artifact and a real redis-server.

* ``tiny_model_dir``: a small random biLM (``small_test_config``, word
  tokenizer) saved as an artifact, with one shipped task ``shipped``. Built
  once per session; treat it as read-only.
* ``torch_threads`` (autouse): every test runs with one torch thread (the
  suite shares 2 cores with other processes) and the count is restored after
  it; a test that wants another count calls ``torch_threads(n)``.
* ``redis_server``: a real ``redis-server`` on a free loopback port (no
  persistence), one per session; ``redis_server_factory()`` starts extra,
  isolated ones (for tests that stop and restart Redis). A missing
  ``redis-server`` binary FAILS the tests that need it (install:
  ``apt-get install -y redis-server``): it never skips them. Tests using
  either fixture are marked ``redis`` (``pytest -m "not redis"``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# No dotenv file: the checkout's `.env` (the compose stack's, with its keys) must not change what
# the tests see. Set here, at import, so every server and worker the tests start inherits it; a
# test of the dotenv file itself sets ELMO_ENV_FILE back (tests/api/test_settings_env.py).
os.environ["ELMO_ENV_FILE"] = ""
# the kernels' per-machine route (elmo_service/bilm/kernels/calibrate.py) would make a test's
# kernel path depend on timing: native always, except in the test that turns it on
os.environ.setdefault("ELMO_KERNEL_CALIBRATION", "off")

from tests.support.redis_server import RedisMissing, RedisServer

# The client is its own distribution (clients/python, import elmo_client); until it is
# installed beside the service, the tests import it from the checkout, ahead of any copy
_CLIENT = str(Path(__file__).resolve().parent.parent / "clients" / "python")
if _CLIENT not in sys.path:
    sys.path.insert(0, _CLIENT)

REDIS_FIXTURES = {"redis_server", "redis_server_factory"}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``redis`` every test that starts a redis-server through the fixtures below."""
    for item in items:
        if REDIS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.redis)


@pytest.fixture(autouse=True)
def torch_threads() -> Iterator[Callable[[int], None]]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield torch.set_num_threads
    finally:
        torch.set_num_threads(before)


def start_redis(workdir: Path) -> RedisServer:
    """A started server; no binary fails the test (never a skip)."""
    try:
        return RedisServer(workdir).start()
    except RedisMissing as e:
        pytest.fail(f"the Redis tests need a real server: {e}", pytrace=False)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator[Callable[[], RedisServer]]:
    started: list[RedisServer] = []

    def make() -> RedisServer:
        server = start_redis(tmp_path / f"redis{len(started)}")
        started.append(server)
        return server

    try:
        yield make
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight artifact (3 output layers x 16 dims, word tokenizer, task ``shipped``)."""
    import torch

    from elmo_service.artifact import save_artifact
    from elmo_service.bilm.model import BiLM
    from elmo_service.scalar_mix import MixSpec
    from elmo_service.tokenizers import WordTokenizer
    from tests.support.configs import small_test_config

    torch.manual_seed(1234)
    model = BiLM(small_test_config()).eval()
    path = tmp_path_factory.mktemp("models") / "tiny"
    save_artifact(
        model,
        WordTokenizer(),
        path,
        provenance={"source": "tests/conftest.py", "weights": "random"},
        tasks={"shipped": MixSpec(weights=[0.5, 1.0, -0.5], gamma=0.7)},
    )
    return path


@pytest.fixture(scope="module")
def fake() -> Iterator:
    """A fake Redis answering nonsense (a real process), one per test module; the tests set
    its mode (``fake.set_mode(...)``)."""
    from tests.support.fake_redis import FakeRedis

    with FakeRedis("types") as f:
        yield f
