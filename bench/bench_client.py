"""The Python client against ``wrk`` on the same server and sentences, in one run.

One ``elmo-service serve`` process (``tests/support/replicas.py``: one thread, loopback)
serves the model. Two load generators take turns against it, each for ``--duration``
seconds, ``--rounds`` times (alternating, so that a change in the machine's load hits
both):

  wrk     -- ``wrk -c 16`` with a Lua script POSTing one body to /v1/embed: ``--batch``
             sentences, base64 float32 layers (what the client asks for);
  client  -- ``elmo_service.Client(max_in_flight=16, batch_size=--batch)``: one ``embed``
             call on the same sentences repeated (as many as wrk got through in its
             phase), split into requests of ``--batch`` and sent 16 at a time, every
             answer decoded into ``EmbeddedSentence`` objects; its tail, where fewer than
             16 requests are left, counts.

Sentences per second for each; the target is client >= 80 % of wrk. The server's cache
is off unless ``--cache``: with it, wrk's one body would be answered from the cache after
its first request, and the comparison would measure the cache, not the client.

    .venv/bin/python bench/bench_client.py                  # 2 rounds x 15 s each, ~1.5 min
    .venv/bin/python bench/bench_client.py --duration 20 --rounds 3 --json out.json
    .venv/bin/python bench/bench_client.py --parity      # and the largest difference

``--parity`` first compares the client's answers with ``Embedder.embed`` on the same model
for every output / granularity / pooling / mix (none, the model's ``pos`` task, an inline
per-direction layer-normalised mix) and prints the largest absolute difference.

The model is ``models/default``; ``wrk`` comes from ``apt-get install -y wrk``.
"""

from __future__ import annotations

import argparse
import itertools
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
sys.path.insert(0, str(REPO / "clients" / "python"))  # the client's own distribution

from bench import fair  # noqa: E402
from elmo_client import Client  # noqa: E402
from elmo_client.wire import embed_body  # noqa: E402
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


def run_client(url: str, sentences: list[str], n: int, batch: int) -> dict:
    """One ``embed`` call on ``n`` sentences (``sentences`` repeated): how a user embeds a
    large list, tail included."""
    work = (sentences * (n // len(sentences) + 1))[: max(n, IN_FLIGHT * batch)]
    with Client(url, max_in_flight=IN_FLIGHT, batch_size=batch) as c:
        c.limits()  # read once, as wrk's body is written once
        start = time.perf_counter()
        got = c.embed(work)
        seconds = time.perf_counter() - start
    assert len(got) == len(work) and all(s.layers is not None for s in got)
    return {"sentences_per_s": len(work) / seconds, "sentences": len(work), "seconds": seconds}


def parity(url: str, model: Path, sentences: list[str]) -> dict:
    """The largest |client - library| over every combination, and where it is."""
    import numpy as np

    from elmo_service import Embedder
    from elmo_service.outputs import pool
    from elmo_service.scalar_mix import MixSpec

    lib = Embedder.load(model, threads=1)
    inline = MixSpec([0.2, -0.3, 0.6, 0.1, 0.5], gamma=0.9, per_direction=True, layer_norm=True)
    mixes = {"none": None, "pos": "pos", "inline": inline}
    worst, where, combos = 0.0, None, 0
    with Client(url) as c:
        for gran, (name, mix) in itertools.product(("token", "word"), mixes.items()):
            want = lib.embed(sentences, granularity=gran, mix=mix if mix is not None else "default")
            for out, how in itertools.product(
                (None, "layers", "mix", "both"), ("none", "mean", "max")
            ):
                if out == "layers" and mix is not None:
                    continue
                got = c.embed(sentences, mix=mix, granularity=gran, output=out, pooling=how)
                kind = out or ("layers" if mix is None else "both")
                combos += 1
                for g, w in zip(got, want, strict=True):
                    assert g.tokens == w.tokens
                    pairs = []
                    if kind != "mix":
                        pairs.append((g.layers, pool(w.layers, how, axis=1)))
                    if kind != "layers":
                        pairs.append((g.mix, pool(w.mix, how, axis=0)))
                    for a, b in pairs:
                        d = float(np.abs(a - b).max())
                        if d > worst:
                            worst, where = (
                                d,
                                f"output={out} granularity={gran} pooling={how} mix={name}",
                            )
    return {"largest_difference": worst, "where": where, "combinations": combos}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=15.0, help="seconds per phase")
    ap.add_argument("--rounds", type=int, default=2, help="wrk, client, wrk, client, ...")
    ap.add_argument("--batch", type=int, default=16, help="sentences per request")
    ap.add_argument("--cache", action="store_true", help="leave the server's cache on")
    ap.add_argument("--model", type=Path, default=REPO / "models" / "default")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--parity", action="store_true", help="also the largest difference")
    a = ap.parse_args(argv)
    print("\n".join(fair.header(os.cpu_count() or 1)))
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
        diff = None
        if a.parity:
            diff = parity(server.url, a.model, sentences_for(4 * a.batch))
            print(
                f"largest |client - library| over {diff['combinations']} combinations: "
                f"{diff['largest_difference']:.3g} ({diff['where']})",
                flush=True,
            )
        body = embed_body(sentences, mix=None, output=None, granularity="token", pooling="none")
        (tmp / "body.json").write_bytes(orjson.dumps(body))
        (tmp / "post.lua").write_text(LUA.format(body=tmp / "body.json"))
        run_wrk(server.url, tmp / "body.json", tmp / "post.lua", 2, a.batch)  # warm both up
        run_client(server.url, sentences, IN_FLIGHT * a.batch, a.batch)
        rows = []
        for r in range(a.rounds):
            w = run_wrk(server.url, tmp / "body.json", tmp / "post.lua", a.duration, a.batch)
            # as many sentences as wrk got through in its phase: about as long a run
            n = int(w["sentences_per_s"] * a.duration)
            c = run_client(server.url, sentences, n, a.batch)
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
        figures = {"rounds": rows, "ratio": ratio, "load": load, "parity": diff}
        a.json.write_text(json.dumps(figures, indent=1))
    return 0 if ratio >= 0.8 else 1


if __name__ == "__main__":
    raise SystemExit(main())
