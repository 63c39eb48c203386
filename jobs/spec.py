"""What a client submits (``POST /v1/jobs``) and how it is checked before anything runs.

Every rejection names the field: ``corpus`` for a path that is missing or
leaves the data folder, ``config.<section>.<key>`` for a training-config error
(the trainer's own validation, :func:`pretrain.config.TrainConfig.from_dict`),
``budget.*`` / ``prepare.*`` / ``name`` through pydantic. ``prepare`` takes the fields of
the CLI's :class:`pretrain.prepare.PrepareOptions` that a job may set.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import ConfigDict, Field, create_model

from elmo_service.errors import ConfigError, InputError
from elmo_service.names import MODEL_NAME
from elmo_service.settings_base import StrictModel, to_argv
from pretrain.prepare import FORMAT as PREPARED_FORMAT
from pretrain.prepare import JOB_FIELDS, PrepareOptions

NAME_PATTERN = f"^{MODEL_NAME.pattern}$"  # the artifact's folder: one rule for every model name
# directory corpora are walked to find symlinks that leave the data folder; bounded
MAX_CORPUS_ENTRIES = 100_000


class _PrepareBase(StrictModel):
    """What :data:`PrepareIn` adds to its fields (taken from :class:`PrepareOptions`)."""

    def cli_args(self) -> list[str]:
        """The ``elmo-pretrain prepare`` flags that set these options."""
        return to_argv(self)


# A job's ``prepare``: the job-settable fields of the CLI's own PrepareOptions, declared
# there once (type, default, bounds, description); no paths, nothing about the worker.
PrepareIn = create_model(
    "PrepareIn",
    __base__=_PrepareBase,
    __doc__="Options of ``elmo-pretrain prepare`` (used when the corpus is raw text).",
    **{
        n: (PrepareOptions.model_fields[n].annotation, PrepareOptions.model_fields[n])
        for n in JOB_FIELDS
    },  # type: ignore[call-overload]
)


class BudgetIn(StrictModel):
    """How long to train: ``train.steps`` and/or ``train.max_minutes`` (wins over ``config``)."""

    steps: int | None = Field(None, ge=1, description="Optimizer steps in total.")
    max_minutes: float | None = Field(
        None, gt=0, description="Wall-clock limit; the run stops with a checkpoint and is exported."
    )


class JobIn(StrictModel):
    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "name": "elmo-tiny",
                    "corpus": "corpora/book.txt",
                    "config": {
                        "model": {"lstm_dim": 32, "projection_dim": 16, "n_layers": 2},
                        "softmax": {"kind": "sampled", "n_samples": 64},
                        "train": {"precision": "fp32", "threads": 1},
                    },
                    "budget": {"steps": 200},
                    "prepare": {"vocab_size": 300, "byte_fallback": False},
                }
            ]
        },
    )

    name: str | None = Field(
        None,
        pattern=NAME_PATTERN,
        description="Artifact name in the models folder (default: the job id).",
    )
    corpus: str = Field(
        ...,
        description="Inside the data folder (ELMO_DATA_DIR): a text file, a folder of text "
        "files, or a corpus folder already made by `elmo-pretrain prepare`.",
    )
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="Training config (as configs/*.yaml: model, data, softmax, optim, train, "
        "checkpoint) over the trainer's defaults, checked by the trainer's own model "
        "(pretrain.config.TrainConfig). data.path is set by the job.",
    )
    budget: BudgetIn = Field(default_factory=BudgetIn)
    prepare: PrepareIn = Field(default_factory=PrepareIn)


def resolve_corpus(data_dir: Path, corpus: str) -> Path:
    """``corpus`` as a real path inside ``data_dir``; InputError(field="corpus") otherwise.

    Refuses absolute paths, ``..``, glob characters and anything whose real path
    (symlinks resolved, including every entry of a folder) leaves the data folder.
    """

    def bad(msg: str) -> InputError:
        return InputError(f"corpus: {msg}", field="corpus")

    if not corpus or "\x00" in corpus or "\\" in corpus:
        raise bad("must be a path relative to the data folder")
    p = PurePosixPath(corpus)
    if p.is_absolute() or corpus.startswith("~"):
        raise bad("must be relative to the data folder, not an absolute path")
    if ".." in p.parts:
        raise bad("'..' is not allowed")
    if any(c in corpus for c in "*?["):
        raise bad("glob patterns are not allowed; give a file or a folder")
    root = Path(data_dir).resolve()
    path = (root / p).resolve()
    if not path.is_relative_to(root):
        raise bad("resolves outside the data folder (symlink)")
    if not path.exists():
        raise bad(f"{corpus!r} not found in the data folder")
    if path.is_dir():
        seen = 0
        for top, dirs, files in os.walk(path):
            for name in dirs + files:
                seen += 1
                if seen > MAX_CORPUS_ENTRIES:
                    raise bad(f"folder holds more than {MAX_CORPUS_ENTRIES} entries")
                entry = Path(top) / name
                if entry.is_symlink() and not entry.resolve().is_relative_to(root):
                    raise bad(f"{entry.relative_to(root)} links outside the data folder")
    return path


def is_prepared_corpus(path: Path) -> bool:
    manifest = path / "manifest.json"
    if not (path.is_dir() and manifest.is_file()):
        return False
    try:
        return json.loads(manifest.read_text()).get("format") == PREPARED_FORMAT
    except (OSError, ValueError):
        return False


def softmax_size(corpus: Path, job: JobIn) -> tuple[int, str]:
    """The job's softmax size and the field that sets it: a prepared corpus's own, else
    ``prepare.vocab_size`` (an upper bound: a small corpus may give fewer pieces)."""
    if is_prepared_corpus(corpus):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            v = json.loads((corpus / "manifest.json").read_text())["vocab"]["softmax_size"]
            return int(v), "corpus"
    return job.prepare.vocab_size, "prepare.vocab_size"


def resolve_train_config(job: JobIn) -> dict[str, Any]:
    """The job's training config, validated by the trainer's own model (no data yet).

    ConfigError names ``config.<section>.<key>`` (the trainer's dotted field, prefixed).
    """
    from pretrain.config import TrainConfig

    raw = dict(job.config)
    if isinstance(raw.get("data"), dict) and "path" in raw["data"]:
        raise ConfigError(
            "config.data.path: set by the job (the corpus is given as 'corpus')",
            field="config.data.path",
        )
    budget = job.budget.model_dump(exclude_none=True)  # wins over config's train.*
    if budget and isinstance(raw.setdefault("train", {}), dict):
        raw["train"] = {**raw["train"], **budget}
    cfg = TrainConfig.from_dict(raw, prefix="config.")
    cfg.data.path = "<prepared corpus>"
    cfg.train.progress = False  # no tqdm bar in a log file
    return cfg.to_dict()
