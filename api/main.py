"""App factory and lifespan. ``uvicorn elmo_api.main:app`` serves the default settings.

``elmo-service serve`` (``elmo_api.server.run``) also sets the connection limits
(``ELMO_HTTP_*``: header/body read deadlines, keep-alive, connections); under the
plain uvicorn CLI add ``--http elmo_api.http_protocol:DeadlineHttpToolsProtocol``
(10 s / 30 s deadlines) and ``--limit-concurrency``.

Importing this module loads no model and reads no settings: the lifespan does
both (settings first, so a bad ``ELMO_*`` value fails startup with a message
naming it), then warms the model up before ``/readyz`` turns 200.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline

from elmo_api.activation import load_warm
from elmo_api.cache import CacheBackend, LocalCache, NullCache, RedisCache
from elmo_api.dialects import ErrorDialectMiddleware
from elmo_api.documents import DocumentStreams
from elmo_api.encoding import JSONBytesResponse
from elmo_api.errors import install_error_handlers
from elmo_api.fleet import FleetAgent, fleet_store, load_startup_model
from elmo_api.holder import ModelHolder
from elmo_api.loading import on_load_thread
from elmo_api.metrics import Metrics, MetricsMiddleware
from elmo_api.middleware import (
    AnnounceMiddleware,
    ModelVersionMiddleware,
    RequestGuardMiddleware,
    TimingMiddleware,
)
from elmo_api.routers import (
    document,
    embed,
    health,
    jobs,
    limits,
    models,
    openai,
    selftest,
    tasks,
    tei,
)
from elmo_api.settings import Settings, load_settings
from elmo_jobs import JobService
from elmo_service.errors import ElmoServiceError

log = logging.getLogger("api")

DESCRIPTION = """\
Contextual token embeddings from an ELMo-style biLM.

* `POST /v1/embed`: per-token / per-word / pooled vectors, any layers, a task's scalar mix or inline weights.
* `POST /v1/embeddings`: OpenAI-compatible (one pooled vector per input).
* `GET /v1/models`, `/v1/tasks`: what is served; tasks are named mixes (writes need an admin key).
* `POST /v1/models/{name}/activate`: serve another artifact of the models folder (admin).
* `/v1/jobs`: pretraining jobs, run by `elmo-service worker` (admin).
* `GET /v1/selftest`: the served model on the sentences stored with its artifact (admin).
* Errors are always `{"code", "message", "field"}` with a 4xx status for client mistakes.
"""


def make_cache_backend(settings: Settings, metrics: Metrics | None) -> CacheBackend:
    if not settings.cache:
        return NullCache()
    if settings.resolved_cache_redis_url:
        return RedisCache(
            settings.resolved_cache_redis_url,
            password=settings.redis_password,
            timeout=settings.redis_timeout,
            retry_interval=settings.redis_retry_interval,
            metrics=metrics,
        )
    if settings.cache_max_bytes > 0:
        return LocalCache(settings.cache_max_bytes, settings.cache_ttl)
    return NullCache()


def start_jobs(settings: Settings) -> JobService | None:
    """The job service. Embedding never depends on it: a failure is logged, not raised."""
    try:
        jobs_service = JobService(settings)
    except Exception:  # noqa: BLE001 - /v1/jobs answers 503
        log.exception("job service unavailable")
        return None
    try:
        jobs_service.start()
    except Exception as e:  # noqa: BLE001 - e.g. Redis down now: lost jobs are re-checked later
        log.warning("job service: startup check failed (%s); retried on the next job request", e)
    return jobs_service


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    try:
        settings = app.state.settings or load_settings()
    except ElmoServiceError as e:
        log.error("%s", e.message)
        raise
    app.state.settings = settings
    app.state.documents = DocumentStreams.from_settings(settings)
    app.state.documents.start()
    metrics: Metrics = app.state.metrics
    backend = make_cache_backend(settings, metrics)
    io = ThreadPoolExecutor(max_workers=8, thread_name_prefix="elmo-io")
    holder: ModelHolder = app.state.holder
    # the artifact `elmo-service serve` already loaded and verified before uvicorn started
    artifact, app.state.preloaded_artifact = app.state.preloaded_artifact, None
    store = fleet_store(settings)  # with Redis: the model the fleet serves comes first
    try:
        served, fleet_note = await on_load_thread(
            load_startup_model, settings, store, backend, io, metrics, artifact
        )
    except ElmoServiceError as e:
        log.error("cannot load the model: %s", e.message)
        if store is not None:
            store.close()
        backend.close()
        io.shutdown(wait=False)
        raise
    if isinstance(backend, RedisCache) and not await asyncio.to_thread(backend.ping):
        log.warning(
            "redis at %s is not reachable: serving uncached until it is",
            settings.resolved_cache_redis_url,
        )
    if settings.warmup:
        # a few seconds on a CPU, before /readyz says ready: said, so the wait is not a mystery
        log.info(
            "warming up %s (one embed of every kernel path; ELMO_WARMUP=false skips it)",
            served.name,
        )
        await served.warm_up()
    else:
        served.warmed = True
    await holder.swap(served, warm=False)
    # what model activation needs to load another artifact later
    app.state.cache_backend, app.state.io = backend, io
    if store is not None:
        app.state.fleet = FleetAgent(
            settings,
            store,
            holder,
            lambda path: load_warm(settings, backend, io, metrics, path),
            metrics=metrics,
        )
        await app.state.fleet.start(fleet_note)
    app.state.jobs = await asyncio.to_thread(start_jobs, settings)
    metrics.ready.set(1)
    log.info(
        "serving %s (version %s, %d layers x %d)",
        served.name,
        served.version,
        served.n_layers,
        served.dim,
    )
    try:
        yield
    finally:
        metrics.ready.set(0)
        jobs_service, app.state.jobs = app.state.jobs, None
        if jobs_service is not None:
            await asyncio.to_thread(jobs_service.close)
        fleet, app.state.fleet = app.state.fleet, None
        if fleet is not None:
            await fleet.stop()
        await holder.close()
        backend.close()
        io.shutdown(wait=False)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app. With ``settings=None`` they are read from the environment at startup."""
    # /docs serves Swagger UI's JS and CSS from the fastapi-offline package (under
    # /static-offline-docs), not a CDN, so it works on air-gapped hosts; no validator badge
    # either, which would call out to swagger.io.
    app = FastAPIOffline(
        title="elmo-service",
        version="0.1.0",
        description=DESCRIPTION,
        lifespan=lifespan,
        default_response_class=JSONBytesResponse,
        docs_url="/docs",
        redoc_url=None,
        swagger_ui_parameters={"validatorUrl": None},
    )
    app.state.settings = settings
    app.state.preloaded_artifact = None
    app.state.holder = ModelHolder()
    app.state.metrics = Metrics()
    install_error_handlers(app)
    app.state.jobs = None
    app.state.fleet = None
    for r in (
        embed.router,
        document.router,
        openai.router,
        models.router,
        limits.router,
        tasks.router,
        jobs.router,
        selftest.router,
        health.router,
        tei.router,
    ):
        app.include_router(r)

    def max_body() -> int:
        s = app.state.settings
        return (
            s.max_body_bytes if s is not None else Settings.model_fields["max_body_bytes"].default
        )

    # outermost last: metrics -> body/content-type guard -> batch announcement (body already
    # read) -> the model version that answered (X-Model-Version)
    app.add_middleware(ModelVersionMiddleware)
    app.add_middleware(AnnounceMiddleware, holder=lambda: app.state.holder)
    app.add_middleware(RequestGuardMiddleware, max_body_bytes=max_body)
    # the X-*-Time headers: outside the body guard, so the total counts reading the body
    app.add_middleware(TimingMiddleware, metrics=lambda: app.state.metrics)
    app.add_middleware(
        MetricsMiddleware, metrics=lambda: app.state.metrics, routes=lambda: app.routes
    )
    # OpenAI's and TEI's error bodies on their routes (every error decided by errors.py)
    app.add_middleware(ErrorDialectMiddleware)
    # opt-in traces (ELMO_OTEL): before the app starts, so its middleware is in the stack
    otel = settings.otel if settings is not None else _env_flag("ELMO_OTEL")
    if otel:
        from elmo_api import tracing

        tracing.enable(app)
    return app


def _env_flag(name: str) -> bool:
    """A boolean setting read before the settings are (``uvicorn elmo_api.main:app``)."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


app = create_app()
