"""The compose stack's balancer, for real: Debian's haproxy running docker/haproxy/haproxy.cfg.

The file is rendered for loopback: its `bind` and `server-template` lines (Docker DNS names) are
replaced by 127.0.0.1 addresses; everything else (checks on /readyz, leastconn, timeouts,
monitor-uri) is the file as shipped. Behind it: two real `elmo-service serve` processes and one
small real HTTP process whose /readyz answers 200 or 503 as a flag file says.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
HAPROXY_CFG = ROOT / "docker" / "haproxy" / "haproxy.cfg"
COMPOSE_FILE = ROOT / "docker-compose.yml"
pytestmark = [pytest.mark.slow, pytest.mark.docker]

SENTENCE = {"sentences": ["The bank of the river."]}

# A backend that is a real process: /readyz is 200 while FLAG exists, else 503; anything else 200.
STUB = r"""
import http.server, os, sys
flag, port = sys.argv[1], int(sys.argv[2])
class H(http.server.BaseHTTPRequestHandler):
    def _answer(self):
        ok = self.path != "/readyz" or os.path.exists(flag)
        self.send_response(200 if ok else 503)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")
    do_GET = do_POST = _answer
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def render(cfg: str, lb_port: int, servers: dict[str, int]) -> str:
    """The shipped config with loopback addresses in place of the Docker-only lines."""
    bind = re.compile(r"^(\s*)bind :8000$", re.M)
    template = re.compile(r"^(\s*)server-template api 1-8 api:8000$", re.M)
    assert bind.search(cfg) and template.search(cfg), "the lines this test replaces changed"
    cfg = bind.sub(rf"\1bind 127.0.0.1:{lb_port}", cfg)
    lines = "\n".join(f"    server {name} 127.0.0.1:{port}" for name, port in servers.items())
    return template.sub(lambda _: lines, cfg)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


def status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None


class Stack:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []
        self.lb_port = free_port()
        self.url = f"http://127.0.0.1:{self.lb_port}"
        self.ports = {"api1": free_port(), "api2": free_port(), "stub": free_port()}
        self.flag = tmp / "stub-ready"
        self.log = tmp / "haproxy.log"

    def spawn(
        self, cmd: list[str], log: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        out = open(self.tmp / log, "ab")  # noqa: SIM115 - owned by the process
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self.procs.append(proc)
        return proc

    def start_api(self, name: str) -> None:
        env = os.environ | {
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "ELMO_THREADS": "1",
        }
        env.pop("REDIS_URL", None)
        cmd = [sys.executable, "-m", "elmo_cli.main", "serve", "--port", str(self.ports[name])]
        self.api[name] = self.spawn(cmd, f"{name}.log", env)

    def start(self) -> None:
        self.api: dict[str, subprocess.Popen] = {}
        for name in ("api1", "api2"):
            self.start_api(name)
        self.spawn(
            [sys.executable, "-c", STUB, str(self.flag), str(self.ports["stub"])], "stub.log"
        )
        cfg = self.tmp / "haproxy.cfg"
        cfg.write_text(render(HAPROXY_CFG.read_text(), self.lb_port, self.ports))
        haproxy = shutil.which("haproxy")
        assert haproxy, "haproxy is needed (apt-get install haproxy)"
        check = subprocess.run([haproxy, "-c", "-f", str(cfg)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        self.spawn([haproxy, "-W", "-db", "-f", str(cfg)], "haproxy.log")

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def state(self, server: str) -> str | None:
        """The state haproxy last logged for `server` (UP or DOWN), None before any change."""
        found = re.findall(
            rf"^Server api/{server} is (UP|DOWN)\b", self.log.read_text(errors="replace"), re.M
        )
        return found[-1] if found else None

    def restore(self) -> None:
        """Both replicas running and in rotation, the stub out, whatever a test left: stopped
        replicas continued, killed ones started again."""
        restarted = {}  # a killed replica's UP count: its new process must come UP after it
        for name, proc in list(self.api.items()):
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
            else:
                restarted[name] = self.transitions(name, "UP")
                self.start_api(name)
        self.flag.unlink(missing_ok=True)
        wait_for(
            lambda: (
                all(self.transitions(n, "UP") > ups for n, ups in restarted.items())
                and self.state("api1") == self.state("api2") == "UP"
                and self.state("stub") == "DOWN"
            ),
            120,
            "api1 and api2 UP, stub DOWN",
        )

    def transitions(self, server: str, state: str) -> int:
        """How often haproxy logged `server` going UP or DOWN (stdout lines, not stderr copies)."""
        pattern = rf"^Server api/{server} is {state}\b"
        return len(re.findall(pattern, self.log.read_text(errors="replace"), re.M))

    def embed(self, n: int) -> Counter:
        """n requests through the balancer; every answer must be a 200 with finite vectors."""
        seen: Counter = Counter()
        with httpx.Client(base_url=self.url, timeout=60) as client:
            for _ in range(n):
                r = client.post("/v1/embed", json=SENTENCE)
                replica = r.headers.get("x-elmo-replica")
                assert r.status_code == 200, (replica, r.status_code, r.text[:300])
                body = r.json()
                assert replica in ("api1", "api2"), (replica, body)
                vectors = _floats(body["data"])
                assert vectors and all(math.isfinite(x) for v in vectors for x in v)
                seen[replica] += 1
        return seen


def _floats(node) -> list[list[float]]:
    if isinstance(node, list) and node and all(isinstance(x, float) for x in node):
        return [node]
    items = node.values() if isinstance(node, dict) else node if isinstance(node, list) else []
    return [v for item in items for v in _floats(item)]


def lb_healthcheck(port: int) -> int:
    """Exit status of the compose file's health check of `lb`, run against this balancer."""
    test = yaml.safe_load(COMPOSE_FILE.read_text())["services"]["lb"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "bash", "-c"], test
    script = test[3].replace("$$", "$").replace("/127.0.0.1/8000", f"/127.0.0.1/{port}")
    return subprocess.run(["bash", "-c", script], capture_output=True, timeout=10).returncode


@pytest.fixture(scope="module")
def shared_stack(tmp_path_factory: pytest.TempPathFactory):
    """One stack for the module (its replicas start once); each test gets it restored."""
    s = Stack(tmp_path_factory.mktemp("stack"))
    try:
        s.start()
        yield s
    finally:
        s.stop()


@pytest.fixture
def stack(shared_stack: Stack):
    shared_stack.restore()
    try:
        yield shared_stack
    finally:
        if shared_stack.log.exists():  # shown by pytest when the test fails
            print(shared_stack.log.read_text(errors="replace")[-3000:])


def test_haproxy_spreads_requests_and_drops_replicas_that_fail_readyz(stack: Stack):
    lb_health = f"{stack.url}/lb/healthz"

    def after(action, *changes: tuple[str, str], timeout: float = 30) -> None:
        """Run `action`, then wait until haproxy logs each (server, UP|DOWN) change once more."""
        before = {c: stack.transitions(*c) for c in changes}
        action()
        wait_for(
            lambda: all(stack.transitions(*c) > n for c, n in before.items()), timeout, changes
        )

    # haproxy starts with every server assumed up; the checks settle it: both real replicas in
    # rotation once their model is loaded, the stub (503 on /readyz) out.
    wait_for(
        lambda: (
            all(stack.transitions(s, "UP") for s in ("api1", "api2"))
            and stack.transitions("stub", "DOWN")
        ),
        120,
        "api1 and api2 UP, stub DOWN",
    )
    assert status(lb_health) == 200 and lb_healthcheck(stack.lb_port) == 0
    seen = stack.embed(12)
    assert seen["api1"] >= 3 and seen["api2"] >= 3, f"requests not spread: {seen}"

    # The stub turns ready: it joins; its /readyz fails again (503): it leaves.
    after(stack.flag.touch, ("stub", "UP"))
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        hits = Counter(client.get("/probe").headers.get("x-elmo-replica") for _ in range(9))
    assert hits["stub"] >= 1, hits
    after(stack.flag.unlink, ("stub", "DOWN"))
    seen = stack.embed(9)
    assert seen["api1"] + seen["api2"] == 9, seen

    # A real replica stops answering (SIGSTOP: its /readyz times out): out of rotation, and
    # every request succeeds on the other one.
    after(lambda: stack.api["api2"].send_signal(signal.SIGSTOP), ("api2", "DOWN"))
    assert stack.embed(6) == Counter({"api1": 6})
    assert status(lb_health) == 200

    # No replica left: the balancer's health check says so (503), and clients get a 503.
    after(lambda: stack.api["api1"].send_signal(signal.SIGSTOP), ("api1", "DOWN"))
    assert status(lb_health) == 503 and lb_healthcheck(stack.lb_port) != 0
    assert httpx.post(f"{stack.url}/v1/embed", json=SENTENCE, timeout=10).status_code == 503

    def resume() -> None:
        for proc in stack.api.values():
            proc.send_signal(signal.SIGCONT)

    after(resume, ("api1", "UP"), ("api2", "UP"))
    seen = stack.embed(12)
    assert seen["api1"] >= 3 and seen["api2"] >= 3, f"requests not spread: {seen}"


def test_rendering_keeps_the_shipped_config():
    cfg = HAPROXY_CFG.read_text()
    rendered = render(cfg, 1234, {"a": 1, "b": 2})
    assert "bind 127.0.0.1:1234" in rendered and "server a 127.0.0.1:1" in rendered
    # nothing else changes: the checks, the balance algorithm and the timeouts are the real ones
    kept = [ln for ln in cfg.splitlines() if "bind :8000" not in ln and "server-template" not in ln]
    assert all(ln in rendered.splitlines() for ln in kept)
    for directive in ("balance leastconn", "http-check expect status 200", "uri /readyz"):
        assert directive in cfg


def test_a_replica_killed_under_load_cuts_no_request(stack: Stack):
    """SIGKILL a replica while requests are in flight on it. Every request is
    answered: retried on the other replica (200), or a 502/503 that haproxy logged; none is cut
    (a closed connection with no answer)."""
    start = len(stack.log.read_text(errors="replace"))  # this test's part of the shared log
    wait_for(
        lambda: all(stack.transitions(s, "UP") for s in ("api1", "api2")),
        120,
        "api1 and api2 UP",
    )
    # several sentences per request: each takes a while, so the victim has some in flight
    body = {"sentences": [f"The bank of the river number {i} was steep." for i in range(24)]}
    outcomes: list[tuple[float, object]] = []  # (when, status code or the exception's name)
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(base_url=stack.url, timeout=60) as client:
            while not stop.is_set():
                try:
                    r = client.post("/v1/embed", json=body)
                    r.json()  # a whole answer, not a truncated one
                    outcomes.append((time.monotonic(), r.status_code))
                except (httpx.HTTPError, ValueError) as e:
                    outcomes.append((time.monotonic(), f"{type(e).__name__}: {e}"))

    threads = [threading.Thread(target=load, daemon=True) for _ in range(6)]
    for t in threads:
        t.start()
    wait_for(lambda: len(outcomes) >= 12, 60, "load running")
    killed_at = time.monotonic()
    # two kills (api2, back, then api1): a kill can land between two requests
    for victim in ("api2", "api1"):
        n, downs = len(outcomes), stack.transitions(victim, "DOWN")
        wait_for(lambda n=n: len(outcomes) >= n + 8, 60, "requests on both replicas")
        stack.api[victim].kill()  # SIGKILL: no draining, connections reset mid-request
        wait_for(lambda v=victim, d=downs: stack.transitions(v, "DOWN") > d, 30, f"{victim} DOWN")
        if victim == "api2":
            ups = stack.transitions("api2", "UP")
            stack.start_api("api2")
            wait_for(lambda u=ups: stack.transitions("api2", "UP") > u, 120, "api2 UP again")
    time.sleep(2)  # and some more requests after haproxy noticed
    stop.set()
    for t in threads:
        t.join(90)

    cut = [o for _, o in outcomes if not isinstance(o, int)]
    assert not cut, f"{len(cut)} requests cut without an answer: {Counter(cut)}"
    statuses = Counter(o for _, o in outcomes)
    # a replica's own answers (200, or 429 when it is full) and haproxy's 502/503
    assert set(statuses) <= {200, 429, 502, 503}, statuses
    after = [o for when, o in outcomes if when > killed_at]
    assert len(after) >= 6, "the load must go on after the kill"
    # every error answer is haproxy's own, and logged (httplog: ... backend/server ... status)
    log = stack.log.read_text(errors="replace")[start:]
    logged = Counter(int(m) for m in re.findall(r" api/\S+ \S+ (50[23]) ", log))
    for code in (502, 503):
        assert logged[code] >= statuses[code], (code, statuses, logged)
    # the kill was felt: requests met the dead replica and were sent on (httplog's retries field,
    # "+N" when redispatched; no replica was dead before the kill)
    assert re.search(r" \d+/\d+/\d+/\d+/\+[1-9] ", log), "no request was redispatched"
