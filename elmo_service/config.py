"""The biLM's shape, as one dataclass.

Field names follow bilm-tf's ``options.json`` where one exists, so that
``BiLMConfig.from_bilm_options`` is a plain mapping.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from elmo_service.errors import ConfigError

# compute precisions of the embedder and the trainer; "auto" resolves per device
# (elmo_service.runtime.resolve_precision). Here, not there, so CLIs list them without torch.
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
# inference weight modes (elmo_service.packed): int8 quantizes the big matmuls' weights
WEIGHT_MODES: tuple[str, ...] = ("fp32", "int8")

# AllenNLP-small / bilm-tf default character CNN: 2048 filters.
ELMO_FILTERS: tuple[tuple[int, int], ...] = (
    (1, 32), (2, 32), (3, 64), (4, 128), (5, 256), (6, 512), (7, 1024),
)  # fmt: skip


@dataclass
class BiLMConfig:
    """Everything needed to build a :class:`elmo_service.model.BiLM`.

    The token encoder is a character CNN (``char_dim``, ``filters``,
    ``activation``) over ``max_chars_per_token`` byte ids, ``n_highway``
    highway layers and a linear projection to ``projection_dim``. The
    contextual encoder is ``n_layers`` LSTM layers per direction with
    ``lstm_dim`` cells projected back to ``projection_dim``.
    """

    # character CNN
    char_dim: int = 16
    filters: tuple[tuple[int, int], ...] = ELMO_FILTERS
    n_highway: int = 1
    activation: str = "relu"
    max_chars_per_token: int = 50
    # shared width of the token vector and of each LSTM layer's output
    projection_dim: int = 128
    # LSTM
    lstm_dim: int = 1024
    n_layers: int = 2
    cell_clip: float | None = 3.0
    proj_clip: float | None = 3.0
    residual: bool = True  # bilm-tf's use_skip_connections: layers >= 2 add their input
    dropout: float = 0.1  # training only: on each LSTM layer's input and the top output
    # training only: also drop out the token vectors into layer 1 (bilm-tf does; Kim et al. 2016
    # apply dropout between layers and before the softmax only)
    dropout_tokens: bool = True
    # guard for the embedder: longer sentences are refused, not truncated
    max_sentence_tokens: int = 512

    def __post_init__(self) -> None:
        self.filters = tuple((int(w), int(n)) for w, n in self.filters)
        self.validate()

    @property
    def n_filters(self) -> int:
        return sum(n for _, n in self.filters)

    @property
    def output_dim(self) -> int:
        """Width of every output layer: ``[forward ; backward]``."""
        return 2 * self.projection_dim

    @property
    def n_output_layers(self) -> int:
        return self.n_layers + 1

    def validate(self) -> None:
        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"{name}: {msg}", field=name)

        need(self.char_dim > 0, "char_dim", "must be positive")
        need(len(self.filters) > 0, "filters", "need at least one [width, count] pair")
        for w, n in self.filters:
            need(0 < w <= self.max_chars_per_token and n > 0, "filters", f"bad filter [{w}, {n}]")
        need(self.activation in ("relu", "tanh"), "activation", "must be 'relu' or 'tanh'")
        need(self.n_highway >= 0, "n_highway", "must be >= 0")
        need(self.max_chars_per_token >= 3, "max_chars_per_token", "must be >= 3")
        need(self.projection_dim > 0, "projection_dim", "must be positive")
        need(self.lstm_dim > 0, "lstm_dim", "must be positive")
        need(self.n_layers >= 1, "n_layers", "must be >= 1")
        need(0.0 <= self.dropout < 1.0, "dropout", "must be in [0, 1)")
        need(self.max_sentence_tokens >= 1, "max_sentence_tokens", "must be >= 1")
        for name in ("cell_clip", "proj_clip"):
            v = getattr(self, name)
            need(v is None or v > 0, name, "must be positive or null")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["filters"] = [list(f) for f in self.filters]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BiLMConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown model config keys: {unknown}", field=unknown[0])
        try:
            return cls(**d)
        except TypeError as e:
            raise ConfigError(f"bad model config: {e}") from e

    def replace(self, **changes: Any) -> BiLMConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_bilm_options(cls, options: dict[str, Any]) -> BiLMConfig:
        """Map a bilm-tf / AllenNLP ``options.json`` onto this config."""
        try:
            cnn, lstm = options["char_cnn"], options["lstm"]
            return cls(
                char_dim=cnn["embedding"]["dim"],
                filters=tuple(tuple(f) for f in cnn["filters"]),
                n_highway=cnn.get("n_highway", 0),
                activation=cnn.get("activation", "relu"),
                max_chars_per_token=cnn.get("max_characters_per_token", 50),
                projection_dim=lstm["projection_dim"],
                lstm_dim=lstm["dim"],
                n_layers=lstm["n_layers"],
                cell_clip=lstm.get("cell_clip"),
                proj_clip=lstm.get("proj_clip"),
                residual=bool(lstm.get("use_skip_connections", False)),
                dropout=float(options.get("dropout", 0.1)),
            )
        except KeyError as e:
            raise ConfigError(f"options.json lacks {e.args[0]!r}", field=str(e.args[0])) from e


def small_test_config(**overrides: Any) -> BiLMConfig:
    """A tiny model for tests: builds and runs in milliseconds."""
    base = dict(
        char_dim=4,
        filters=((1, 4), (2, 8), (3, 8)),
        n_highway=1,
        projection_dim=8,
        lstm_dim=16,
        n_layers=2,
        max_sentence_tokens=64,
    )
    base.update(overrides)
    return BiLMConfig(**base)


__all__ = ["BiLMConfig", "ELMO_FILTERS", "PRECISIONS", "WEIGHT_MODES", "small_test_config"]
