"""elmo-service core: text -> tokens -> char ids -> biLM -> layers -> mix."""

import sys

from elmo_service.config import BiLMConfig
from elmo_service.errors import ArtifactError, ConfigError, InputError, LimitError
from elmo_service.openmp import spin_briefly

__all__ = [
    "ArtifactError",
    "BiLMConfig",
    "ConfigError",
    "Embedder",
    "InputError",
    "LimitError",
    "MixSpec",
    "ScalarMix",
]


def __getattr__(name: str):
    # these pull in torch: import them only when asked, after OpenMP's spin is chosen
    # (it only counts before torch loads libgomp; elmo_service/openmp.py says why)
    if name in ("Embedder", "MixSpec", "ScalarMix"):
        if "torch" not in sys.modules:
            spin_briefly()
        if name == "Embedder":
            from elmo_service.embedder import Embedder

            return Embedder
        from elmo_service import scalar_mix

        return getattr(scalar_mix, name)
    raise AttributeError(name)
