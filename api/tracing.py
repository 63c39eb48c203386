"""Opt-in OpenTelemetry traces (``ELMO_OTEL=true``, the ``otel`` extra).

When on, the app is instrumented with OpenTelemetry's FastAPI instrumentation (a
caller's ``traceparent`` header is continued: the request's server span joins
the caller's trace), each queued sentence carries its request's context across
the batcher's thread, and the model call of every batch is a span
(``elmo.model_batch``) parented to each request it serves: one request can be
followed from the balancer to the batch that computed its vectors, and the
batch's attributes say what else rode with it.

When off (the default) nothing of OpenTelemetry is imported: :func:`capture`
answers None and :func:`model_call` a no-op, each after one global read.

Exporting is the process's tracer provider's business (OpenTelemetry's own
``OTEL_*`` variables, or ``opentelemetry-instrument``); when none is set up and
the OTLP exporter is installed, :func:`enable` sets up an SDK provider that
exports over OTLP/HTTP (``OTEL_EXPORTER_OTLP_ENDPOINT``).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

log = logging.getLogger("elmo_api.tracing")

SPAN_NAME = "elmo.model_batch"


class _Tracing:
    """What the batcher needs of OpenTelemetry, built only when tracing is on."""

    def __init__(self) -> None:
        from opentelemetry import context, trace

        self._context = context
        self._trace = trace
        self.tracer = trace.get_tracer("elmo-service")

    def capture(self) -> Any:
        return self._context.get_current()

    @contextlib.contextmanager
    def model_call(self, items: Sequence[Any]) -> Iterator[None]:
        # one span per distinct request context: each request's trace holds the model call
        # that computed it; all of them share the batch's attributes and time
        contexts: list[Any] = []
        for it in items:
            if it.trace is not None and not any(it.trace is c for c in contexts):
                contexts.append(it.trace)
        if not contexts:
            yield
            return
        attributes = {
            "elmo.batch.sentences": len(items),
            "elmo.batch.requests": len(contexts),
            "elmo.batch.padded_tokens": len(items) * max(it.cost for it in items),
            "elmo.batch.interactive": sum(it.lane == "interactive" for it in items),
        }
        spans = [
            self.tracer.start_span(SPAN_NAME, context=ctx, attributes=attributes)
            for ctx in contexts
        ]
        try:
            yield
        except BaseException as e:
            for s in spans:
                s.record_exception(e)
                s.set_status(self._trace.Status(self._trace.StatusCode.ERROR, str(e)))
            raise
        finally:
            for s in spans:
                s.end()


_active: _Tracing | None = None


def active() -> bool:
    return _active is not None


def capture() -> Any:
    """The current request's tracing context (None when tracing is off)."""
    return None if _active is None else _active.capture()


def model_call(items: Sequence[Any]) -> contextlib.AbstractContextManager[None]:
    """A span around one batch's model call, in each of its requests' traces."""
    if _active is None:
        return contextlib.nullcontext()
    return _active.model_call(items)


def _default_provider() -> None:
    """An SDK provider exporting over OTLP/HTTP, when nobody set one up and both are here."""
    from opentelemetry import trace

    if type(trace.get_tracer_provider()).__name__ != "ProxyTracerProvider":
        return  # the operator's (opentelemetry-instrument, a test's in-memory exporter)
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning(
            "ELMO_OTEL=true but no tracer provider is set up and the OTLP exporter is not "
            "installed: spans are made and dropped (pip install "
            "opentelemetry-exporter-otlp-proto-http, or run under opentelemetry-instrument)"
        )
        return
    name = os.environ.get("OTEL_SERVICE_NAME") or "elmo-service"  # the operator's wins
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)


def enable(app: Any) -> None:
    """Turn tracing on for ``app`` (at app creation, before it starts)."""
    global _active
    try:
        from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    except ImportError as e:
        from elmo_service.errors import ConfigError

        raise ConfigError(
            "ELMO_OTEL=true needs the otel extra: pip install 'elmo-service[otel]'",
            field="ELMO_OTEL",
        ) from e
    _default_provider()
    FastAPIInstrumentor.instrument_app(app, excluded_urls="healthz,readyz,metrics")
    _active = _Tracing()


def disable() -> None:
    """Tracing off again (tests; an instrumented app stays instrumented)."""
    global _active
    _active = None
