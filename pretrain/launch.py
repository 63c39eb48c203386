"""A run's launch record, and the launcher for several processes on this machine.

The record: the config file and ``--set`` overrides the run was started with.

``run.json`` holds the resolved config only, so it cannot tell a field the
YAML file set from one a ``--set`` flag set. ``elmo-pretrain train`` writes
``RUN_DIR/launch.json`` (rank 0) before training; ``--resume`` re-reads the
file with these overrides applied first, so repeating the launch command
without its ``--set`` flags resumes the same run (``run_checks.resolve_config``).

``elmo-pretrain train ... --nproc-per-node N`` runs torchrun's launcher in this
process (:func:`launch_local`), so that Ctrl-C or SIGTERM ends in one line: the
workers finish their step, write the checkpoint and exit 0, and so does the
launcher, instead of torchrun's ``SignalException`` traceback.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from elmo_pretrain.config import parse_override
from elmo_pretrain.run_dir import LAUNCH_FILE
from elmo_service.atomic import write_json


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


def launch_local(nproc: int, train_argv: list[str]) -> int:
    """Run ``elmo-pretrain train TRAIN_ARGV`` in ``nproc`` processes (DDP) on this machine.

    Returns 0 when the workers finished, or stopped cleanly on SIGTERM/SIGINT (their
    checkpoint written); a worker's failure is one line with its exit code.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # torchrun's agent logs each step of a shutdown as a warning; the workers say what matters
    # (its loggers set their own levels, so each is quietened by name)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    args = parse_args(
        [
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "elmo_pretrain.cli",
            "train",
            *train_argv,
        ]
    )
    try:
        run(args)
    except SignalException as e:
        # the agent has sent the workers SIGTERM and waited for them: each finished its step
        # and wrote the checkpoint (`--resume` continues)
        name = signal.Signals(e.sigval).name
        print(f"elmo-pretrain train: stopped by {name}; --resume continues", file=sys.stderr)
        return 0
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode == 2:  # an error the user can fix: rank 0 has said it in one line
            return 2
        print(
            f"elmo-pretrain train: worker {rank} failed with exit code {failure.exitcode}",
            file=sys.stderr,
        )
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0
