"""A training run folder's layout, in one place (the trainer, eval/export and the job
runner all read it from here)::

    RUN_DIR/
      run.json          RUN_FILE: the resolved config, its hash, the corpus, the world size
      config.yaml       CONFIG_FILE: the same config, for people
      launch.json       LAUNCH_FILE: config file and --set overrides it started with (launch.py)
      metrics.jsonl     METRICS_FILE: one JSON record a line (tracking.py), ending each
                        training segment with a stop record (why it stopped)
      tensorboard/      TB_DIR: scalars, when TensorBoard is installed
      checkpoints/      CHECKPOINTS_DIR: step-<8 digits>.pt + .sha256 (checkpoint.py)

An exported language model (``elmo-pretrain export --lm``) is a run folder too:
``run.json`` + ``LM_WEIGHTS`` + ``corpus/`` (``elmo-pretrain eval`` reads either).
"""

from __future__ import annotations

import re
from pathlib import Path

RUN_FILE = "run.json"
CONFIG_FILE = "config.yaml"
LAUNCH_FILE = "launch.json"
METRICS_FILE = "metrics.jsonl"
TB_DIR = "tensorboard"
CHECKPOINTS_DIR = "checkpoints"
LM_WEIGHTS = "lm.safetensors"

# what a restart (--force) clears; launch.json is rewritten before it, and
# tensorboard/ goes with an empty metrics.jsonl (tracking.MetricsLog)
RUN_STATE = (CHECKPOINTS_DIR, METRICS_FILE, RUN_FILE, CONFIG_FILE)


def metrics_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / METRICS_FILE


def run_info_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / RUN_FILE


CHECKPOINT_NAME = re.compile(r"^step-(\d{8,})\.pt$")


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR


def checkpoint_step(path: str | Path) -> int | None:
    """``step-00034700.pt`` -> 34700; None for any other name."""
    m = CHECKPOINT_NAME.match(Path(path).name)
    return int(m.group(1)) if m else None


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint files under their final names, oldest first (verified or not)."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    found = [(step, p) for p in d.iterdir() if (step := checkpoint_step(p)) is not None]
    return [p for _, p in sorted(found)]
