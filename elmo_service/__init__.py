"""elmo-service core: text -> tokens -> char ids -> biLM -> layers -> mix.

A script that embeds calls :func:`configure_process` first (before torch loads),
then ``Embedder.load``: see ``elmo_service/process.py``.
"""

from elmo_service.bilm.config import BiLMConfig
from elmo_service.errors import ArtifactError, ConfigError, InputError, LimitError
from elmo_service.process import configure_process

__all__ = [
    "ArtifactError",
    "AsyncClient",
    "BiLMConfig",
    "Client",
    "ConfigError",
    "Elmo",
    "Embedder",
    "InputError",
    "LimitError",
    "MixSpec",
    "ScalarMix",
    "batch_to_ids",
    "configure_process",
]


def __getattr__(name: str):
    # these pull in torch: imported only when asked, so that `import elmo_service` is cheap
    if name == "Embedder":
        from elmo_service.embedder import Embedder

        return Embedder
    if name in ("Elmo", "batch_to_ids"):  # the drop-in for allennlp.modules.elmo
        from elmo_service import elmo

        return getattr(elmo, name)
    if name in ("Client", "AsyncClient"):  # the client is its own distribution (httpx, no torch)
        try:
            import elmo_client
        except ImportError as e:
            raise ImportError(
                f"elmo_service.{name} is the elmo-service-client distribution's: "
                "pip install ./clients/python (or elmo-service-client)"
            ) from e
        return getattr(elmo_client, name)
    if name in ("MixSpec", "ScalarMix"):
        from elmo_service import scalar_mix

        return getattr(scalar_mix, name)
    raise AttributeError(name)
