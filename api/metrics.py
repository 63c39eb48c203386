"""Prometheus metrics, one registry per app (tests build many apps).

Names follow TEI's where they overlap: requests and latencies by route and
status, queue depth (also per priority lane), batch sizes in sentences and tokens,
tokens embedded (``rate(elmo_tokens_total[1m])`` is tokens/s), cache
hits/misses/errors, and each embedding answer's phases per lane
(``elmo_request_phase_seconds{lane, phase}``: the ``X-*-Time`` headers' figures).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.routing import BaseRoute, Mount

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_TOKEN_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "elmo_requests",
            "HTTP requests by route, method and status",
            ["route", "method", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "elmo_request_duration_seconds",
            "HTTP request latency by route, method and status",
            ["route", "method", "status"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("elmo_queue_depth", "Sentences waiting for the model", registry=r)
        self.batch_sentences = Histogram(
            "elmo_batch_sentences", "Sentences per model batch", buckets=_SIZE_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            "elmo_batch_tokens", "Padded tokens per model batch", buckets=_TOKEN_BUCKETS, registry=r
        )
        self.batch_seconds = Histogram(
            "elmo_batch_duration_seconds",
            "Forward pass time per model batch",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_seconds = Histogram(
            "elmo_queue_duration_seconds", "Time a sentence waits before its batch starts",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.tokens = Counter(
            "elmo_tokens", "Tokens run through the model (rate = tokens/s)", registry=r
        )
        self.tokens_served = Counter(
            "elmo_tokens_served", "Tokens returned to clients, cached or not", registry=r
        )
        self.dropped = Counter(
            "elmo_dropped_sentences",
            "Queued sentences dropped before the model",
            ["reason"],
            registry=r,
        )
        self.rejected = Counter(
            "elmo_rejected_requests", "Requests refused by the batcher", ["reason"], registry=r
        )
        # priority lanes (api/batcher.py) and where each embedding answer's time went
        self.lane_queue_depth = Gauge(
            "elmo_lane_queue_depth", "Sentences waiting for the model, per lane", ["lane"],
            registry=r,
        )  # fmt: skip
        self.lane_rejected = Counter(
            "elmo_lane_rejected_requests", "Requests refused by the batcher, per lane and reason",
            ["lane", "reason"], registry=r,
        )  # fmt: skip
        self.phase_seconds = Histogram(
            "elmo_request_phase_seconds",
            "Embedding answers' time per lane and phase (total, tokenization, queue, "
            "inference): the X-*-Time headers' figures",
            ["lane", "phase"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.seconds_per_token = Gauge(
            "elmo_model_seconds_per_token",
            "Measured model time per token (moving average): admission control's estimate",
            registry=r,
        )
        self.cache_hits = Counter("elmo_cache_hits", "Sentence cache hits", registry=r)
        self.cache_misses = Counter("elmo_cache_misses", "Sentence cache misses", registry=r)
        self.cache_errors = Counter(
            "elmo_cache_errors", "Cache backend errors and corrupt entries", ["kind"], registry=r
        )
        self.model_info = Gauge("elmo_model_info", "Served model", ["model", "version"], registry=r)
        self.ready = Gauge("elmo_ready", "1 when the model is loaded and warmed", registry=r)
        self.fleet_state_age = Gauge(
            "elmo_fleet_state_age_seconds",
            "With Redis: seconds since this replica last read the fleet's desired model",
            registry=r,
        )
        self.fleet_stale = Gauge(
            "elmo_fleet_stale",
            "1 when this replica could not read the fleet's state for over ELMO_FLEET_TTL",
            registry=r,
        )

    def observe_batch(self, started: float, took: float, batch: list) -> None:
        """One model call of ``batch`` (queued sentences: ``tokens``, ``cost``, ``enqueued``)
        that started at ``started`` (perf_counter) and took ``took`` seconds."""
        for it in batch:
            self.queue_seconds.observe(started - it.enqueued)
        self.batch_seconds.observe(took)
        self.batch_sentences.observe(len(batch))
        self.batch_tokens.observe(len(batch) * max(it.cost for it in batch))
        self.tokens.inc(sum(len(it.tokens) for it in batch))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def route_label(scope: Scope, routes: Sequence[BaseRoute]) -> str:
    """The route template a request matched (a bounded label set), from what the router
    left in the scope: FastAPI routes record themselves as ``route``; plain Starlette
    routes (``/openapi.json``) and mounts (the docs' static files) only their ``endpoint``,
    which is looked up among the app's routes."""
    path = getattr(scope.get("route"), "path", None)
    if path:
        return path
    endpoint = scope.get("endpoint")
    if endpoint is not None:
        for r in routes:
            if isinstance(r, Mount) and r.app is endpoint:
                return r.path + "/{path}"
            if getattr(r, "endpoint", None) is endpoint and getattr(r, "path", None):
                return r.path
    return "unmatched"


class MetricsMiddleware:
    """Counts every HTTP response (including errors from inner middleware) by route template."""

    def __init__(
        self,
        app: ASGIApp,
        metrics: Callable[[], Metrics | None],
        routes: Callable[[], Sequence[BaseRoute]] = list,
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            m = self.metrics()
            if m is not None:
                labels = (
                    route_label(scope, self.routes()),
                    scope.get("method", ""),
                    str(status[0]),
                )
                m.requests.labels(*labels).inc()
                m.latency.labels(*labels).observe(time.perf_counter() - start)
