"""Checks for docker/e2e.sh on the responses it saved (standard library only).

    python3 docker/e2e_check.py vectors FILE                 # a /v1/embed answer holds finite vectors
    python3 docker/e2e_check.py converged NAME N DIR         # N replicas all serve NAME
    python3 docker/e2e_check.py restarted NAME HOST SINCE DIR
        # the replica on HOST is a process started after SINCE (Unix time) and serves NAME

The fleet view of GET /v1/models is read through the names in FLEET below, the one place that
knows them.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

# Where GET /v1/models keeps what (api/schemas.py: ModelList, FleetOut, ReplicaOut, ModelRef).
FLEET = {
    "served": "served",  # {"id": name, "version": ...}: the replica that answered
    "fleet": "fleet",  # {"desired": ModelRef-like, "agree": bool, "replicas": [...], ...}
    "desired": "desired",  # the last activation recorded: {"id": name, "version": ..., ...}
    "agree": "agree",  # every replica serves the desired version
    "replicas": "replicas",  # one entry per live replica (heartbeats in Redis)
    "replica_served": "served",  # a replica entry's model: {"id": name, "version": ...}
    "replica_host": "host",  # the container's hostname
    "replica_started": "started_at",  # Unix time the replica's process started serving
    "model_name": "id",
}
REPLICA_HEADER = "x-elmo-replica"  # set by docker/haproxy/haproxy.cfg


def vectors(node):
    """Every list of floats (a vector; ids and shapes are ints) anywhere in the response."""
    if isinstance(node, list):
        if len(node) >= 2 and all(isinstance(x, float) for x in node):
            yield node
        else:
            for item in node:
                yield from vectors(item)
    elif isinstance(node, dict):
        for value in node.values():
            yield from vectors(value)


def check_vectors(path: str) -> None:
    found = list(vectors(json.loads(Path(path).read_text())))
    if not found:
        sys.exit("no numeric vectors in the response")
    bad = [v for v in found if not all(math.isfinite(x) for x in v)]
    if bad:
        sys.exit(f"{len(bad)} of {len(found)} vectors contain NaN/inf")
    print(
        f"[e2e] /v1/embed: {len(found)} vectors, dims {sorted({len(v) for v in found})}",
        file=sys.stderr,
    )


def name_of(model) -> str | None:
    if isinstance(model, dict) and isinstance(model.get(FLEET["model_name"]), str):
        return model[FLEET["model_name"]]
    return None


def check_converged(target: str, replicas: int, folder: str) -> None:
    seen: dict[str, str | None] = {}  # balancer's replica name -> what it serves
    fleet = None
    for body in sorted(Path(folder).glob("models-*.json")):
        headers = body.with_suffix(".headers").read_text().lower().splitlines()
        replica = next(
            (h.split(":", 1)[1].strip() for h in headers if h.startswith(REPLICA_HEADER + ":")),
            None,
        )
        doc = json.loads(body.read_text())
        seen[replica or "?"] = name_of(doc.get(FLEET["served"]))
        fleet = doc.get(FLEET["fleet"], fleet)
    not_there = {r: s for r, s in seen.items() if s != target}
    if len(seen) < replicas or not_there:
        sys.exit(f"replicas seen through the balancer: {seen} (want {replicas} on {target})")
    # The shared view (any answer's): the recorded activation, one entry per live replica.
    if not isinstance(fleet, dict):
        sys.exit(f"no fleet view in GET /v1/models: {fleet!r:.200}")
    desired = name_of(fleet.get(FLEET["desired"]))
    entries = fleet.get(FLEET["replicas"]) or []
    names = [name_of(e.get(FLEET["replica_served"])) for e in entries if isinstance(e, dict)]
    if desired != target or fleet.get(FLEET["agree"]) is not True:
        sys.exit(
            f"fleet view: desired {desired}, agree {fleet.get(FLEET['agree'])} (want {target})"
        )
    if len(names) < replicas or any(n != target for n in names):
        sys.exit(f"fleet view disagrees: {names} (want {replicas} x {target})")
    print(f"[e2e] {len(seen)} replicas serve {target}; fleet: {len(names)} agree", file=sys.stderr)


def check_restarted(target: str, host: str, since: float, folder: str) -> None:
    """After `docker restart`: the fleet lists the container's replica as a new process (started
    after SINCE), serving TARGET: it read the activated model at startup, not ELMO_MODEL."""
    answers = sorted(Path(folder).glob("models-*.json"))
    if not answers:
        sys.exit(f"no GET /v1/models answers saved in {folder}")
    fleet = json.loads(answers[-1].read_text()).get(FLEET["fleet"]) or {}
    mine = [
        e
        for e in fleet.get(FLEET["replicas"]) or []
        if isinstance(e, dict) and e.get(FLEET["replica_host"]) == host
    ]
    old = [e for e in mine if not (e.get(FLEET["replica_started"]) or 0) >= since]
    if not mine or old or any(name_of(e.get(FLEET["replica_served"])) != target for e in mine):
        sys.exit(
            f"restarted replica on {host}: fleet entries {mine} (want one started after {since})"
        )
    print(f"[e2e] restarted replica {host} is a new process on {target}", file=sys.stderr)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "vectors":
        check_vectors(*args)
    elif command == "converged":
        check_converged(args[0], int(args[1]), args[2])
    elif command == "restarted":
        check_restarted(args[0], args[1], float(args[2]), args[3])
    else:
        sys.exit(f"unknown check {command!r}")
