"""A replica asked to stop while it still warms up exits at once (#57): uvicorn would first
finish the start-up, and an orchestrator's grace period (compose: 30 s) would run out.

A real `elmo-service serve` process; its warm-up is held open (a sitecustomize that makes it
wait on a file nobody writes) so the signal surely lands mid-warm-up, however fast the machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

HOLD = """
import asyncio, os
from elmo_api import served
_warm_up = served.ServedModel.warm_up
async def warm_up(self):
    print("test: warm-up held", flush=True)
    while not os.path.exists(os.environ["HOLD_RELEASE"]):
        await asyncio.sleep(0.05)
    await _warm_up(self)
served.ServedModel.warm_up = warm_up
"""


def test_sigterm_during_warm_up_exits_promptly(tiny_model_dir, tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    # imported at start by every interpreter on PYTHONPATH: patches after elmo_api is importable
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        "class _After:\n"
        "    done = False\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'elmo_api.main' and not _After.done:\n"
        "            _After.done = True\n"
        f"            exec({HOLD!r}, {{}})\n"
        "        return None\n"
        "sys.meta_path.insert(0, _After())\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
        "OMP_NUM_THREADS": "1",
        "HOLD_RELEASE": str(tmp_path / "never"),
        "ELMO_ENV_FILE": "",
    }
    p = subprocess.Popen(
        [sys.executable, "-m", "elmo_cli.main", "serve", "--port", "0",
         "--model", str(tiny_model_dir), "--threads", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    seen: list[str] = []
    try:
        for line in p.stdout:  # the pipe ends with p
            seen.append(line)
            if "test: warm-up held" in line:
                break
        assert any("warm-up held" in line for line in seen), "".join(seen)
        p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10  # generous: the point is seconds, not the 30 s grace
        while p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        rc = p.poll()
    finally:
        if p.poll() is None:
            p.kill()
        rest = p.communicate(timeout=30)[0]
    out = "".join(seen) + rest
    assert rc == 0, out
    assert "during start-up: exiting now" in out, out
