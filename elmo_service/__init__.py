"""elmo-service core: text -> tokens -> char ids -> biLM -> layers -> mix."""

from elmo_service.config import BiLMConfig
from elmo_service.errors import ArtifactError, ConfigError, InputError, LimitError
from elmo_service.scalar_mix import MixSpec, ScalarMix

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
    # the embedder pulls in torch and safetensors; import it only when asked
    if name == "Embedder":
        from elmo_service.embedder import Embedder

        return Embedder
    raise AttributeError(name)
