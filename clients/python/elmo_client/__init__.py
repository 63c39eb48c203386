"""A Python client for a running ``elmo-service serve``: the library's ``embed`` over HTTP.

``Client(url).embed(sentences)`` returns what ``Embedder.load(path).embed(sentences)``
returns (``EmbeddedSentence`` objects, equal within 1e-6 on the same model), computed by
the server; large inputs are split under the server's limits (``GET /v1/limits``) and sent
concurrently; 429/503 are retried. ``tasks``, ``models`` and ``jobs`` wrap the other
routes. ``AsyncClient`` is the same with ``await``. See docs/client.md.

Layout: ``wire`` (requests and answers as values, no I/O), ``ops`` (every operation once,
as a generator over ``wire``'s requests), ``sync`` and ``aio`` (the two drivers).
"""

from elmo_service.client.aio import AsyncClient
from elmo_service.client.errors import (
    JobFailed,
    ServiceError,
    ServiceInputError,
    ServiceUnreachable,
)
from elmo_service.client.ops import EmbedResult
from elmo_service.client.sync import Client
from elmo_service.client.wire import Limits

__all__ = [
    "AsyncClient",
    "Client",
    "EmbedResult",
    "JobFailed",
    "Limits",
    "ServiceError",
    "ServiceInputError",
    "ServiceUnreachable",
]
