"""The options of `elmo-pretrain adapt` (its CLI flags and a job's ``adapt``) and the
training config they make, apart from the adaptation itself (``pretrain/adapt.py``) so
that the jobs API checks a job without importing the trainer."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from elmo_pretrain.config import TrainConfig
from elmo_service.bilm.config import BiLMConfig
from elmo_service.errors import ElmoServiceError, InputError
from elmo_service.settings_base import StrictModel

HELDOUT_FILE = "heldout.txt"  # in an artifact: held-out text to measure forgetting on
ADAPT_FILE = "adapt.json"  # in the work folder: the start, the options, the "before" figures


class AdaptOptions(StrictModel):
    """Options of ``elmo-pretrain adapt`` (its flags are derived from these fields), sized
    for a CPU: a few hundred steps of ~2k tokens at a low learning rate after a warm-up."""

    error_class: ClassVar[type[ElmoServiceError]] = InputError

    steps: int = Field(300, ge=1, description="optimizer steps (the learning-rate schedule's end)")
    max_minutes: float = Field(
        30.0, ge=0, description="stop (checkpoint, export) after this many minutes; 0: no limit"
    )
    lr: float = Field(1e-4, gt=0, description="Adam's peak learning rate (low: keep what it knows)")
    warmup_steps: int = Field(30, ge=0, description="linear warm-up from 0 to lr")
    tokens_per_batch: int = Field(2000, ge=16, description="tokens per step")
    n_samples: int = Field(
        2048, ge=1, description="sampled-softmax negatives (a full softmax below this vocabulary)"
    )
    heldout_fraction: float = Field(
        0.05, gt=0, lt=0.5, description="share of CORPUS's sentences held out (never trained)"
    )
    split: Literal["paragraphs", "lines", "none"] = Field(
        "paragraphs",
        description="how CORPUS is cut (prepare's --split): paragraphs (blank-line separated), "
        "lines (each line running text), none (one sentence a line)",
    )
    word_vocab_size: int = Field(
        50_000, ge=4, description="word-tokenized models: the softmax's size from CORPUS's words"
    )
    forgetting_text: str | None = Field(
        None,
        description="a text file (one sentence a line) to measure forgetting on "
        f"(default: MODEL/{HELDOUT_FILE} if it ships one)",
    )
    ship_heldout: bool = Field(
        False, description=f"write the held-out slice to NEW_MODEL/{HELDOUT_FILE} (it is your text)"
    )
    checkpoint_every_steps: int = Field(100, ge=0, description="checkpoint every N steps")
    checkpoint_every_minutes: float = Field(5.0, ge=0, description="checkpoint every N minutes")
    seed: int = 1234
    threads: int = Field(0, ge=0, description="torch threads (0: all cores)")
    precision: Literal["fp32", "bf16", "auto"] = Field("fp32", description="training precision")
    work_dir: str | None = Field(
        None, description="corpus, checkpoints and metrics (default: runs/adapt/NEW_MODEL's name)"
    )
    progress: bool = Field(True, description="progress bar with ETA")


# the options a job's ``adapt`` may set: no paths, nothing about the worker's machine
# (steps and max_minutes come from the job's ``budget``)
JOB_FIELDS = (
    "lr",
    "warmup_steps",
    "tokens_per_batch",
    "n_samples",
    "heldout_fraction",
    "split",
    "word_vocab_size",
    "seed",
    "threads",
    "precision",
    "checkpoint_every_steps",
    "checkpoint_every_minutes",
)


def train_config_for(model: BiLMConfig, corpus_dir: str | Path, opts: AdaptOptions) -> TrainConfig:
    """The trainer's config for adapting a model of shape ``model`` (the jobs API checks it
    at submit, as for a training job)."""
    return TrainConfig.from_dict(
        {
            "model": model.to_dict(),
            "data": {"path": str(corpus_dir), "tokens_per_batch": opts.tokens_per_batch},
            "softmax": {"kind": "sampled", "n_samples": opts.n_samples},
            "optim": {
                "name": "adam",
                "lr": opts.lr,
                "warmup_steps": opts.warmup_steps,
                "decay": "cosine",
                "clip_norm": 1.0,
            },
            "train": {
                "steps": opts.steps,
                "max_minutes": opts.max_minutes,
                "seed": opts.seed,
                "device": "cpu",
                "precision": opts.precision,
                "threads": opts.threads,
                "eval_every": 0,
                "progress": opts.progress,
            },
            "checkpoint": {
                "every_steps": opts.checkpoint_every_steps,
                "every_minutes": opts.checkpoint_every_minutes,
            },
        }
    )
