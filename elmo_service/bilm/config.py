"""The biLM's shape, as one strict model (:mod:`elmo_service.settings_base`).

Field names follow bilm-tf's ``options.json`` where one exists, so that
``BiLMConfig.from_bilm_options`` is a plain mapping.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from elmo_service.errors import ConfigError
from elmo_service.settings_base import StrictModel, Tuple, need

# compute precisions of the embedder and the trainer; "auto" resolves per device
# (elmo_service.runtime.resolve_precision). Here, not there, so CLIs list them without torch.
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
# inference weight modes (elmo_service.bilm.kernels): int8 / bf16 round the weights once and stream
# them compact where a step is bound by reading them (opt-in; the error: kernels/certificate.py)
WEIGHT_MODES: tuple[str, ...] = ("fp32", "int8", "bf16")
# the embedder's token-vector cache: distinct tokens whose CNN vectors are kept
DEFAULT_TOKEN_CACHE_SIZE = 100_000
# a batch's budget: padded tokens (n x longest) and sentences (bilm/runner.py plans with it;
# here, torch-free, so that settings and CLIs read the defaults without importing torch)
DEFAULT_BATCH_TOKENS = 4096
DEFAULT_MAX_BATCH_SENTENCES = 256

# AllenNLP-small / bilm-tf default character CNN: 2048 filters.
ELMO_FILTERS: tuple[tuple[int, int], ...] = (
    (1, 32), (2, 32), (3, 64), (4, 128), (5, 256), (6, 512), (7, 1024),
)  # fmt: skip


# ELMoForManyLangs' fields: left out of a config at their defaults, so every earlier model's
# and run's config (and its hash) reads as it always did
LEXICON_DEFAULTS: dict[str, Any] = {"char_vocab_size": None, "word_dim": 0, "word_vocab_size": 0}


class BiLMConfig(StrictModel):
    """Everything needed to build a :class:`elmo_service.bilm.model.BiLM`.

    The token encoder is a character CNN (``char_dim``, ``filters``,
    ``activation``) over ``max_chars_per_token`` byte ids, ``n_highway``
    highway layers and a linear projection to ``projection_dim``. The
    contextual encoder is ``n_layers`` LSTM layers per direction with
    ``lstm_dim`` cells projected back to ``projection_dim``.

    Immutable: ``cfg.replace(lstm_dim=512)`` gives a validated copy. Errors name
    the bare field (``lstm_dim``); inside a training config, ``model.lstm_dim``.
    """

    model_config = ConfigDict(frozen=True)

    # character CNN
    char_dim: int = Field(16, gt=0, description="width of each byte's embedding")
    filters: Annotated[tuple[tuple[int, int], ...], Tuple] = Field(
        ELMO_FILTERS, description="[width, count] pairs of the character convolutions"
    )
    n_highway: int = Field(1, ge=0, description="highway layers after the convolutions")
    activation: Literal["relu", "tanh"] = Field("relu", description="of the convolutions")
    max_chars_per_token: int = Field(50, ge=3, description="bytes read per token, markers included")
    projection_dim: int = Field(
        128, gt=0, description="shared width of the token vector and of each LSTM layer's output"
    )
    # a lexicon's scheme (ELMoForManyLangs models, elmo_service/bilm/lexicon.py) instead of bytes
    char_vocab_size: int | None = Field(
        None,
        gt=0,
        description="rows of the character embedding when characters come from a lexicon "
        "(ELMoForManyLangs' char.dic); null: UTF-8 bytes, 262 ids",
    )
    word_vocab_size: int = Field(0, ge=0, description="rows of the word embedding (0: none)")
    word_dim: int = Field(
        0,
        ge=0,
        description="width of a word embedding concatenated before the character features "
        "(ELMoForManyLangs' word_dim); 0: none",
    )
    # LSTM
    lstm_dim: int = Field(1024, gt=0, description="LSTM cells per layer and direction")
    n_layers: int = Field(2, ge=1, description="LSTM layers per direction")
    lstm_projection: bool = Field(
        True,
        description="false: h = o * tanh(c), a plain LSTM (Kim et al. 2016), kept as a frozen "
        "identity projection so artifacts keep bilm-tf's layout; needs lstm_dim == projection_dim",
    )
    cell_clip: float | None = Field(3.0, gt=0, description="cell state clip; null: none")
    proj_clip: float | None = Field(3.0, gt=0, description="projected output clip; null: none")
    residual: bool = Field(
        True, description="bilm-tf's use_skip_connections: layers >= 2 add their input"
    )
    dropout: float = Field(
        0.1, ge=0, lt=1, description="training only: on each LSTM layer's input and the top output"
    )
    dropout_tokens: bool = Field(
        True,
        description="training only: also drop out the token vectors into layer 1 (bilm-tf "
        "does; Kim et al. 2016 apply dropout between layers and before the softmax only)",
    )
    max_sentence_tokens: int = Field(
        512, ge=1, description="guard for the embedder: longer sentences are refused, not truncated"
    )

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        for k, v in LEXICON_DEFAULTS.items():
            if d.get(k) == v:
                d.pop(k)
        return d

    @model_validator(mode="after")
    def _check_filters(self) -> BiLMConfig:
        need(len(self.filters) > 0, "filters", "need at least one [width, count] pair")
        for w, n in self.filters:
            need(0 < w <= self.max_chars_per_token and n > 0, "filters", f"bad filter [{w}, {n}]")
        need(
            (self.word_dim > 0) == (self.word_vocab_size > 0),
            "word_dim",
            "a word embedding needs both word_dim and word_vocab_size",
        )
        need(
            self.word_dim == 0 or self.char_vocab_size is not None,
            "word_dim",
            "word embeddings come with a character lexicon (char_vocab_size)",
        )
        need(
            self.lstm_projection or self.lstm_dim == self.projection_dim,
            "lstm_projection",
            f"false needs lstm_dim == projection_dim (got {self.lstm_dim} and {self.projection_dim})",
        )
        return self

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


__all__ = [
    "DEFAULT_BATCH_TOKENS",
    "DEFAULT_MAX_BATCH_SENTENCES",
    "DEFAULT_TOKEN_CACHE_SIZE",
    "BiLMConfig",
    "ELMO_FILTERS",
    "PRECISIONS",
    "WEIGHT_MODES",
]
