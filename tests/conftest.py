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


def file_weights() -> dict[str, float]:
    """``tests/file_weights.txt``: seconds per slow test file, from a measured run."""
    weights = {}
    for line in (Path(__file__).parent / "file_weights.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            seconds, path = line.split()
            weights[path] = float(seconds)
    return weights


def heaviest_files_first(items: list[pytest.Item]) -> None:
    """Sort the files by their weight, heaviest first, keeping each file's tests together and
    in order (unlisted files after, in collection order). xdist's loadfile scheduler hands out
    files in collection order (`--no-loadscope-reorder`, set by the Makefile), so a long file
    starts early instead of running alone at the end."""
    weights = file_weights()
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(item.nodeid.split("::", 1)[0], len(first_seen))

    def key(item: pytest.Item) -> tuple[float, int]:
        path = item.nodeid.split("::", 1)[0]
        return (-weights.get(path, 0.0), first_seen[path])

    items.sort(key=key)  # stable: a file's tests keep their order


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``redis`` every test that starts a redis-server through the fixtures below, and put
    the slowest files first."""
    for item in items:
        if REDIS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.redis)
    heaviest_files_first(items)


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
