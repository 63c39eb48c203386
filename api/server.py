"""Run the API with uvicorn: ``run(host, port, model_dir=None, **overrides)``.

``overrides`` are Settings fields (``threads=2``, ``redis_url=...``); the
environment and ``.env`` fill in the rest. Settings are validated before
uvicorn starts, so a bad value raises ConfigError naming it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from api.settings import Settings, load_settings


def build(model_dir: str | Path | None = None, **overrides: Any):
    """(app, settings) without running it."""
    from api.main import create_app

    if model_dir is not None:
        overrides["model_path"] = Path(model_dir)
    settings = load_settings(**overrides)
    from api.service import check_model_dir

    check_model_dir(settings.resolved_model_path)  # fail before uvicorn starts, naming the fix
    return create_app(settings), settings


def run(
    host: str = "127.0.0.1",
    port: int = 8000,
    model_dir: str | Path | None = None,
    *,
    log_level: str = "info",
    **overrides: Any,
) -> None:
    import uvicorn

    app, settings = build(model_dir, **overrides)
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("api").info("model directory: %s", settings.resolved_model_path)
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=30,
    )


__all__ = ["Settings", "build", "run"]
