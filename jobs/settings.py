"""The settings the jobs subsystem reads, as a protocol.

The values are the service's ``ELMO_*`` environment settings (``elmo_api.settings.Settings``
provides every attribute below); whoever starts a worker or the API loads them and
hands them in, so this package never imports the HTTP layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol


class JobsSettings(Protocol):
    """What :mod:`jobs` reads from the service settings (names as in ``ELMO_<NAME>``)."""

    redis_url: str | None
    redis_password: Any  # pydantic SecretStr | None: storage.connect reads either
    redis_prefix: str
    models_dir: Path
    data_dir: Path
    runs_dir: Path
    threads: int | None
    jobs_queue: str
    jobs_embedded_worker: bool
    jobs_max_attempts: int
    jobs_heartbeat_timeout: float
    jobs_stop_timeout: float
    jobs_poll_interval: float
    jobs_max_memory: int | None
    jobs_memory_fraction: float
    jobs_max_steps: int
    jobs_max_threads: int | None
    jobs_gpus: int | None
    jobs_store_timeout: float
