"""A run's launch record: the config file and ``--set`` overrides it was started with.

``run.json`` holds the resolved config only, so it cannot tell a field the
YAML file set from one a ``--set`` flag set. ``elmo-pretrain train`` writes
``RUN_DIR/launch.json`` (rank 0) before training; ``--resume`` re-reads the
file with these overrides applied first, so repeating the launch command
without its ``--set`` flags resumes the same run (``train.resolve_config``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from elmo_service.atomic import write_json
from pretrain.config import parse_override
from pretrain.run_dir import LAUNCH_FILE


def read_launch(run_dir: Path) -> dict[str, Any] | None:
    """``{"config": path | None, "overrides": [...]}``, or None when the run has no record."""
    try:
        rec = json.loads((Path(run_dir) / LAUNCH_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("overrides"), list):
        return None
    return rec


def write_launch(run_dir: Path, config_path: str | None, overrides: list[str]) -> None:
    """Atomic (other DDP ranks may be reading it); the caller writes on rank 0 only."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(run_dir / LAUNCH_FILE, {"config": config_path, "overrides": overrides})


def override_keys(overrides: list[str]) -> set[str]:
    """``["optim.lr=0.2"]`` -> ``{"optim.lr"}``."""
    return {".".join(parse_override(o)[0]) for o in overrides}
