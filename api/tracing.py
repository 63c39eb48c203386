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

Where spans go follows OpenTelemetry's standard variables: unless the process
already has a tracer provider (``opentelemetry-instrument``, a test's), :func:`enable`
sets up an SDK one from ``OTEL_TRACES_EXPORTER`` (``otlp``, the default; ``console``:
each span printed as JSON on stdout; ``none``), ``OTEL_EXPORTER_OTLP_ENDPOINT`` and
``OTEL_EXPORTER_OTLP_PROTOCOL`` (``http/protobuf``; ``grpc`` with its exporter
installed), ``OTEL_SERVICE_NAME`` (default ``elmo-service``), ``OTEL_RESOURCE_ATTRIBUTES``
and ``OTEL_TRACES_SAMPLER``/``_ARG``. One start line says tracing is on and where
spans go.
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


def _exporters() -> list[str]:
    """OpenTelemetry's ``OTEL_TRACES_EXPORTER``: a comma-separated list, ``otlp`` unset."""
    raw = os.environ.get("OTEL_TRACES_EXPORTER", "").strip() or "otlp"
    return [e.strip().lower() for e in raw.split(",") if e.strip()]


def _otlp_exporter() -> tuple[Any, str]:
    """The OTLP span exporter ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`` asks for, and where it
    sends (the exporters read the endpoint, headers and timeout variables themselves)."""
    from elmo_service.errors import ConfigError

    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    try:
        if protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            where = endpoint or "http://localhost:4318"
        elif protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            where = endpoint or "http://localhost:4317"
        else:
            raise ConfigError(
                f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: use http/protobuf or grpc",
                field="OTEL_EXPORTER_OTLP_PROTOCOL",
            )
    except ImportError as e:
        pkg = "opentelemetry-exporter-otlp-proto-" + ("grpc" if protocol == "grpc" else "http")
        raise ConfigError(
            f"OTEL_TRACES_EXPORTER=otlp over {protocol} needs {pkg} (pip install {pkg})",
            field="OTEL_TRACES_EXPORTER",
        ) from e
    return OTLPSpanExporter(), f"OTLP {protocol} at {where}"


def _default_provider() -> str:
    """An SDK provider exporting where OpenTelemetry's standard variables say, unless one is
    set up already; answers where spans go, for the one start line."""
    from opentelemetry import trace

    from elmo_service.errors import ConfigError

    names = _exporters()
    unknown = [n for n in names if n not in ("otlp", "console", "none")]
    if unknown:
        raise ConfigError(
            f"OTEL_TRACES_EXPORTER={','.join(unknown)!r}: use otlp, console or none",
            field="OTEL_TRACES_EXPORTER",
        )
    if type(trace.get_tracer_provider()).__name__ != "ProxyTracerProvider":
        # the operator's (opentelemetry-instrument, a test's in-memory exporter)
        return "the tracer provider already set up in this process"
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
    )

    # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, the provider
    # OTEL_TRACES_SAMPLER(_ARG); only the service name's fallback is ours
    attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": "elmo-service"}
    provider = TracerProvider(resource=Resource.create(attrs))
    where = []
    if "none" not in names:
        if "console" in names:
            # one JSON object per span on stdout, as each ends (a look, not a pipeline)
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
            where.append("the console (stdout)")
        if "otlp" in names:
            exporter, to = _otlp_exporter()
            provider.add_span_processor(BatchSpanProcessor(exporter))
            where.append(to)
    trace.set_tracer_provider(provider)
    return " and ".join(where) or "nowhere (OTEL_TRACES_EXPORTER=none: spans are made and dropped)"


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
    where = _default_provider()
    FastAPIInstrumentor.instrument_app(app, excluded_urls="healthz,readyz,metrics")
    if _active is None:  # once a process (importing elmo_api.main builds an app too)
        log.info("tracing on (ELMO_OTEL=true): spans go to %s", where)
    _active = _Tracing()


def disable() -> None:
    """Tracing off again (tests; an instrumented app stays instrumented)."""
    global _active
    _active = None
