"""``elmo-service``: the core commands plus ``serve`` and ``worker``."""

from __future__ import annotations

import argparse
import sys

from elmo_cli.core import build_parser, run
from elmo_service.errors import ConfigError
from elmo_service.process import configure_process


def _server_extra() -> None:
    """``serve`` and ``worker`` need the server's packages (``pip install elmo-service`` is the
    library alone): say which install gives them instead of a ModuleNotFoundError."""
    try:
        import fastapi  # noqa: F401
        import redis  # noqa: F401
        import rq  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"this command needs the server's packages ({e.name} is missing): "
            "pip install 'elmo-service[server]'"
        ) from e


def cmd_serve(args: argparse.Namespace) -> int:
    _server_extra()
    from elmo_api.server import run as run_server  # the process is set up in elmo_api.server.build

    overrides = {}
    if args.threads is not None:
        overrides["threads"] = args.threads
    run_server(host=args.host, port=args.port, model_dir=args.model, **overrides)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    _server_extra()
    configure_process("worker", set_threads=False)  # before `jobs` loads torch; jobs set theirs
    from elmo_api.settings import load_settings
    from elmo_jobs import run_worker

    return run_worker(load_settings(), burst=args.burst) or 0


def _server_commands(p: argparse.ArgumentParser, sub) -> None:
    s = sub.add_parser("serve", help="run the HTTP service (FastAPI + uvicorn)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    s.add_argument("--model", default=None, help="model directory (default: the bundled model)")
    s.add_argument("--threads", type=int, default=None, help="torch threads (ELMO_THREADS)")
    s.set_defaults(func=cmd_serve, role="serve")
    w = sub.add_parser("worker", help="run a pretraining-job worker")
    w.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    w.set_defaults(func=cmd_worker, role="worker")
    # the core parser's description names only its own commands: say all of them
    p.description = "elmo-service: " + ", ".join(sub.choices) + " (one command per line below)."


def parser() -> argparse.ArgumentParser:
    return build_parser(more=_server_commands)


def main(argv: list[str] | None = None) -> int:
    return run(parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
