"""The served model: one artifact with everything it needs to answer requests.

:class:`ServedModel` bundles the embedder (touched only by its runner's worker
thread), the runner (batcher), the sentence cache view and the task registry;
:mod:`elmo_api.loading` builds one, :mod:`elmo_api.holder` holds the current one.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from elmo_api.admission import Ticket
from elmo_api.batcher import Batcher
from elmo_api.cache import SentenceCache
from elmo_api.metrics import Metrics
from elmo_api.responses import check_response_floats
from elmo_api.tasks_store import TaskRegistry
from elmo_service.outputs import DEFAULT_TASK, OutputSpec, default_mix, plan_output
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


class ModelTimeout(Exception):
    """The model did not answer within ELMO_REQUEST_TIMEOUT (503 ``timeout``)."""


@dataclass
class Embedded:
    """One request's sentences embedded: their tokens and ``[L+1, T, D]`` layers."""

    tokens: list[list[Token]]
    layers: list[np.ndarray]
    hits: int  # distinct sentences from the cache
    misses: int  # ... and from the model
    floats: int = 0  # the floats the answer carries (0: no output spec given)


def answer_floats(token_lists: list, spec: OutputSpec, dim: int) -> tuple[int, str]:
    """The floats the answer will carry, and how (for the 413), from the request alone."""
    outputs_per_position = (len(spec.layers) if spec.layers is not None else 0) + (
        spec.mix is not None
    )
    if spec.pooling != "none":
        positions = len(token_lists)
        what = "pooled"
    elif spec.granularity == "word":
        positions = sum(len({t.word for t in toks}) for toks in token_lists)
        what = "words"
    else:
        positions = sum(len(toks) for toks in token_lists)
        what = "tokens"
    detail = (
        f"{len(token_lists)} sentences, {positions:,} {what} x {outputs_per_position} "
        f"output layers x {dim} dims"
    )
    return positions * outputs_per_position * dim, detail


@dataclass
class ServedModel:
    name: str
    path: Path
    embedder: Any  # elmo_service.embedder.Embedder
    runner: Batcher
    cache: SentenceCache
    tasks: TaskRegistry
    io: ThreadPoolExecutor
    request_timeout: float
    max_tokens_per_sentence: int
    metrics: Metrics | None = None
    created: int | None = None  # the manifest's mtime when it was loaded
    loaded_at: float = field(default_factory=time.time)
    warmed: bool = False
    selftest: dict[str, Any] | None = None  # the last self-test's result (api/selftest.py)
    selftest_run: Any = field(default=None, repr=False)  # the self-test running now (a Task)
    # requests of at least this many sentences are tokenized (and cached) on a thread of their
    # own (0: none)
    tokenize_off_loop: int = 0
    _default_mix: tuple | None = field(default=None, repr=False)
    _tokenizing: ThreadPoolExecutor | None = field(default=None, repr=False)

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

    async def output_spec(self, **options: Any) -> OutputSpec:
        """What each sentence's answer is (``elmo_service.outputs.plan_output``'s options),
        its task looked up off the event loop: the default mix, a stored or shipped task,
        or ``UnknownTask`` listing the names there are."""
        spec = plan_output(self.n_layers, **options)
        if spec.pending is None:
            return spec
        if spec.wants_default:
            return spec.using(*await self.default_mix_async())
        loop = asyncio.get_running_loop()
        found = await loop.run_in_executor(self.io, self.tasks.spec, spec.pending)
        if found is not None:
            return spec.with_mix(found[0])
        return spec.with_mix(None, await loop.run_in_executor(self.io, self.tasks.names))

    async def embed(
        self,
        sentences: list,
        *,
        field: str = "sentences",
        ticket: Ticket | None = None,
        spec: OutputSpec | None = None,
        max_floats: int | None = None,
        lane: str = "interactive",
        timing: Any = None,
        tokens: list[list[Token]] | None = None,
    ) -> Embedded:
        """What a route asks of the model: tokenize (errors name ``field[i]``; ``tokens``: the
        sentences' tokens, when the caller already has them), bound the
        answer ``spec`` would make by ``max_floats`` before any work (ResponseTooLarge
        naming ``field``), then the layers (:meth:`layers`) in priority ``lane``. A sentence
        with no tokens (``""``, ``[]``) gets ``[L+1, 0, D]``, as from the library (#51).
        ``timing`` (``elmo_api.timing.RequestTiming``) gets the tokenization, queue and model time."""
        t0 = time.perf_counter()
        if tokens is not None:
            token_lists = tokens
        elif self._large(len(sentences)):
            # a large request's tokens (~0.1 ms a sentence of Python) off the event loop, on
            # one thread: the small requests queued behind it are parsed and answered between
            # its sentences (the GIL changes hands), not after all of them
            token_lists = await asyncio.get_running_loop().run_in_executor(
                self._off_loop(), self.tokenize, sentences, field
            )
        else:
            token_lists = self.tokenize(sentences, field)
        if timing is not None:
            timing.lane, timing.used = lane, True
            timing.tokenization = time.perf_counter() - t0
        floats = 0
        if spec is not None:
            floats, detail = answer_floats(token_lists, spec, self.dim)
            if max_floats is not None:
                check_response_floats(floats, max_floats, field, detail)
        texts = [[t.piece for t in toks] for toks in token_lists]
        try:
            layers, hits, misses = await self.layers(texts, ticket, lane, timing)
        except TimeoutError as e:
            raise ModelTimeout(
                f"timed out after {self.request_timeout:g}s waiting for the model; retry later"
            ) from e
        return Embedded(token_lists, layers, hits, misses, floats)

    def _large(self, n: int) -> bool:
        return 0 < self.tokenize_off_loop <= n

    def _off_loop(self) -> ThreadPoolExecutor:
        """The one thread a large request's Python work (tokens, cache entries) runs on."""
        if self._tokenizing is None:
            self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="elmo-tokenize")
        return self._tokenizing

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
        self,
        token_lists: list[list[str]],
        ticket: Ticket | None = None,
        lane: str = "interactive",
        timing: Any = None,
    ) -> tuple[list[np.ndarray], int, int]:
        """``[L+1, T, D]`` float32 per sentence: cache first, the batcher for the rest.

        ``ticket``: this request's announcement to the batcher (made by the
        AnnounceMiddleware as the request arrived); one is made here otherwise.
        Returns (arrays, cache hits, cache misses) counted over distinct sentences.
        """
        full = [i for i, t in enumerate(token_lists) if t]
        if len(full) < len(token_lists):  # empty sentences: zero positions, never the model
            empty = np.zeros((self.n_layers, 0, self.dim), dtype=np.float32)
            out: list[np.ndarray] = [empty] * len(token_lists)
            if not full:
                if ticket is not None:
                    ticket.retire()
                return out, 0, 0
            got, hits, misses = await self.layers(
                [token_lists[i] for i in full], ticket, lane, timing
            )
            for i, a in zip(full, got, strict=True):
                out[i] = a
            return out, hits, misses
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
                    [u_tokens[j] for j in miss],
                    timeout=self.request_timeout,
                    ticket=ticket,
                    lane=lane,  # type: ignore[arg-type]
                    timing=timing,
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
                elif self._large(len(miss)):  # packing and checksumming entries: Python too
                    await loop.run_in_executor(self._off_loop(), cache.put, computed, miss_digests)
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
        # each model thread's kernel instance on its own thread, a batch and a sentence alone
        # (another path of the CPU kernel): the express thread's too, which a request
        # reaches only beside batch work and must not be the one to pay its first call
        for done in self.runner.run_on_each(
            lambda fn: (fn(WARMUP_SENTENCES), fn(WARMUP_SENTENCES[:1]))
        ):
            await asyncio.wait_for(asyncio.wrap_future(done), timeout)
        # off the event loop: the kernel's per-machine route (fp32) and a rounded-weights
        # path's error against fp32 are measured now, not on a request
        await in_transient_thread_async(self.embedder.prepare)
        # admission must not judge the model by its first calls (kernel caches, compiles) nor
        # start from its slow prior: once more through the queue, measured (interactive lane:
        # no batch activity that would send requests to the express thread after start)
        if self.tokenize_off_loop:  # its thread started now, not by the first large request
            await asyncio.get_running_loop().run_in_executor(
                self._off_loop(), self.tokenize, WARMUP_SENTENCES
            )
        self.runner.forget_warm_up()
        await self.runner.embed(WARMUP_SENTENCES, timeout=timeout)
        await self.runner.embed(WARMUP_SENTENCES[:1], timeout=timeout)
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
        if self._tokenizing is not None:
            self._tokenizing.shutdown(wait=False)
        close = getattr(self.tasks.store, "close", None)
        if close:
            close()
