"""The training configuration: nested dataclasses, loaded from YAML.

    TrainConfig
      model:      elmo_service.config.BiLMConfig (the network's shape)
      data:       where the prepared corpus lives, batch geometry
      softmax:    full | sampled | adaptive (training only; eval is always exact)
      optim:      adam | adamw | adagrad, clipping, warm-up and decay
      train:      run length, precision, compile, threads, directions, logging
      checkpoint: cadence and retention

Every key in the YAML file and every ``--set a.b=value`` override must name a
field; anything else is a ConfigError before any work starts. ``config_hash``
identifies a run: it covers everything that changes the numbers a run
produces and leaves out what only changes how long or how loudly it runs
(``RESUMABLE_KEYS``), so that a resumed run may be extended.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from elmo_service.config import PRECISIONS, BiLMConfig
from elmo_service.errors import ConfigError

OPTIMIZERS = ("adam", "adamw", "adagrad", "sgd")
DECAYS = ("none", "linear", "cosine", "inverse_sqrt", "plateau")


@dataclass
class DataConfig:
    path: str = "data/prepared"  # output folder of `elmo-pretrain prepare`
    # sentences: whole sentences from a zero state (what serving computes);
    # stream: bilm-tf / Kim et al.: windows of a token stream, LSTM state carried across windows
    mode: str = "sentences"
    # stream mode
    rows: int = 20  # parallel rows of the stream per process (bilm-tf: 128, Kim et al.: 20)
    unroll: int = 20  # tokens per window: truncated BPTT length (bilm-tf: 20, PTB literature: 35)
    reset_prob: float = 0.0  # probability of zeroing the state at a sentence start
    shuffle: bool = True  # shuffle sentence order each epoch (False: the corpus order, as PTB work)
    # sentence mode
    tokens_per_batch: int = 1280  # per process: B = tokens_per_batch // T_padded
    max_tokens: int = 64  # longest training sentence, markers included; longer ones are skipped
    pad_multiple: int = 16  # pad T up to a multiple: few distinct shapes for torch.compile
    bucket_pool: int = 64  # batches shuffled together within a length bucket pool


@dataclass
class SoftmaxConfig:
    kind: str = "sampled"  # full | sampled | adaptive
    n_samples: int = 8192  # sampled: negatives per batch (log-uniform, unique)
    cutoffs: tuple[int, ...] = (2000, 10000)  # adaptive: frequency-sorted class boundaries
    div_value: float = 4.0  # adaptive


@dataclass
class OptimConfig:
    name: str = "adam"  # adam | adamw | adagrad | sgd
    lr: float = 1e-3  # bilm-tf with adagrad: 0.2; Kim et al. with sgd: 1.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    adagrad_init_acc: float = 1.0  # bilm-tf's initial accumulator value
    clip_norm: float = 10.0  # global gradient norm; 0 disables
    # mean: loss = mean NLL per prediction; sum_over_time: summed over each row's steps and
    # averaged over rows, the PTB literature's convention that its SGD learning rates assume
    loss_reduction: str = "mean"
    warmup_steps: int = 0
    decay: str = "cosine"  # none | linear | cosine | inverse_sqrt | plateau
    min_lr_ratio: float = 0.1  # linear/cosine decay ends at lr * min_lr_ratio
    # plateau (Kim et al. 2016): after each epoch, multiply lr by plateau_factor when the
    # held-out perplexity fell by less than plateau_threshold
    plateau_factor: float = 0.5
    plateau_threshold: float = 1.0


@dataclass
class TrainSection:
    steps: int = 1000  # optimizer steps in total (a resumed run may raise it)
    max_minutes: float = 0.0  # stop (with a checkpoint) after this wall time; 0 = no limit
    seed: int = 1234
    directions: str = "both"  # both: biLM loss (mean of the two); forward: forward LM only
    device: str = "auto"
    precision: str = "auto"  # auto: bf16 where native, else fp32 | fp32 | bf16 | fp16 (CUDA AMP)
    compile: bool = False
    threads: int = 0  # intra-op threads per process; 0 = all cores / world size
    log_every: int = 10  # steps between metrics-log lines
    eval_every: int = 0  # steps between held-out evaluations; 0 = only at the end
    eval_max_sentences: int = 2000  # cap for the periodic held-out check (export evaluates all)
    progress: bool = True  # tqdm bar on rank 0


@dataclass
class CheckpointConfig:
    every_steps: int = 500  # 0 = never by step count
    every_minutes: float = 15.0  # 0 = never by time
    keep: int = 3  # newest checkpoints kept


@dataclass
class TrainConfig:
    model: BiLMConfig = field(default_factory=BiLMConfig)
    data: DataConfig = field(default_factory=DataConfig)
    softmax: SoftmaxConfig = field(default_factory=SoftmaxConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"{name}: {msg}", field=name)

        self.model.validate()
        d, s, o, t, c = self.data, self.softmax, self.optim, self.train, self.checkpoint
        need(d.mode in ("sentences", "stream"), "data.mode", "sentences | stream")
        need(d.rows >= 1, "data.rows", "must be >= 1")
        need(d.unroll >= 1, "data.unroll", "must be >= 1")
        need(0.0 <= d.reset_prob <= 1.0, "data.reset_prob", "must be in [0, 1]")
        need(
            d.tokens_per_batch >= d.max_tokens,
            "data.tokens_per_batch",
            "must be >= data.max_tokens",
        )
        need(d.max_tokens >= 3, "data.max_tokens", "must be >= 3 (markers + one token)")
        need(d.pad_multiple >= 1, "data.pad_multiple", "must be >= 1")
        need(d.bucket_pool >= 1, "data.bucket_pool", "must be >= 1")
        need(s.kind in ("full", "sampled", "adaptive"), "softmax.kind", "full | sampled | adaptive")
        need(s.n_samples >= 1, "softmax.n_samples", "must be >= 1")
        need(list(s.cutoffs) == sorted(set(s.cutoffs)), "softmax.cutoffs", "must increase")
        need(o.name in OPTIMIZERS, "optim.name", " | ".join(OPTIMIZERS))
        need(o.lr > 0, "optim.lr", "must be positive")
        need(o.clip_norm >= 0, "optim.clip_norm", "must be >= 0")
        need(
            o.loss_reduction in ("mean", "sum_over_time"),
            "optim.loss_reduction",
            "mean | sum_over_time",
        )
        need(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
        need(o.decay in DECAYS, "optim.decay", " | ".join(DECAYS))
        need(0 < o.plateau_factor <= 1, "optim.plateau_factor", "must be in (0, 1]")
        need(o.plateau_threshold >= 0, "optim.plateau_threshold", "must be >= 0")
        need(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
        need(t.steps >= 1, "train.steps", "must be >= 1")
        need(t.directions in ("both", "forward"), "train.directions", "both | forward")
        need(t.precision in PRECISIONS, "train.precision", " | ".join(PRECISIONS))
        need(t.threads >= 0, "train.threads", "must be >= 0")
        need(t.log_every >= 1, "train.log_every", "must be >= 1")
        need(c.keep >= 1, "checkpoint.keep", "must be >= 1")

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(dataclasses.asdict(self)))  # tuples -> lists

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        return _build(cls, d, "")


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
    "model.dropout_tokens": True,
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


def _unknown(key: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(
        f"unknown config key {key!r}{hint}; known here: {', '.join(known)}", field=key
    )


def _check_type(value: Any, tp: Any, key: str) -> Any:
    """Accept YAML's natural types for a field annotated ``tp``; coerce int -> float."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _check_type(value, a, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: {value!r} is not a {tp}", field=key)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}", field=key)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_check_type(v, args[0], key) for v in value)
        if len(args) != len(value):
            raise ConfigError(f"{key}: expected {len(args)} items, got {value!r}", field=key)
        return tuple(_check_type(v, a, key) for v, a in zip(value, args, strict=True))
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and (
        not isinstance(value, tp) or (tp is int and isinstance(value, bool))
    ):
        raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r}", field=key)
    return value


def _build(cls: type, d: Any, prefix: str) -> Any:
    if not isinstance(d, dict):
        raise ConfigError(
            f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {d!r}", field=prefix or None
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for k in d:
        if k not in fields:
            raise _unknown(f"{prefix}{k}", sorted(fields))
    kwargs = {}
    for name, value in d.items():
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _check_type(value, tp, f"{prefix}{name}")
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"bad config section {prefix.rstrip('.') or 'root'}: {e}") from e


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"optim.lr=0.2"`` -> (["optim", "lr"], 0.2); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"--set expects key=value, got {text!r}", field=text)
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
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


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> TrainConfig:
    """YAML file (or defaults when ``path`` is None) plus ``--set`` overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} not found", field="config")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}", field="config") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: the top level must be a mapping", field="config")
    return TrainConfig.from_dict(apply_overrides(raw, overrides or []))


def dump_config(cfg: TrainConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=None)
