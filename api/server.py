"""Run the API with uvicorn: ``run(host, port, model_dir=None, **overrides)``.

``overrides`` are Settings fields (``threads=2``, ``redis_url=...``); the
environment and ``.env`` fill in the rest. Settings are validated before
uvicorn starts, so a bad value raises ConfigError naming it; so is the model
artifact (a broken one raises ArtifactError naming what is wrong).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from pathlib import Path
from typing import Any

from elmo_api.settings import Settings, load_settings


def build(model_dir: str | Path | None = None, *, preload: bool = True, **overrides: Any):
    """(app, settings) without running it.

    ``preload``: load and verify the artifact here (manifest, shapes, finite
    weights), before uvicorn starts: a broken model is one ArtifactError line
    from the CLI, never a lifespan traceback. The lifespan serves this artifact.
    """
    from elmo_service.process import configure_process

    if model_dir is not None:
        overrides["model_path"] = Path(model_dir)
    settings = load_settings(**overrides)
    configure_process("serve", settings.threads)  # before torch loads (the imports below)
    from elmo_api.loading import check_model_dir, preload_artifact
    from elmo_api.main import create_app

    path = check_model_dir(settings.resolved_model_path)  # fail before uvicorn, naming the fix
    check_redis_auth(settings)
    app = create_app(settings)
    if preload:
        from elmo_service.errors import ArtifactError

        # with Redis, the fleet's activated model comes first (the lifespan reports why not)
        want = _fleet_model_path(settings) or path
        try:
            app.state.preloaded_artifact = preload_artifact(want)
        except ArtifactError:
            if want == path:
                raise
            app.state.preloaded_artifact = preload_artifact(path)
    return app, settings


def check_redis_auth(settings: Settings) -> None:
    """A Redis that refuses our password fails startup with one line (fail closed); one
    that does not answer is an outage the stores ride out."""
    from elmo_service.errors import ConfigError
    from elmo_storage import RedisAuthError, check_auth

    for url in dict.fromkeys(
        u for u in (settings.redis_url, settings.resolved_cache_redis_url) if u
    ):
        try:
            check_auth(url, settings.redis_password)
        except RedisAuthError as e:
            raise ConfigError(str(e), field="redis_password") from None


def _fleet_model_path(settings: Settings) -> Path | None:
    from elmo_api.fleet import fleet_store, startup_model_path

    store = fleet_store(settings)
    if store is None:
        return None
    try:
        return startup_model_path(settings, store)[0]
    finally:
        store.close()


def run(
    host: str = "127.0.0.1",
    port: int = 8000,
    model_dir: str | Path | None = None,
    *,
    log_level: str = "info",
    **overrides: Any,
) -> None:
    import uvicorn

    from elmo_api.http_protocol import uvicorn_options

    sock = listen(host, port)  # before the model loads: a port in use is one line, at once
    try:
        # before the app is built: its start lines (tracing's) are said too
        logging.basicConfig(
            level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        app, settings = build(model_dir, **overrides)
        log = logging.getLogger("api")
        log.info("model directory: %s", settings.resolved_model_path)
        # uvicorn is handed a bound socket and cannot say where it is: say it here
        shown = f"[{host}]" if ":" in host else host
        log.info("listening on http://%s:%d (API docs at /docs)", shown, sock.getsockname()[1])
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            access_log=False,
            timeout_graceful_shutdown=30,
            **uvicorn_options(settings),
        )
        _server_class()(config).run(sockets=[sock])
    finally:
        sock.close()


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, but a stop asked for before it serves (model load, warm-up) is
        obeyed at once: uvicorn would first finish the start-up (tens of seconds on a CPU), and
        an orchestrator's grace period would run out. Nothing is served yet, so nothing drains."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.started:
                logging.getLogger("api").info(
                    "signal %d during start-up: exiting now (nothing is served yet)", sig
                )
                for h in logging.getLogger().handlers:
                    h.flush()
                os._exit(0)
            super().handle_exit(sig, frame)

    return Server


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (uvicorn listens on it), or a ConfigError naming the port."""
    from elmo_service.errors import ConfigError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        hint = " (another process listens there: choose another with --port)"
        raise ConfigError(
            f"cannot listen on {host}:{port}: {e.strerror}"
            + (hint if e.errno == errno.EADDRINUSE else ""),
            field="port",
        ) from e
    return sock


__all__ = ["Settings", "build", "listen", "run"]
