"""Building a :class:`~elmo_api.served.ServedModel` from the settings and an artifact folder:
the embedder, its runner (batcher or direct), the cache view and the task stores."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from elmo_api.batcher import Batcher
from elmo_api.cache import CacheBackend, SentenceCache
from elmo_api.metrics import Metrics
from elmo_api.served import ServedModel
from elmo_api.settings import Settings
from elmo_api.tasks_store import (
    ArtifactTasks,
    FileTaskStore,
    RedisTaskStore,
    TaskRegistry,
    TaskStore,
)
from elmo_service.artifact import MANIFEST
from elmo_service.errors import ArtifactError
from elmo_service.runtime import in_transient_thread, in_transient_thread_async


def make_task_store(settings: Settings, namespace: str) -> TaskStore:
    if settings.redis_url:
        return RedisTaskStore(
            settings.redis_url,
            namespace,
            prefix=settings.redis_prefix,
            password=settings.redis_password,
            timeout=max(settings.redis_timeout, 0.5),
        )
    return FileTaskStore(settings.resolved_tasks_file, namespace)


def _mtime(path: Path) -> int | None:
    try:
        return int(path.stat().st_mtime)
    except OSError:
        return None


def check_model_dir(path: Path) -> Path:
    if not path.is_dir():
        raise ArtifactError(
            f"model directory {path} does not exist: set ELMO_MODEL_PATH, or ELMO_MODELS_DIR and "
            "ELMO_MODEL (default models/default), or pass --model",
            field="model",
        )
    return path


# Models load on threads that end, here and nowhere else: a thread that lives on would keep
# the thread pools of the load's parallel ops beside the batcher's (elmo_service.runtime
# in_transient_thread says what that costs).


def preload_artifact(path: Path) -> Any:
    """Load and verify the artifact at ``path`` (before the server starts), on a thread that ends."""
    from elmo_service.artifact import load_artifact

    return in_transient_thread(load_artifact, path, device="cpu")


async def on_load_thread(fn: Any, /, *args: Any, **kwargs: Any) -> Any:
    """A model load ``fn(*args)`` on a thread that ends, awaited (``in_transient_thread`` says why)."""
    return await in_transient_thread_async(fn, *args, **kwargs)


async def load_served_model_async(*args: Any, **kwargs: Any) -> ServedModel:
    """:func:`load_served_model` on a thread that ends, awaited."""
    return await in_transient_thread_async(load_served_model, *args, **kwargs)


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

    def build() -> Embedder:
        emb = Embedder(
            artifact,
            device=settings.device,
            precision=settings.precision,
            token_cache_size=settings.token_cache_size,
            batch_tokens=settings.batch_tokens,
            max_batch_sentences=settings.max_batch_sentences,
            weights=settings.weights,
        )
        # requests are refused above the smaller of the service limit and the model's own
        emb.max_sentence_tokens = min(settings.max_tokens_per_sentence, emb.cfg.max_sentence_tokens)
        return emb

    embedder = build()
    name = path.name
    interactive_fn = None
    if settings.interactive_thread and embedder.device.type == "cpu":
        # the express thread needs its own kernel instance (packed weights, token cache,
        # lock) over the same weights: two calls may then run at once (docs/serving.md)
        interactive_fn = build().run_batch
    runner = Batcher(
        embedder.run_batch,  # the batcher plans; the embedder runs what it is handed
        batch_tokens=settings.batch_tokens,
        max_batch_sentences=settings.max_batch_sentences,
        max_queue=settings.max_queue,
        batch_max_queue=settings.batch_max_queue,
        batch_share=settings.batch_share,
        max_fill_wait=settings.batch_fill_wait_ms / 1000.0,
        metrics=metrics,
        name=f"batcher-{name}",
        interactive_fn=interactive_fn,
        batch_nice=settings.batch_nice,
    )
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
    # shipped tasks pinned to the loaded version: a folder replaced later cannot lend its own
    shipped = ArtifactTasks(
        path, embedder.n_layers, embedder.artifact.tasks, version=embedder.version
    )
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
        created=_mtime(path / MANIFEST),
        tokenize_off_loop=settings.tokenize_off_loop_sentences,
    )
    if metrics is not None:
        metrics.model_info.labels(name, embedder.version).set(1)
    return served
