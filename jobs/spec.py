"""What a client submits (``POST /v1/jobs``) and how it is checked before anything runs.

Every rejection names the field: ``corpus`` for a path that is missing or
leaves the data folder, ``config.<section>.<key>`` for a training-config error
(the trainer's own validation, :func:`elmo_pretrain.config.TrainConfig.from_dict`),
``budget.*`` / ``prepare.*`` / ``name`` through pydantic. ``prepare`` takes the fields of
the CLI's :class:`elmo_pretrain.prepare.PrepareOptions` that a job may set.

A job that names a ``base_model`` adapts that model to the corpus instead of training
from random weights (``elmo-pretrain adapt``): its shape and tokenizer are the base model's,
so ``config`` and ``prepare`` stay empty and ``adapt`` takes the fields of
:class:`elmo_pretrain.adapt.AdaptOptions` that a job may set.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import ConfigDict, Field, create_model

from elmo_pretrain.adapt_options import JOB_FIELDS as ADAPT_JOB_FIELDS
from elmo_pretrain.adapt_options import AdaptOptions, train_config_for
from elmo_pretrain.prepare import FORMAT as PREPARED_FORMAT
from elmo_pretrain.prepare import JOB_FIELDS, PrepareOptions
from elmo_service.errors import ArtifactError, ConfigError, InputError
from elmo_service.settings_base import MODEL_NAME, StrictModel, to_argv

NAME_PATTERN = f"^{MODEL_NAME.pattern}$"  # the artifact's folder: one rule for every model name
# directory corpora are walked to find symlinks that leave the data folder; bounded
MAX_CORPUS_ENTRIES = 100_000
NAME_MAX, PATH_MAX = 255, 4096  # bytes, Linux's limits: longer raises ENAMETOOLONG deep in os
# the longest sentence a job's model may accept (the embedder's guard); serving caps
# requests lower (ELMO_MAX_TOKENS_PER_SENTENCE), this keeps a config from asking 10^7
MAX_SENTENCE_TOKENS = 8192


class _CliOptions(StrictModel):
    """What :data:`PrepareIn` and :data:`AdaptIn` add to the fields they take from the CLI's
    options (:class:`PrepareOptions`, :class:`AdaptOptions`)."""

    def cli_args(self) -> list[str]:
        """The ``elmo-pretrain prepare | adapt`` flags that set these options."""
        return to_argv(self)


def _job_fields(model: type[StrictModel], names: tuple[str, ...]) -> dict[str, Any]:
    return {n: (model.model_fields[n].annotation, model.model_fields[n]) for n in names}


# A job's ``prepare``: the job-settable fields of the CLI's own PrepareOptions, declared
# there once (type, default, bounds, description); no paths, nothing about the worker.
PrepareIn = create_model(
    "PrepareIn",
    __base__=_CliOptions,
    __doc__="Options of ``elmo-pretrain prepare`` (used when the corpus is raw text).",
    **_job_fields(PrepareOptions, JOB_FIELDS),  # type: ignore[call-overload]
)
# A job's ``adapt`` (with ``base_model``): the job-settable fields of AdaptOptions
AdaptIn = create_model(
    "AdaptIn",
    __base__=_CliOptions,
    __doc__="Options of ``elmo-pretrain adapt`` (used with ``base_model``).",
    **_job_fields(AdaptOptions, ADAPT_JOB_FIELDS),  # type: ignore[call-overload]
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
        "(elmo_pretrain.config.TrainConfig). data.path is set by the job.",
    )
    budget: BudgetIn = Field(default_factory=BudgetIn)
    prepare: PrepareIn = Field(default_factory=PrepareIn)
    base_model: str | None = Field(
        None,
        pattern=NAME_PATTERN,
        description="Continue pretraining this model of the models folder on `corpus` "
        "(domain adaptation, `elmo-pretrain adapt`) instead of training from random weights: "
        "its shape and tokenizer are kept, so `config` and `prepare` stay empty.",
    )
    adapt: AdaptIn = Field(  # type: ignore[valid-type]
        default_factory=AdaptIn,
        description="With `base_model`: learning rate, warm-up, held-out share, ... "
        "(`elmo-pretrain adapt`'s options; steps and minutes come from `budget`).",
    )


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
    if len(corpus.encode("utf-8", "surrogateescape")) > PATH_MAX:
        raise bad(f"longer than {PATH_MAX} bytes")
    for part in p.parts:
        if len(part.encode("utf-8", "surrogateescape")) > NAME_MAX:
            raise bad(f"path component {part[:32]!r}... is longer than {NAME_MAX} bytes")
    root = Path(data_dir).resolve()
    try:
        path = (root / p).resolve()
        if not path.is_relative_to(root):
            raise bad("resolves outside the data folder (symlink)")
        if not path.exists():
            raise bad(f"{corpus!r} not found in the data folder")
        if path.is_dir():
            _check_folder(path, root, bad)
    except OSError as e:  # e.g. EACCES, ENAMETOOLONG through a symlink: the user's path
        raise bad(f"cannot be read: {e.strerror or e}") from None
    except RuntimeError:  # pathlib's word for a symlink loop (ELOOP)
        raise bad("is a symlink loop") from None
    return path


def _check_folder(path: Path, root: Path, bad: Callable[[str], InputError]) -> None:
    seen = 0
    for top, dirs, files in os.walk(path):
        for name in dirs + files:
            seen += 1
            if seen > MAX_CORPUS_ENTRIES:
                raise bad(f"folder holds more than {MAX_CORPUS_ENTRIES} entries")
            entry = Path(top) / name
            if entry.is_symlink() and not entry.resolve().is_relative_to(root):
                raise bad(f"{entry.relative_to(root)} links outside the data folder")


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


def resolve_train_config(job: JobIn, models_dir: Path | None = None) -> dict[str, Any]:
    """The job's training config, validated by the trainer's own model (no data yet).

    ConfigError names ``config.<section>.<key>`` (the trainer's dotted field, prefixed).
    A ``base_model`` job's is the adaptation's (its model read from ``models_dir``).
    """
    from elmo_pretrain.config import TrainConfig

    if job.base_model is not None:
        return _adapt_train_config(job, models_dir)

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


def adapt_options(job: JobIn) -> AdaptOptions:
    """A ``base_model`` job's :class:`AdaptOptions`: its ``adapt`` section and ``budget``."""
    budget = job.budget.model_dump(exclude_none=True)  # steps, max_minutes
    return AdaptOptions(**job.adapt.model_dump(), **budget, progress=False)


def _adapt_train_config(job: JobIn, models_dir: Path | None) -> dict[str, Any]:
    from elmo_service.artifact import read_header

    if job.config:
        raise ConfigError(
            "config: not used with base_model (the model's shape is base_model's); "
            "set the adaptation's options in 'adapt'",
            field="config",
        )
    if job.prepare.model_dump(exclude_defaults=True):
        raise ConfigError(
            "prepare: not used with base_model (the corpus is tokenized by base_model's "
            "tokenizer); set adapt.split / adapt.heldout_fraction",
            field="prepare",
        )
    if models_dir is None:
        raise ValueError("a base_model job is checked against the models folder")
    try:
        header = read_header(Path(models_dir) / str(job.base_model))
    except ArtifactError as e:
        raise InputError(
            f"base_model: no model {job.base_model!r} in the models folder ({e.message})",
            field="base_model",
        ) from e
    return train_config_for(header.config, "<prepared corpus>", adapt_options(job)).to_dict()


@dataclass(frozen=True)
class Limits:
    """What a worker can run: checked at submit (the settings, defaulting to the API
    machine's) and again by the worker that claims the job (its own cores and GPUs)."""

    max_threads: int
    max_steps: int
    gpus: int

    @classmethod
    def of_this_machine(cls, max_steps: int, max_threads: int | None = None,
                        gpus: int | None = None) -> Limits:  # fmt: skip
        return cls(
            max_threads=max_threads or machine_cores(),
            max_steps=max_steps,
            gpus=visible_gpus() if gpus is None else gpus,
        )


def machine_cores() -> int:
    """Cores this process may use (its CPU affinity; a cgroup quota lowers it)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with contextlib.suppress(OSError, ValueError):
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, int(quota) // int(period)))
    return n


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_limits(job: JobIn, cfg: dict[str, Any], limits: Limits) -> None:
    """Bounds the trainer's own config does not set: ConfigError naming the field.

    ``cfg`` is :func:`resolve_train_config`'s result (``train.steps`` already holds
    ``budget.steps`` when given, so the field named is the one the client set).
    """
    tr, ck, m = cfg["train"], cfg["checkpoint"], cfg["model"]

    def fail(field: str, msg: str) -> None:
        raise ConfigError(f"{field}: {msg}", field=field)

    steps_field = "budget.steps" if job.budget.steps is not None else "config.train.steps"
    if tr["steps"] > limits.max_steps:
        fail(steps_field, f"{tr['steps']} steps is over the quota of {limits.max_steps} "
                          "(ELMO_JOBS_MAX_STEPS)")  # fmt: skip
    if tr["threads"] > limits.max_threads:
        fail("config.train.threads", f"{tr['threads']} threads, but a worker has "
             f"{limits.max_threads} cores (ELMO_JOBS_MAX_THREADS); 0 = all of them")  # fmt: skip
    for field, v, least in (
        ("config.checkpoint.every_steps", ck["every_steps"], 0),
        ("config.checkpoint.every_minutes", ck["every_minutes"], 0),
        ("config.train.max_minutes", tr["max_minutes"], 0),
        ("config.train.eval_every", tr["eval_every"], 0),
        ("config.train.eval_max_sentences", tr["eval_max_sentences"], 0),  # 0 = all
    ):
        if v < least:
            fail(field, f"must be >= {least} (got {v})" + (" (0 = never)" if least == 0 else ""))
    if m["max_sentence_tokens"] > MAX_SENTENCE_TOKENS:
        fail("config.model.max_sentence_tokens",
             f"must be <= {MAX_SENTENCE_TOKENS} (got {m['max_sentence_tokens']})")  # fmt: skip
    check_device(tr["device"], limits.gpus, "config.train.device")


def check_device(device: str, gpus: int, field: str) -> None:
    if device in ("auto", "cpu"):
        return  # every worker has one
    got = re.fullmatch(r"cuda(?::(\d+))?", device)
    if got is None:
        raise ConfigError(f"{field}: {device!r}: must be auto, cpu, cuda or cuda:N", field=field)
    index = int(got.group(1) or 0)
    if index >= gpus:
        have = f"{gpus} CUDA device(s)" if gpus else "no CUDA device"
        raise ConfigError(
            f"{field}: {device!r}, but a worker has {have} (ELMO_JOBS_GPUS); use auto or cpu",
            field=field,
        )
