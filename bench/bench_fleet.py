"""How fast a fleet of ``elmo-service serve`` replicas converges on an activation.

    .venv/bin/python bench/bench_fleet.py                  # the bundled model, 3 replicas
    .venv/bin/python bench/bench_fleet.py --tiny           # tiny random models (the test's)
    .venv/bin/python bench/bench_fleet.py --replicas 3 --rounds 4

Starts a real redis-server and N real replicas on loopback (``tests/support``), all on
one models folder, then ``--rounds`` times activates the other model through replica 1
and times (from sending the request): the answer (replica 1 loaded, warmed and swapped),
and each replica's ``/readyz`` reporting the new version (polled every 20 ms). Twice it
writes the record straight into Redis with no pub/sub notice (a missed message), timing
the replicas' polling (every ``--interval`` seconds) until all serve it. Then
restarts one replica and times stop -> start -> ready, checking that it comes back on
the activated model. Prints a Markdown table; docs/scaling.md keeps the figures.
The replicas share the machine's cores: on a shared machine, loads queue behind
each other, and times are what that machine gave.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import fair  # noqa: E402
from elmo_service.artifact import read_manifest  # noqa: E402
from tests.support.redis_server import RedisServer  # noqa: E402
from tests.support.replicas import REPO, Replica  # noqa: E402

ADMIN = {"authorization": "Bearer admin"}


def _version(r: Replica) -> str | None:
    try:
        return httpx.get(r.url + "/readyz", timeout=5).json()["model"]["version"]
    except (httpx.HTTPError, KeyError, ValueError):
        return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tiny", action="store_true", help="tiny random models, not the bundled one")
    p.add_argument("--interval", type=float, default=2.0, help="ELMO_FLEET_INTERVAL")
    args = p.parse_args()
    print("\n".join(fair.header(os.cpu_count() or 1)))

    tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    if args.tiny:
        from elmo_service.artifact import save_artifact
        from elmo_service.tokenizers import WordTokenizer
        from tests.support.core_fixtures import tiny_model

        models, names = tmp / "models", ("alpha", "beta")
        for seed, name in enumerate(names):
            save_artifact(tiny_model(seed), WordTokenizer(), models / name)
    else:  # the bundled model, and a copy of it with another version (its provenance differs)
        import shutil

        from elmo_service.artifact import load_artifact, save_artifact

        models, names = tmp / "models", ("default", "default-b")
        shutil.copytree(REPO / "models" / "default", models / "default")
        art = load_artifact(models / "default")
        save_artifact(
            art.model, art.tokenizer, models / "default-b", {**art.provenance, "copy": "b"}
        )
    redis = RedisServer(tmp / "redis").start()
    replicas = [
        Replica(
            {
                "REDIS_URL": redis.url,
                "ELMO_MODELS_DIR": str(models),
                "ELMO_MODEL": names[0],
                "ELMO_ADMIN_KEYS": "admin",
                "ELMO_DATA_DIR": str(tmp / f"data{i}"),
                "ELMO_RUNS_DIR": str(tmp / f"runs{i}"),
                "ELMO_FLEET_INTERVAL": str(args.interval),
                "ELMO_FLEET_TTL": str(max(10.0, 3 * args.interval)),
            },
            tmp,
            f"r{i}",
        )
        for i in range(1, args.replicas + 1)
    ]
    try:
        t0 = time.monotonic()
        for r in replicas:
            r.start()
        for r in replicas:
            r.wait_ready(300)
        cold = time.monotonic() - t0
        answers, alls, lasts = [], [], []
        for k in range(args.rounds):
            name = names[(k + 1) % 2]
            t0 = time.monotonic()
            resp = httpx.post(
                replicas[0].url + f"/v1/models/{name}/activate", headers=ADMIN, timeout=300
            )
            answered = time.monotonic() - t0
            resp.raise_for_status()
            want = resp.json()["activated"]["version"]
            pending = set(range(len(replicas)))
            done: dict[int, float] = {}
            while pending and time.monotonic() - t0 < 300:
                for i in list(pending):
                    if _version(replicas[i]) == want:
                        done[i] = time.monotonic() - t0
                        pending.discard(i)
                time.sleep(0.02)
            if pending:
                raise SystemExit(f"round {k}: replicas {sorted(pending)} did not converge")
            answers.append(answered)
            alls.append(max(done.values()))
            lasts.append(sorted(done.values()))
            print(f"round {k}: -> {name}: answered {answered:.2f}s, each {lasts[-1]}", flush=True)
        # a record without its pub/sub notice (a replica that missed the message): polling
        polled = []
        client = redis.client()
        for k in range(2):
            name = names[(args.rounds + 1 + k) % 2]
            want = read_manifest(models / name)["version"]
            t0 = time.monotonic()
            gen = client.incr("elmo:fleet:generation")
            record = {
                "name": name,
                "version": want,
                "generation": gen,
                "at": time.time(),
                "by": "bench",
            }
            client.set("elmo:fleet:desired", json.dumps(record))
            pending = set(range(len(replicas)))
            while pending and time.monotonic() - t0 < 300:
                pending = {i for i in pending if _version(replicas[i]) != want}
                time.sleep(0.02)
            polled.append(time.monotonic() - t0)
            print(f"polled {k}: -> {name}: all in {polled[-1]:.2f}s", flush=True)
        client.close()
        # restart the last replica: it must come back on the activated model
        r = replicas[-1]
        t0 = time.monotonic()
        r.stop()
        stopped = time.monotonic() - t0
        r.start()
        ready = r.wait_ready(300)
        restart = time.monotonic() - t0
        want = _version(replicas[0])
        assert ready["model"]["version"] == want, (ready, want)
    finally:
        for r in replicas:
            r.stop()
        redis.stop()

    def med(xs: list[float]) -> str:
        return f"{statistics.median(xs):.2f}" + (
            f" ({min(xs):.2f}-{max(xs):.2f})" if len(xs) > 1 else ""
        )

    print()
    print(f"models: {', '.join(names)} ({'tiny' if args.tiny else 'bundled'}); "
          f"{args.replicas} replicas, 1 thread each, {os.cpu_count()} cores; "
          f"ELMO_FLEET_INTERVAL={args.interval}; load average now "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}")  # fmt: skip
    print()
    print("| what | seconds, median (min-max) |")
    print("|---|---|")
    print(f"| {args.replicas} replicas cold start -> all ready | {cold:.2f} |")
    print(f"| activate -> the receiving replica answers (swapped) | {med(answers)} |")
    print(f"| activate -> all {args.replicas} replicas serve it | {med(alls)} |")
    print(f"| a record without its notice (polling only) -> all serve it | {med(polled)} |")
    print(f"| restart one: stop (graceful) | {stopped:.2f} |")
    print(f"| restart one: stop -> ready on the activated model | {restart:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
