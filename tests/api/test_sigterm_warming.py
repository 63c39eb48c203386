"""A replica stops on SIGTERM within seconds while it loads and warms up (#57 item 5):
uvicorn looks at signals only once the app's start is over, which a warm-up can make
minutes; nothing has been served yet, so the replica ends at once."""

from __future__ import annotations

import signal
import time

import pytest

from tests.support.replicas import REPO, Replica

pytestmark = pytest.mark.slow


def test_sigterm_while_warming_up_ends_the_replica(tmp_path):
    rep = Replica(
        {
            "ELMO_MODEL_PATH": str(REPO / "models" / "default"),
            "ELMO_DATA_DIR": str(tmp_path / "data"),
            "ELMO_CACHE": "false",
            "ELMO_LOG_LEVEL": "info",
        },
        tmp_path,
        "warming",
    ).start()
    try:
        deadline = time.monotonic() + 120
        while "warming up" not in rep.log.read_text(errors="replace"):
            assert rep.proc.poll() is None, rep.log.read_text()[-2000:]
            assert time.monotonic() < deadline, "the replica never started warming up"
            time.sleep(0.01)
        rep.proc.send_signal(signal.SIGTERM)
        rep.proc.wait(15)  # raises TimeoutExpired if SIGTERM is ignored
        log = rep.log.read_text(errors="replace")
        # it stopped during the warm-up (not after finishing it and serving)
        assert "SIGTERM while warming up" in log, log[-2000:]
        assert rep.proc.returncode == 0
    finally:
        rep.stop()
