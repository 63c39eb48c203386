"""The Python client against ``wrk`` on the same server and sentences, in one run.

One ``elmo-service serve`` process (``tests/support/replicas.py``: one thread, loopback)
serves the model. Two load generators take turns against it, each for ``--duration``
seconds, ``--rounds`` times (alternating, so that a change in the machine's load hits
both):

  wrk     -- ``wrk -c 16`` with a Lua script POSTing one body to /v1/embed: ``--batch``
             sentences, base64 float32 layers (what the client asks for);
  client  -- ``elmo_service.Client(max_in_flight=16, batch_size=--batch)``: ``embed`` calls
             on the same sentences repeated, split into requests of ``--batch`` and sent
             16 at a time, every answer decoded into ``EmbeddedSentence`` objects.

Sentences per second for each; the target is client >= 80 % of wrk. The server's cache
is off unless ``--cache``: with it, wrk's one body would be answered from the cache after
its first request, and the comparison would measure the cache, not the client.

    .venv/bin/python bench/bench_client.py                  # 2 rounds x 10 s each, ~1 min
    .venv/bin/python bench/bench_client.py --duration 20 --rounds 3 --json out.json

The model is ``models/default``; ``wrk`` comes from ``apt-get install -y wrk``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from elmo_service.client import Client  # noqa: E402
from elmo_service.client.wire import embed_body  # noqa: E402
from tests.support.core_fixtures import generated_text  # noqa: E402
from tests.support.replicas import Replica  # noqa: E402

IN_FLIGHT = 16
LUA = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = io.open("{body}", "rb"):read("*a")
"""


def sentences_for(n: int) -> list[str]:
    lines = [ln.strip() for ln in generated_text(n_lines=4 * n, seed=7).splitlines()]
    return [ln for ln in lines if ln][:n]


def run_wrk(url: str, body_file: Path, lua: Path, duration: float, batch: int) -> dict:
    out = subprocess.run(
        ["wrk", "-t", "2", "-c", str(IN_FLIGHT), "-d", f"{duration:g}s", "--timeout", "300s",
         "-s", str(lua), url + "/v1/embed"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    requests = int(re.search(r"(\d+) requests in", out).group(1))
    seconds = float(re.search(r"requests in ([\d.]+)s", out).group(1))
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if bad:
        raise SystemExit(f"wrk got {bad.group(1)} error answers: the comparison is void\n{out}")
    return {"sentences_per_s": requests * batch / seconds, "requests": requests, "seconds": seconds}


def run_client(url: str, sentences: list[str], duration: float, batch: int) -> dict:
    per_call = sentences * (4 * IN_FLIGHT)  # 64 requests per call: the tail is a small share
    done, start = 0, time.perf_counter()
    with Client(url, max_in_flight=IN_FLIGHT, batch_size=batch) as c:
        c.limits()  # read once, like wrk's body is written once
        start = time.perf_counter()
        while time.perf_counter() - start < duration:
            got = c.embed(per_call)
            assert len(got) == len(per_call) and got[-1].layers is not None
            done += len(got)
    seconds = time.perf_counter() - start
    return {"sentences_per_s": done / seconds, "sentences": done, "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per phase")
    ap.add_argument("--rounds", type=int, default=2, help="wrk, client, wrk, client, ...")
    ap.add_argument("--batch", type=int, default=16, help="sentences per request")
    ap.add_argument("--cache", action="store_true", help="leave the server's cache on")
    ap.add_argument("--model", type=Path, default=REPO / "models" / "default")
    ap.add_argument("--json", type=Path, help="write the figures here")
    a = ap.parse_args(argv)
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed: apt-get install -y wrk")
    tmp = Path(tempfile.mkdtemp(prefix="bench-client-"))
    # no 429 for either: wrk would count a refusal as a request served, the client retries it
    env = {
        "ELMO_MODEL_PATH": str(a.model),
        "ELMO_DATA_DIR": str(tmp / "data"),
        "ELMO_REQUEST_TIMEOUT": "600",
    }
    if not a.cache:
        env["ELMO_CACHE"] = "false"
    server = Replica(env, tmp, "bench").start()
    try:
        server.wait_ready(300)
        sentences = sentences_for(a.batch)
        body = embed_body(sentences, mix=None, output=None, granularity="token", pooling="none")
        (tmp / "body.json").write_bytes(orjson.dumps(body))
        (tmp / "post.lua").write_text(LUA.format(body=tmp / "body.json"))
        run_wrk(server.url, tmp / "body.json", tmp / "post.lua", 2, a.batch)  # warm both up
        run_client(server.url, sentences, 2, a.batch)
        rows = []
        for r in range(a.rounds):
            w = run_wrk(server.url, tmp / "body.json", tmp / "post.lua", a.duration, a.batch)
            c = run_client(server.url, sentences, a.duration, a.batch)
            rows.append({"round": r, "wrk": w, "client": c})
            print(
                f"round {r}: wrk {w['sentences_per_s']:.1f} sentences/s, client "
                f"{c['sentences_per_s']:.1f} sentences/s, ratio "
                f"{c['sentences_per_s'] / w['sentences_per_s']:.3f}",
                flush=True,
            )
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    ratio = statistics.median(
        row["client"]["sentences_per_s"] / row["wrk"]["sentences_per_s"] for row in rows
    )
    load = os.getloadavg()
    print(f"median ratio client / wrk: {ratio:.3f} (target >= 0.80); load {load[0]:.2f}")
    if a.json:
        a.json.write_text(json.dumps({"rounds": rows, "ratio": ratio, "load": load}, indent=1))
    return 0 if ratio >= 0.8 else 1


if __name__ == "__main__":
    raise SystemExit(main())
