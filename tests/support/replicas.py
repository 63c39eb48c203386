"""Real ``elmo-service serve`` processes on loopback, for the fleet tests and bench/.

``Replica(env).start()`` runs ``python -m elmo_cli.main serve`` with this checkout on
PYTHONPATH, one thread, a free port; ``wait_ready()`` polls ``/readyz``; ``stop()``
ends it gracefully (SIGTERM, then SIGKILL), ``start()`` again keeps the port.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.support.ports import free_port
from tests.support.procs import terminate

REPO = Path(__file__).resolve().parents[2]


class Replica:
    def __init__(self, env: dict[str, str], log_dir: Path, name: str) -> None:
        self.env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
            "ELMO_REPLICA_ID": name,
            **env,
        }
        self.name, self.port = name, free_port()
        self.log = Path(log_dir) / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Replica:
        cmd = [sys.executable, "-m", "elmo_cli.main", "serve", "--port", str(self.port)]
        cmd += ["--threads", "1"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                cmd, env=self.env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
            )
        return self

    def wait_ready(self, timeout: float = 300.0) -> dict:
        # a deadline, not a timing: a loaded 2-core machine took over 60 s to load and warm up
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log.read_text()[-2000:]}")
            try:
                r = httpx.get(self.url + "/readyz", timeout=2)
                if r.status_code == 200:
                    return r.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not ready in {timeout}s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        terminate(self.proc, wait=20)
        self.proc = None
