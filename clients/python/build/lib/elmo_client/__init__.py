"""A Python client for a running ``elmo-service serve``: the library's ``embed`` over HTTP.

``Client(url).embed(sentences)`` returns what ``Embedder.load(path).embed(sentences)``
returns (``EmbeddedSentence`` objects, equal within 1e-5 x max(1, |value|) on the same
model), computed by the server; large inputs are split under the server's limits
(``GET /v1/limits``) and sent concurrently; every answer is checked before it is believed;
refusals, gateway failures and dropped connections are retried. ``embed_document`` streams
a whole document's vectors; ``tasks``, ``models`` and ``jobs`` wrap the other routes.
``AsyncClient`` is the same with ``await``. See docs/client.md.

Installed on its own (``pip install ./clients/python``: httpx, numpy, orjson; no torch).

Layout: ``values`` (the values both sides of the wire share: one file with
``elmo_service/values.py``), ``wire`` (requests as values, retries, splitting; no I/O),
``answers`` (every answer checked and decoded), ``ops`` (every operation once, as a
generator over ``wire``'s requests), ``document`` (``embed_document``'s stream), ``sync``
and ``aio`` (the two drivers), ``deadline`` (the sync driver's whole-request timeout).
"""

from elmo_client.aio import AsyncClient
from elmo_client.errors import (
    JobFailed,
    ServiceError,
    ServiceInputError,
    ServiceUnreachable,
)
from elmo_client.ops import EmbedResult
from elmo_client.shared import EmbeddedSentence, InputError, Token
from elmo_client.sync import Client
from elmo_client.wire import Limits

__all__ = [
    "AsyncClient",
    "Client",
    "EmbedResult",
    "EmbeddedSentence",
    "InputError",
    "JobFailed",
    "Limits",
    "ServiceError",
    "ServiceInputError",
    "ServiceUnreachable",
    "Token",
]
