"""``elmo-service``: the core commands plus ``serve`` and ``worker``."""

from __future__ import annotations

import argparse
import os
import sys

from api.openmp import openmp_env_for_serving  # imports no torch: it must run before torch loads

# Before torch loads OpenMP: `serve` spins briefly (api/openmp.py); the other commands do not
# spin, since spinning threads collapse when another process shares the cores. An explicit
# OMP_WAIT_POLICY in the environment wins.
if sys.argv[1:2] == ["serve"]:
    openmp_env_for_serving()
else:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from elmo_service.cli import build_parser, run  # noqa: E402


def cmd_serve(args: argparse.Namespace) -> int:
    from api.server import run as run_server

    overrides = {}
    if args.threads is not None:
        overrides["threads"] = args.threads
    run_server(host=args.host, port=args.port, model_dir=args.model, **overrides)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from api.settings import load_settings
    from jobs import run_worker

    return run_worker(load_settings(), burst=args.burst) or 0


def parser() -> argparse.ArgumentParser:
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    s = sub.add_parser("serve", help="run the HTTP service (FastAPI + uvicorn)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    s.add_argument("--threads", type=int, default=None)
    s.set_defaults(func=cmd_serve)
    w = sub.add_parser("worker", help="run a pretraining-job worker")
    w.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    w.set_defaults(func=cmd_worker)
    return p


def main(argv: list[str] | None = None) -> int:
    return run(parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
