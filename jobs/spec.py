"""What a client submits (``POST /v1/jobs``) and how it is checked before anything runs.

Every rejection names the field: ``corpus`` for a path that is missing or
leaves the data folder, ``config.<section>.<key>`` for a training-config error
(the trainer's own validation, :func:`pretrain.config.TrainConfig.from_dict`),
``budget.*`` / ``prepare.*`` / ``name`` through pydantic.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from elmo_service.config import BiLMConfig
from elmo_service.errors import ConfigError, InputError
from elmo_service.names import MODEL_NAME

NAME_PATTERN = f"^{MODEL_NAME.pattern}$"  # the artifact's folder: one rule for every model name
PREPARED_FORMAT = "elmo-pretrain-corpus"
# directory corpora are walked to find symlinks that leave the data folder; bounded
MAX_CORPUS_ENTRIES = 100_000
_BILM_FIELDS = {f.name for f in dataclasses.fields(BiLMConfig)}


class PrepareIn(BaseModel):
    """Options of ``elmo-pretrain prepare`` (used when the corpus is raw text)."""

    model_config = ConfigDict(extra="forbid", strict=True)  # no coercion: "5" is not 5

    tokenizer: Literal["sentencepiece", "word"] = "sentencepiece"
    vocab_size: int = Field(16000, ge=4, le=2_000_000)
    sp_model_type: Literal["unigram", "bpe", "char", "word"] = "unigram"
    byte_fallback: bool = True
    character_coverage: float = Field(0.9995, gt=0, le=1)
    split: Literal["paragraphs", "lines", "none"] = "paragraphs"
    pretokenized: bool = False
    lowercase: bool = False
    dedupe: bool = True
    heldout_fraction: float = Field(0.01, ge=0, lt=0.5)
    max_sentence_words: int = Field(250, ge=1)

    def cli_args(self) -> list[str]:
        a = ["--tokenizer", self.tokenizer, "--vocab-size", str(self.vocab_size)]
        a += ["--sp-model-type", self.sp_model_type, "--split", self.split]
        a += ["--character-coverage", repr(self.character_coverage)]
        a += ["--heldout-fraction", repr(self.heldout_fraction)]
        a += ["--max-sentence-words", str(self.max_sentence_words)]
        flags = {
            "--no-byte-fallback": not self.byte_fallback,
            "--pretokenized": self.pretokenized,
            "--lowercase": self.lowercase,
            "--no-dedupe": not self.dedupe,
        }
        return a + [f for f, on in flags.items() if on]


class BudgetIn(BaseModel):
    """How long to train: ``train.steps`` and/or ``train.max_minutes`` (wins over ``config``)."""

    model_config = ConfigDict(extra="forbid", strict=True)  # no coercion: "5" is not 5

    steps: int | None = Field(None, ge=1, description="Optimizer steps in total.")
    max_minutes: float | None = Field(
        None, gt=0, description="Wall-clock limit; the run stops with a checkpoint and is exported."
    )


class JobIn(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
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
        "checkpoint) over the trainer's defaults. data.path is set by the job.",
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
    """The job's training config, validated by the trainer's own loader (no data yet).

    ConfigError names ``config.<section>.<key>`` (the trainer's field, prefixed).
    """
    from pretrain.config import TrainConfig

    raw = copy.deepcopy(job.config)
    data = raw.get("data")
    if isinstance(data, dict) and "path" in data:
        raise ConfigError(
            "config.data.path: set by the job (the corpus is given as 'corpus')",
            field="config.data.path",
        )
    train = raw.get("train")
    if job.budget.steps is not None or job.budget.max_minutes is not None:
        if train is None:
            train = raw["train"] = {}
        if isinstance(train, dict):
            if job.budget.steps is not None:
                train["steps"] = job.budget.steps
            if job.budget.max_minutes is not None:
                train["max_minutes"] = job.budget.max_minutes
    if isinstance(raw.get("data", {}), dict):
        raw.setdefault("data", {})["path"] = "<prepared corpus>"
    try:
        cfg = TrainConfig.from_dict(raw)
    except ConfigError as e:
        key = e.field or ""
        msg = e.message.removeprefix(f"{key}: ") if key else e.message
        if key in _BILM_FIELDS:  # the network's own checks name the bare key
            key = f"model.{key}"
        field = f"config.{key}" if key else "config"
        raise ConfigError(f"{field}: {msg}", field=field) from e
    out = cfg.to_dict()
    out["train"]["progress"] = False  # no tqdm bar in a log file
    return out
