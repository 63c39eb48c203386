"""The served model: one artifact with everything it needs to answer requests.

:class:`ServedModel` bundles the embedder (touched only by its runner's worker
thread), the runner (batcher), the sentence cache view and the task registry;
:mod:`api.loading` builds one, :mod:`api.holder` holds the current one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from api.batcher import Runner, Ticket
from api.cache import SentenceCache
from api.metrics import Metrics
from api.tasks_store import TaskRegistry
from elmo_service.errors import InputError
from elmo_service.outputs import DEFAULT_TASK, default_mix
from elmo_service.runtime import in_transient_thread_async
from elmo_service.scalar_mix import MixSpec
from elmo_service.tokenizers import Token

DEFAULT_MIX_TTL = 1.0
# the ASGI scope key under which a request's resolved ServedModel is left (X-Model-Version)
SERVED_KEY = "elmo.served"

WARMUP_SENTENCES = [
    ["Hello", "world", "."],
    [
        "The",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "the",
        "lazy",
        "dog",
        "near",
        "the",
        "river",
        "bank",
        ".",
    ],
]


def _scalar(v: object) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def provenance_summary(provenance: dict[str, Any]) -> dict[str, Any]:
    """The provenance's plain values, and those one level down; lists and deeper objects
    (a corpus manifest, a whole training config) only with ``?full=true``."""
    out: dict[str, Any] = {}
    for k, v in provenance.items():
        if _scalar(v):
            out[k] = v
        elif isinstance(v, dict):
            inner = {kk: vv for kk, vv in v.items() if _scalar(vv)}
            if inner:
                out[k] = inner
    return out


@dataclass
class Embedded:
    """One request's sentences embedded: their tokens and ``[L+1, T, D]`` layers."""

    tokens: list[list[Token]]
    layers: list[np.ndarray]
    hits: int  # distinct sentences from the cache
    misses: int  # ... and from the model


@dataclass
class ServedModel:
    name: str
    path: Path
    embedder: Any  # elmo_service.embedder.Embedder
    runner: Runner
    cache: SentenceCache
    tasks: TaskRegistry
    io: ThreadPoolExecutor
    request_timeout: float
    max_tokens_per_sentence: int
    metrics: Metrics | None = None
    created: int | None = None  # the manifest's mtime when it was loaded
    loaded_at: float = field(default_factory=time.time)
    warmed: bool = False
    _default_mix: tuple | None = field(default=None, repr=False)

    @property
    def version(self) -> str:
        return self.embedder.version

    @property
    def n_layers(self) -> int:
        return self.embedder.n_layers

    @property
    def dim(self) -> int:
        return self.embedder.dim

    def tokenize(
        self, sentences: list[str | list[str]], field: str = "sentences"
    ) -> list[list[Token]]:
        """Cheap, in the request path; raises InputError/LimitError naming ``field[i]``."""
        return self.embedder.tokenize(sentences, field=field)

    async def embed(
        self,
        sentences: list,
        *,
        field: str = "sentences",
        ticket: Ticket | None = None,
        check: Callable[[list[list[Token]]], None] | None = None,
    ) -> Embedded:
        """What a route asks of the model: tokenize (errors name ``field[i]``; a sentence
        with no tokens is refused), ``check(token_lists)`` if given, then the layers
        (:meth:`layers`)."""
        token_lists = self.tokenize(sentences, field)
        for i, toks in enumerate(token_lists):
            if not toks:
                raise InputError(
                    f"{field}[{i}] has no tokens (empty sentence)", field=f"{field}[{i}]"
                )
        if check is not None:
            check(token_lists)
        texts = [[t.text for t in toks] for toks in token_lists]
        layers, hits, misses = await self.layers(texts, ticket)
        return Embedded(token_lists, layers, hits, misses)

    def default_mix(self) -> tuple[MixSpec, str | None]:
        """The model's default mix (``elmo_service.outputs.default_mix``: the task named
        'default' when there is one, else the plain average of all layers).

        Blocking (task store I/O); remembered for DEFAULT_MIX_TTL seconds (a PUT or
        DELETE through this server forgets it at once).
        """
        try:
            found = self.tasks.spec(DEFAULT_TASK)
        except Exception:  # noqa: BLE001 - store down and nothing remembered: fall back
            found = None
        result = default_mix(None if found is None else found[0], self.n_layers)
        self._default_mix = (time.monotonic() + DEFAULT_MIX_TTL, result, self.tasks.generation)
        return result

    async def default_mix_async(self) -> tuple[MixSpec, str | None]:
        memo = self._default_mix
        if memo is not None and memo[0] > time.monotonic() and memo[2] == self.tasks.generation:
            return memo[1]
        return await asyncio.get_running_loop().run_in_executor(self.io, self.default_mix)

    async def layers(
        self, token_lists: list[list[str]], ticket: Ticket | None = None
    ) -> tuple[list[np.ndarray], int, int]:
        """``[L+1, T, D]`` float32 per sentence: cache first, the batcher for the rest.

        ``ticket``: this request's announcement to the batcher (made by the
        AnnounceMiddleware as the request arrived); one is made here otherwise.
        Returns (arrays, cache hits, cache misses) counted over distinct sentences.
        """
        loop = asyncio.get_running_loop()
        cache = self.cache
        if ticket is None:
            ticket = self.runner.announce()
        try:
            digests = cache.digests(token_lists)
            first: dict[bytes, int] = {}
            for i, d in enumerate(digests):
                first.setdefault(d, i)
            uniq = list(first.values())
            u_tokens = [token_lists[i] for i in uniq]
            u_digests = [digests[i] for i in uniq]
            found: list[np.ndarray | None]
            if not cache.enabled:
                found = [None] * len(uniq)
            elif cache.blocking:
                found = await loop.run_in_executor(self.io, cache.get, u_tokens, u_digests)
            else:
                found = cache.get(u_tokens, u_digests)
            miss = [j for j, a in enumerate(found) if a is None]
            hits = len(uniq) - len(miss)
            computed: list[np.ndarray] = []
            if miss:
                computed = await self.runner.embed(
                    [u_tokens[j] for j in miss], timeout=self.request_timeout, ticket=ticket
                )
        finally:
            ticket.retire()
        if miss:
            computed = [cache.quantize(a) for a in computed]
            for j, a in zip(miss, computed, strict=True):
                found[j] = a
            if cache.enabled:
                miss_digests = [u_digests[j] for j in miss]
                if cache.blocking:
                    await loop.run_in_executor(self.io, cache.put, computed, miss_digests)
                else:
                    cache.put(computed, miss_digests)
        if self.metrics is not None and cache.enabled:
            self.metrics.cache_hits.inc(hits)
            self.metrics.cache_misses.inc(len(miss))
        by_digest = {d: found[j] for j, d in enumerate(u_digests)}
        out = [by_digest[d] for d in digests]
        if self.metrics is not None:
            self.metrics.tokens_served.inc(sum(len(t) for t in token_lists))
        return out, hits, len(miss)  # type: ignore[return-value]

    async def warm_up(self) -> None:
        timeout = max(self.request_timeout, 120.0)
        await self.runner.embed(WARMUP_SENTENCES, timeout=timeout)
        # one sentence alone takes another path of the CPU kernel
        await self.runner.embed(WARMUP_SENTENCES[:1], timeout=timeout)
        # off the event loop: the kernel's per-machine route (fp32) and a rounded-weights
        # path's error against fp32 are measured now, not on a request
        await in_transient_thread_async(self.embedder.prepare)
        self.warmed = True

    def info(self, full: bool = True) -> dict[str, Any]:
        """The model object; ``full=False``: its provenance summarised."""
        cfg = self.embedder.cfg
        prov = self.embedder.artifact.provenance
        tok = self.embedder.tokenizer
        return {
            "id": self.name,
            "object": "model",
            "created": int(self.loaded_at),
            "owned_by": "elmo-service",
            "version": self.version,
            "path": self.path.name,  # relative to the models folder: no server paths out
            "n_layers": self.n_layers,
            "dim": self.dim,
            "max_tokens_per_sentence": self.max_tokens_per_sentence,
            "config": cfg.to_dict(),
            "tokenizer": {"type": tok.kind, "fingerprint": tok.fingerprint},
            "provenance": prov if full else provenance_summary(prov),
            "tasks_shipped": sorted(self.tasks.shipped),
            "cache_key_prefix": self.embedder.cache_key_prefix,
            # the kernel path and, for rounded weights, its error against fp32 (measured at warm-up)
            "speed_path": self.embedder.speed_path,
            "certificate": self.embedder.certificate if self.warmed else None,
            "loaded_at": self.loaded_at,
            "warmed": self.warmed,
        }

    def close(self) -> None:
        self.runner.close()
        close = getattr(self.tasks.store, "close", None)
        if close:
            close()
