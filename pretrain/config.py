"""The training configuration: nested strict models, loaded from YAML.

    TrainConfig
      model:      elmo_service.bilm.config.BiLMConfig (the network's shape)
      data:       where the prepared corpus lives, batch geometry
      softmax:    full | sampled | adaptive (training only; eval is always exact)
      optim:      adam | adamw | adagrad, clipping, warm-up and decay
      train:      run length, precision, compile, threads, directions, logging
      checkpoint: cadence and retention

Every key in the YAML file and every ``--set a.b=value`` override must name a
field; anything else is a ConfigError naming the dotted key (with a
did-you-mean hint) before any work starts (:mod:`elmo_service.settings_base`). ``config_hash``
identifies a run: it covers everything that changes the numbers a run
produces and leaves out what only changes how long or how loudly it runs
(``RESUMABLE_KEYS``), so that a resumed run may be extended.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import Field, model_validator

from elmo_service.bilm.config import PRECISIONS, BiLMConfig
from elmo_service.errors import ConfigError
from elmo_service.settings_base import StrictModel, Tuple, need

OPTIMIZERS = ("adam", "adamw", "adagrad", "sgd")
DECAYS = ("none", "linear", "cosine", "inverse_sqrt", "plateau")


class DataConfig(StrictModel):
    """Where the prepared corpus lives, and the batch geometry."""

    path: str = Field("data/prepared", description="output folder of `elmo-pretrain prepare`")
    mode: Literal["sentences", "stream"] = Field(
        "sentences",
        description="sentences: whole sentences from a zero state (what serving computes); "
        "stream: bilm-tf / Kim et al.: windows of a token stream, LSTM state carried across windows",
    )
    # stream mode
    rows: int = Field(
        20, ge=1, description="stream: parallel rows per process (bilm-tf: 128, Kim et al.: 20)"
    )
    unroll: int = Field(
        20,
        ge=1,
        description="stream: tokens per window, the truncated BPTT length "
        "(bilm-tf: 20, PTB literature: 35)",
    )
    reset_prob: float = Field(
        0.0, ge=0, le=1, description="stream: probability of zeroing the state at a sentence start"
    )
    shuffle: bool = Field(
        True,
        description="shuffle sentence order each epoch (False: the corpus order, as PTB work)",
    )
    # sentence mode
    tokens_per_batch: int = Field(
        1280, description="sentences: per process, B = tokens_per_batch // T_padded"
    )
    max_tokens: int = Field(
        64,
        ge=3,
        description="sentences: longest training sentence, markers included (>= 3: markers + "
        "one token); longer ones are skipped",
    )
    pad_multiple: int = Field(
        16, ge=1, description="pad T up to a multiple: few distinct shapes for torch.compile"
    )
    bucket_pool: int = Field(
        64, ge=1, description="batches shuffled together within a length bucket pool"
    )

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        need(
            self.tokens_per_batch >= self.max_tokens,
            "tokens_per_batch",
            "must be >= data.max_tokens",
        )
        return self


class SoftmaxConfig(StrictModel):
    """Training only: evaluation is always the exact softmax."""

    kind: Literal["full", "sampled", "adaptive"] = Field("sampled", description="the LM's softmax")
    n_samples: int = Field(
        8192, ge=1, description="sampled: negatives per batch (log-uniform, unique)"
    )
    cutoffs: Annotated[tuple[int, ...], Tuple] = Field(
        (2000, 10000), description="adaptive: frequency-sorted class boundaries"
    )
    div_value: float = Field(4.0, description="adaptive: each tail cluster's width shrinks by this")

    @model_validator(mode="after")
    def _check(self) -> SoftmaxConfig:
        need(list(self.cutoffs) == sorted(set(self.cutoffs)), "cutoffs", "must increase")
        return self


class OptimConfig(StrictModel):
    """Optimizer, clipping, warm-up and decay."""

    name: Literal[OPTIMIZERS] = Field("adam", description="the optimizer")  # type: ignore[valid-type]
    lr: float = Field(
        1e-3,
        gt=0,
        description="peak learning rate (bilm-tf with adagrad: 0.2; Kim et al. with sgd: 1.0)",
    )
    betas: Annotated[tuple[float, float], Tuple] = Field((0.9, 0.999), description="adam(w)")
    eps: float = Field(1e-8, description="adam(w)")
    weight_decay: float = 0.0
    adagrad_init_acc: float = Field(1.0, description="bilm-tf's initial accumulator value")
    clip_norm: float = Field(10.0, ge=0, description="global gradient norm; 0 disables")
    loss_reduction: Literal["mean", "sum_over_time"] = Field(
        "mean",
        description="mean: loss = mean NLL per prediction; sum_over_time: summed over each "
        "row's steps and averaged over rows, the PTB literature's convention that its SGD "
        "learning rates assume",
    )
    init_range: float = Field(
        0.0,
        ge=0,
        description="r > 0: every parameter starts uniform in [-r, r] (Zaremba et al. 2014, Kim "
        "et al. 2016: 0.05); 0: each module's own initialisation",
    )
    highway_gate_bias: float | None = Field(
        None,
        description="added to the highway gates' initial bias, after init_range (bilm-tf "
        "and Kim et al. 2016: -2, so each layer starts out carrying its input); null: the "
        "module's own initialisation",
    )
    warmup_steps: int = Field(0, ge=0, description="linear warm-up from 0")
    decay: Literal[DECAYS] = Field("cosine", description="learning-rate schedule after warm-up")  # type: ignore[valid-type]
    min_lr_ratio: float = Field(
        0.1, ge=0, le=1, description="linear/cosine decay ends at lr * min_lr_ratio"
    )
    plateau_factor: float = Field(
        0.5,
        gt=0,
        le=1,
        description="plateau (Kim et al. 2016): after each epoch, multiply lr by this when the "
        "held-out perplexity fell by less than plateau_threshold",
    )
    plateau_threshold: float = Field(1.0, ge=0, description="plateau: see plateau_factor")
    nonfinite: Literal["stop", "skip"] = Field(
        "stop",
        description="a non-finite loss or gradient norm: stop (exit 2, the last good checkpoint "
        "kept), or skip that update and multiply the lr by nonfinite_factor (stopping after "
        "nonfinite_max_skips in a row)",
    )
    nonfinite_factor: float = Field(0.5, gt=0, lt=1, description="skip: lr multiplier per skip")
    nonfinite_max_skips: int = Field(
        5, ge=1, description="skip: consecutive skipped updates before the run stops"
    )


class TrainSection(StrictModel):
    """Run length, precision, compile, threads, directions, logging."""

    steps: int = Field(
        1000, ge=1, description="optimizer steps in total (a resumed run may raise it)"
    )
    max_minutes: float = Field(
        0.0, ge=0, description="stop (with a checkpoint) after this wall time; 0 = no limit"
    )
    seed: int = 1234
    directions: Literal["both", "forward"] = Field(
        "both", description="both: biLM loss (mean of the two); forward: forward LM only"
    )
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    precision: Literal[PRECISIONS] = Field(  # type: ignore[valid-type]
        "auto", description="auto: bf16 where native, else fp32 | fp32 | bf16 | fp16 (CUDA AMP)"
    )
    compile: bool = Field(False, description="torch.compile the model")
    threads: int = Field(
        0, ge=0, description="intra-op threads per process; 0 = all cores / world size"
    )
    log_every: int = Field(10, ge=1, description="steps between metrics-log lines")
    eval_every: int = Field(
        0, ge=0, description="steps between held-out evaluations; 0 = only at the end"
    )
    eval_max_sentences: int = Field(
        2000, ge=0, description="cap for the periodic held-out check (export evaluates all)"
    )
    progress: bool = Field(True, description="tqdm bar on rank 0")


class CheckpointConfig(StrictModel):
    """Cadence and retention."""

    every_steps: int = Field(500, ge=0, description="0 = never by step count")
    every_minutes: float = Field(15.0, ge=0, description="0 = never by time")
    keep: int = Field(3, ge=1, description="newest checkpoints kept")


class TrainConfig(StrictModel):
    """The whole training configuration: ``configs/*.yaml`` and a job's ``config``."""

    model: BiLMConfig = Field(default_factory=BiLMConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    softmax: SoftmaxConfig = Field(default_factory=SoftmaxConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainSection = Field(default_factory=TrainSection)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)

    @model_validator(mode="after")
    def _bytes_only(self) -> TrainConfig:
        # the trainer reads UTF-8 bytes; a lexicon's characters and words are for
        # imported ELMoForManyLangs models (elmo_service/bilm/lexicon.py)
        for key in ("char_vocab_size", "word_dim"):
            if getattr(self.model, key):
                raise ConfigError(
                    f"model.{key}: training reads UTF-8 bytes; a character or word lexicon "
                    "comes only with an imported ELMoForManyLangs model",
                    field=f"model.{key}",
                )
        return self


# keys that change only how long a run goes or how it reports; a resumed run may change them
RESUMABLE_KEYS = frozenset(
    {
        "train.steps",
        "train.max_minutes",
        "train.threads",
        "train.log_every",
        "train.eval_every",
        "train.eval_max_sentences",
        "train.progress",
        "train.compile",
        "checkpoint.every_steps",
        "checkpoint.every_minutes",
        "checkpoint.keep",
        "data.path",
        # what to do about a non-finite step: a resumed run may switch to skipping
        "optim.nonfinite",
        "optim.nonfinite_factor",
        "optim.nonfinite_max_skips",
    }
)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


# options added after runs existed: left out of the hash at these values, so older runs keep theirs
_LATER_DEFAULTS = {
    "data.mode": "sentences",
    "data.rows": 20,
    "data.unroll": 20,
    "data.reset_prob": 0.0,
    "data.shuffle": True,
    "optim.plateau_factor": 0.5,
    "optim.plateau_threshold": 1.0,
    "optim.loss_reduction": "mean",
    "optim.init_range": 0.0,
    "optim.highway_gate_bias": None,
    "model.dropout_tokens": True,
    "model.lstm_projection": True,
    # ELMoForManyLangs' lexicon fields (elmo_service.bilm.config.LEXICON_DEFAULTS)
    "model.char_vocab_size": None,
    "model.word_dim": 0,
    "model.word_vocab_size": 0,
}


def config_hash(cfg: TrainConfig) -> str:
    flat = {
        k: v
        for k, v in flatten(cfg.to_dict()).items()
        if k not in RESUMABLE_KEYS and not (k in _LATER_DEFAULTS and _LATER_DEFAULTS[k] == v)
    }
    return hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()[:16]


def diff_configs(a: TrainConfig, b: TrainConfig) -> dict[str, tuple[Any, Any]]:
    fa, fb = flatten(a.to_dict()), flatten(b.to_dict())
    return {k: (fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)}


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"optim.lr=0.2"`` -> (["optim", "lr"], 0.2); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"--set expects key=value, got {text!r}", field=text)
    key, raw = text.split("=", 1)
    try:
        value = yaml.load(raw, Loader=_UniqueKeyLoader) if raw.strip() else ""  # noqa: S506
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {key}: cannot parse value {raw!r}: {e}", field=key) from e
    return key.strip().split("."), value


def apply_overrides(d: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``--set`` overrides to a raw config dict; unknown keys fail in ``from_dict``."""
    d = json.loads(json.dumps(d))
    for text in overrides:
        path, value = parse_override(text)
        node = d
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(
                    f"--set {'.'.join(path)}: {part} is not a section", field=".".join(path)
                )
        node[path[-1]] = value
    return d


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: str, line: int) -> None:
        super().__init__(f"key {key!r} appears twice (again on line {line})")
        self.key = key


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a repeated key: plain YAML keeps the last one silently,
    so a pasted second ``optim:`` section would drop the first without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise _DuplicateKey(str(key), key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep)


# YAML 1.1 (PyYAML) reads ``1e-3`` and ``1e30`` as strings, which the strict config then
# refuses as a float; accept them as YAML 1.2 does
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> TrainConfig:
    """YAML file (or defaults when ``path`` is None) plus ``--set`` overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} not found", field="config")
        try:
            raw = yaml.load(p.read_text(), Loader=_UniqueKeyLoader) or {}  # noqa: S506 (safe)
        except _DuplicateKey as e:
            raise ConfigError(f"{p}: {e}", field=e.key) from e
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}", field="config") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: the top level must be a mapping", field="config")
    return TrainConfig.from_dict(apply_overrides(raw, overrides or []))


def dump_config(cfg: TrainConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=None)
