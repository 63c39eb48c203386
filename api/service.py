"""The served model and its holder.

:class:`ServedModel` bundles what one model needs to serve: the embedder
(touched only by its runner's worker thread), the runner (batcher), the
sentence cache view and the task registry. :class:`ModelHolder` is what routes
get through a dependency; ``swap`` replaces the model atomically (requests in
flight keep the ServedModel they started with; the old batcher drains).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from api.batcher import Batcher, DirectRunner, Ticket
from api.cache import CacheBackend, SentenceCache
from api.metrics import Metrics
from api.settings import Settings
from api.tasks_store import (
    ArtifactTasks,
    FileTaskStore,
    RedisTaskStore,
    TaskRegistry,
    TaskStore,
)
from elmo_service.errors import ArtifactError, ConfigError
from elmo_service.scalar_mix import MixSpec
from elmo_service.tokenizers import Token

log = logging.getLogger("api.service")

DEFAULT_MIX_TTL = 1.0

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


@dataclass
class ServedModel:
    name: str
    path: Path
    embedder: Any  # elmo_service.embedder.Embedder
    runner: Batcher | DirectRunner
    cache: SentenceCache
    tasks: TaskRegistry
    io: ThreadPoolExecutor
    request_timeout: float
    max_tokens_per_sentence: int
    metrics: Metrics | None = None
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

    def tokenize(self, sentences: list[str | list[str]]) -> list[list[Token]]:
        """Cheap, in the request path; raises InputError/LimitError naming ``sentences[i]``."""
        return self.embedder.tokenize(sentences)

    def default_mix(self) -> tuple[MixSpec, str | None]:
        """The task named 'default' when there is one, else the plain average of all layers.

        Blocking (task store I/O); remembered for DEFAULT_MIX_TTL seconds (a PUT or
        DELETE through this server forgets it at once).
        """
        try:
            found = self.tasks.spec("default")
        except Exception:  # noqa: BLE001 - store down and nothing remembered: fall back
            found = None
        if found is not None:
            try:
                found[0].validate(self.n_layers, "task")
            except ConfigError as e:  # stored before its bounds existed: refuse, never NaN
                raise ConfigError(
                    f"the stored task 'default' cannot be used: {e.message}", field="task"
                ) from e
        result = (
            (found[0], "default") if found is not None else (MixSpec.average(self.n_layers), None)
        )
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
        await self.runner.embed(WARMUP_SENTENCES, timeout=max(self.request_timeout, 120.0))
        self.warmed = True

    def info(self) -> dict[str, Any]:
        cfg = self.embedder.cfg
        tok = self.embedder.tokenizer
        return {
            "id": self.name,
            "object": "model",
            "created": int(self.loaded_at),
            "owned_by": "elmo-service",
            "version": self.version,
            "path": str(self.path),
            "n_layers": self.n_layers,
            "dim": self.dim,
            "max_tokens_per_sentence": self.max_tokens_per_sentence,
            "config": cfg.to_dict(),
            "tokenizer": {"type": tok.kind, "fingerprint": tok.fingerprint},
            "provenance": self.embedder.artifact.provenance,
            "tasks_shipped": sorted(self.tasks.shipped),
            "cache_key_prefix": self.embedder.cache_key_prefix,
            "loaded_at": self.loaded_at,
            "warmed": self.warmed,
        }

    def close(self) -> None:
        self.runner.close()
        close = getattr(self.tasks.store, "close", None)
        if close:
            close()


def make_task_store(settings: Settings, namespace: str) -> TaskStore:
    if settings.redis_url:
        return RedisTaskStore(
            settings.redis_url,
            namespace,
            prefix=settings.redis_prefix,
            timeout=max(settings.redis_timeout, 0.5),
        )
    return FileTaskStore(settings.resolved_tasks_file, namespace)


def list_artifacts(models_dir: Path, served: ServedModel | None = None) -> list[dict[str, Any]]:
    """Every artifact folder in ``models_dir`` (config and manifest only, no weights),
    plus the served model if it lives elsewhere; ``served`` marks the one being served."""
    from elmo_service.artifact import read_config, read_manifest

    served_path = served.path.resolve() if served is not None else None
    found: list[Path] = []
    root = Path(models_dir)
    if root.is_dir():
        found = sorted(
            d
            for d in root.iterdir()
            if not d.name.startswith(".") and (d / "manifest.json").is_file()
        )
    if served_path is not None and all(d.resolve() != served_path for d in found):
        found.append(served.path)  # type: ignore[union-attr]
    out = []
    for d in found:
        entry: dict[str, Any] = {"id": d.name, "object": "model", "path": str(d)}
        try:
            cfg, manifest = read_config(d), read_manifest(d)
            model = cfg.get("model", {})
            entry.update(
                version=manifest.get("version"),
                created=int((d / "manifest.json").stat().st_mtime),
                n_layers=model.get("n_layers", 0) + 1 if model else None,
                dim=2 * model["projection_dim"] if "projection_dim" in model else None,
                tokenizer=(cfg.get("tokenizer") or {}).get("type"),
                provenance=cfg.get("provenance", {}),
            )
        except Exception as e:  # noqa: BLE001 - listed, with what is wrong with it
            entry["error"] = f"unreadable artifact: {e}"
        entry["served"] = served_path is not None and d.resolve() == served_path
        if entry["served"]:
            entry["version"] = served.version  # type: ignore[union-attr]
        out.append(entry)
    return out


def resolve_artifact(models_dir: Path, name: str) -> Path:
    """``models_dir/name``, refusing names that leave the folder; InputError / LookupError."""
    from elmo_service.errors import InputError
    from elmo_service.names import check_model_name

    check_model_name(name, "name")
    root = Path(models_dir).resolve()
    path = (root / name).resolve()
    if not path.is_relative_to(root):
        raise InputError(f"name: {name!r} resolves outside the models folder", field="name")
    if not (path / "manifest.json").is_file():
        raise LookupError(name)
    return path


async def activate_model(
    holder: ModelHolder,
    settings: Settings,
    backend: CacheBackend,
    io: ThreadPoolExecutor,
    metrics: Metrics | None,
    name: str,
) -> tuple[ServedModel, ServedModel | None]:
    """Load ``models_dir/name``, warm it, swap it in (no request fails). -> (new, old or None)."""
    path = await asyncio.to_thread(resolve_artifact, settings.models_dir, name)
    cur = holder.current
    if cur is not None and cur.path.resolve() == path:
        from elmo_service.artifact import read_manifest

        if (await asyncio.to_thread(read_manifest, path)).get("version") == cur.version:
            return cur, None  # already served
    served = await asyncio.to_thread(load_served_model, settings, backend, io, metrics, path)
    try:
        old = await holder.swap(served)
    except BaseException:
        await asyncio.to_thread(served.close)
        raise
    log.info(
        "activated %s (version %s), replacing %s",
        served.name,
        served.version,
        f"{old.name} ({old.version})" if old else "nothing",
    )
    return served, old


def check_model_dir(path: Path) -> Path:
    if not path.is_dir():
        raise ArtifactError(
            f"model directory {path} does not exist: set ELMO_MODEL_PATH, or ELMO_MODELS_DIR and "
            "ELMO_MODEL (default models/default), or pass --model",
            field="model",
        )
    return path


def load_served_model(
    settings: Settings,
    backend: CacheBackend,
    io: ThreadPoolExecutor,
    metrics: Metrics | None = None,
    model_path: Path | None = None,
    artifact: Any = None,
) -> ServedModel:
    """Load the artifact (or serve ``artifact``, already loaded from that path) and build
    its runner. Blocking: call it off the event loop."""
    from elmo_service.artifact import load_artifact
    from elmo_service.embedder import Embedder
    from elmo_service.runtime import set_threads

    path = check_model_dir(Path(model_path or settings.resolved_model_path))
    set_threads(settings.threads)
    if artifact is None or Path(artifact.path).resolve() != path.resolve():
        artifact = load_artifact(path, device="cpu")
    embedder = Embedder(
        artifact,
        device=settings.device,
        precision=settings.precision,
        token_cache_size=settings.token_cache_size,
        batch_tokens=settings.batch_tokens,
        max_batch_sentences=settings.max_batch_sentences,
        weights=settings.weights,
    )
    # requests are refused above the smaller of the service limit and the model's own
    embedder.max_sentence_tokens = min(
        settings.max_tokens_per_sentence, embedder.cfg.max_sentence_tokens
    )
    name = path.name
    runner: Batcher | DirectRunner
    if settings.batching:
        runner = Batcher(
            embedder.embed_batch,  # the batcher plans; the embedder runs what it is handed
            batch_tokens=settings.batch_tokens,
            max_batch_sentences=settings.max_batch_sentences,
            max_queue=settings.max_queue,
            max_fill_wait=settings.batch_fill_wait_ms / 1000.0,
            metrics=metrics,
            name=f"batcher-{name}",
        )
    else:
        runner = DirectRunner(embedder.embed_tokens, max_queue=settings.max_queue, metrics=metrics)
    cache = SentenceCache(
        backend,
        key_prefix=settings.redis_prefix,
        model_prefix=embedder.cache_key_prefix,
        version=embedder.version,
        dtype=settings.cache_dtype,
        ttl=settings.cache_ttl,
        n_layers=embedder.n_layers,
        dim=embedder.dim,
        metrics=metrics,
    )
    shipped = ArtifactTasks(path, embedder.n_layers, embedder.artifact.tasks)
    tasks = TaskRegistry(make_task_store(settings, name), shipped, embedder.n_layers)
    served = ServedModel(
        name=name,
        path=path,
        embedder=embedder,
        runner=runner,
        cache=cache,
        tasks=tasks,
        io=io,
        request_timeout=settings.request_timeout,
        max_tokens_per_sentence=embedder.max_sentence_tokens,
        metrics=metrics,
    )
    if metrics is not None:
        metrics.model_info.labels(name, embedder.version).set(1)
    return served


def _runner_idle(runner: Batcher | DirectRunner) -> bool:
    """No request is on its way to ``runner``: none announced (the AnnounceMiddleware
    announces every embedding request on arrival), none queued or running."""
    return runner.depth == 0 and getattr(runner, "_incoming", 0) == 0


class ModelHolder:
    """Holds the served model; routes get it via ``Depends(get_model)``, never a global."""

    def __init__(self) -> None:
        self._current: ServedModel | None = None
        self._swap_lock = asyncio.Lock()

    @property
    def current(self) -> ServedModel | None:
        return self._current

    @property
    def ready(self) -> bool:
        return self._current is not None and self._current.warmed and self._current.runner.alive

    async def swap(
        self, new: ServedModel, *, warm: bool = True, drain_timeout: float | None = None
    ) -> ServedModel | None:
        """Warm ``new``, make it current, let the old one finish its requests, close it.

        No request fails because of a swap: a request pinned the model it started
        with (its announcement to that model's batcher), so the old model is closed
        only once nothing is announced, queued or running there any more, bounded
        by ``drain_timeout`` (default: the old model's request timeout + 5 s).
        Swaps are serialised, so a request never sees its model closed under it.
        """
        async with self._swap_lock:
            if warm and not new.warmed:
                await new.warm_up()
            old, self._current = self._current, new
            if old is not None:
                timeout = drain_timeout if drain_timeout is not None else old.request_timeout + 5
                await self._drain(old, timeout)
                await asyncio.to_thread(old.close)
                if old.metrics is not None:
                    old.metrics.model_info.labels(old.name, old.version).set(0)
        return old

    @staticmethod
    async def _drain(old: ServedModel, timeout: float) -> None:
        # a DirectRunner sees a request only once it calls the model: wait for a quiet spell
        quiet_for = 0.05 if isinstance(old.runner, Batcher) else 0.5
        deadline = time.monotonic() + timeout
        quiet_since: float | None = None
        while time.monotonic() < deadline:
            now = time.monotonic()
            if _runner_idle(old.runner):
                quiet_since = quiet_since or now
                if now - quiet_since >= quiet_for:
                    return
            else:
                quiet_since = None
            await asyncio.sleep(0.01)
        log.warning(
            "model %s still busy after %.0fs; closing it (draining its queue)", old.name, timeout
        )

    async def close(self) -> None:
        cur, self._current = self._current, None
        if cur is not None:
            await asyncio.to_thread(cur.close)
