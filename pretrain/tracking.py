"""Where the trainer's metrics go: ``metrics.jsonl``, and TensorBoard when it is installed.

The trainer writes one JSON record a line (training windows, held-out
evaluations), and ends each training segment (a run, or one resume of it) with a
stop record, :func:`stop_record`: why it stopped, as data for the job runner. :class:`MetricsLog` is that file, and also mirrors each
record's numbers as TensorBoard scalars under ``RUN_DIR/tensorboard/``
(``tensorboard --logdir runs/``) when the ``tensorboard`` package is there
(``pip install 'elmo-service[tensorboard]'``); without it, or with
``ELMO_TENSORBOARD=0``, it is the plain file. Rank 0 only, like the file.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

from elmo_pretrain.run_dir import METRICS_FILE, TB_DIR

STOP_EVENT = "stop"
# why a training segment ended: train.steps reached; the caller's stop_after steps;
# train.max_minutes; SIGTERM/SIGINT (here or on another DDP rank); a non-finite loss,
# gradient norm or weights (nothing saved from that step on); an exception
STOP_REASONS = ("finished", "stop_after", "max_minutes", "signal", "diverged", "error")

# metrics.jsonl key -> TensorBoard tag (training windows)
TRAIN_TAGS = {
    "loss": "train/loss",
    "ppl": "train/perplexity",
    "loss_fwd": "train/loss_forward",
    "loss_bwd": "train/loss_backward",
    "lr": "train/learning_rate",
    "tok_s": "train/tokens_per_s",
    "grad_norm": "train/grad_norm",
}


def stop_record(
    reason: str, step: int, tokens_seen: int, detail: str, **extra: Any
) -> dict[str, Any]:
    """``{"event": "stop", "reason": ..., "step": ..., ...}``; ``detail`` is the log line's words."""
    if reason not in STOP_REASONS:
        raise ValueError(f"stop reason {reason!r} is not one of {STOP_REASONS}")
    return {
        "event": STOP_EVENT,
        "reason": reason,
        "step": step,
        "tokens_seen": tokens_seen,
        "detail": detail,
        **extra,
    }


def json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by None: JSON has no NaN or Infinity
    (``json.dumps`` would write bare ``NaN`` literals that strict readers refuse)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def dumps(rec: Any) -> str:
    """One JSON line with non-finite figures as null."""
    return json.dumps(json_safe(rec), allow_nan=False)


def is_stop(rec: Any) -> bool:
    return isinstance(rec, dict) and rec.get("event") == STOP_EVENT


def summary_writer(log_dir: Path, purge_step: int | None = None) -> Any | None:
    """A torch SummaryWriter, or None when TensorBoard is not installed or turned off."""
    if os.environ.get("ELMO_TENSORBOARD", "1").lower() in ("0", "false", "no", "off"):
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch raises this when the tensorboard package is missing
        return None
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)


class MetricsLog:
    """A file-like ``metrics.jsonl`` (append) that also writes TensorBoard scalars."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        path = self.run_dir / METRICS_FILE
        if not path.is_file() or path.stat().st_size == 0:
            # a fresh log (a new run, or --force over an old one): TensorBoard starts over too
            shutil.rmtree(self.run_dir / TB_DIR, ignore_errors=True)
        self.file = open(path, "a")  # noqa: SIM115 - closed in close()
        self.tb: Any | None = None
        self._tb_tried = False

    def write(self, text: str) -> int:
        n = self.file.write(text)
        for line in text.splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int) and not is_stop(rec):
                self._scalars(rec)
        return n

    def _scalars(self, rec: dict[str, Any]) -> None:
        step = rec["step"]
        if not self._tb_tried:
            # opened at the first record: after a resume, events the stopped run logged from
            # this step on (past its last checkpoint) are dropped, as the run redoes them
            self._tb_tried = True
            self.tb = summary_writer(self.run_dir / TB_DIR, purge_step=step)
        if self.tb is None:
            return
        for key, tag in TRAIN_TAGS.items():
            if isinstance(rec.get(key), int | float):
                self.tb.add_scalar(tag, rec[key], step)
        for key, value in (rec.get("heldout") or {}).items():
            if key.endswith(("_ppl", "_nll")) and isinstance(value, int | float):
                self.tb.add_scalar(f"heldout/{key}", value, step)

    def record(self, rec: dict[str, Any]) -> None:
        """One record, flushed (a reader follows the file while training runs); non-finite
        figures are written as null."""
        self.write(dumps(rec) + "\n")
        self.flush()

    def flush(self) -> None:
        self.file.flush()
        if self.tb is not None:
            self.tb.flush()

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
