"""Model configurations for tests (test-only: not part of the product packages)."""

from __future__ import annotations

from typing import Any

from elmo_service.bilm.config import BiLMConfig


def small_test_config(**overrides: Any) -> BiLMConfig:
    """A tiny model for tests: builds and runs in milliseconds."""
    base: dict[str, Any] = dict(
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
