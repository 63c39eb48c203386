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

Exporting is the process's tracer provider's business: when none is set up (e.g. by
``opentelemetry-instrument``), :func:`enable` sets one up from OpenTelemetry's standard
variables -- ``OTEL_TRACES_EXPORTER`` (``otlp``, the default; ``console``; ``none``),
``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``_PROTOCOL``, ``OTEL_SERVICE_NAME``,
``OTEL_TRACES_SAMPLER`` -- and logs one line saying where spans go.
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


_said = ["tracing on"]  # the start line (logged by the app's start, once logging is set up)


def announce() -> None:
    """One line at the app's start: tracing is on and where its spans go."""
    if _active is not None:
        log.info("%s", _said[0])


def _exporters(names: str) -> list[tuple[Any, str]]:
    """OpenTelemetry's ``OTEL_TRACES_EXPORTER`` (comma-separated: ``otlp``, the default;
    ``console``; ``none``) as (span processor, where its spans go)."""
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
    )

    out = []
    for name in (n.strip().lower() for n in names.split(",") if n.strip()):
        if name == "none":
            continue
        if name == "console":  # each span printed as it ends (stdout), for a look by hand
            out.append((SimpleSpanProcessor(ConsoleSpanExporter()), "the console (stdout)"))
        elif name == "otlp":
            protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
                "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
            )
            if protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            exporter = OTLPSpanExporter()
            where = getattr(exporter, "_endpoint", None) or os.environ.get(
                "OTEL_EXPORTER_OTLP_ENDPOINT", "the OTLP default endpoint"
            )
            out.append((BatchSpanProcessor(exporter), f"OTLP ({protocol}) at {where}"))
        else:
            log.warning("OTEL_TRACES_EXPORTER=%s: unknown exporter %r, ignored", names, name)
    return out


def _default_provider() -> None:
    """An SDK provider exporting where OpenTelemetry's variables say (``OTEL_TRACES_EXPORTER``,
    ``OTEL_EXPORTER_OTLP_*``, ``OTEL_SERVICE_NAME``, ``OTEL_TRACES_SAMPLER``), when nobody
    set one up; one log line says where spans go."""
    from opentelemetry import trace

    if type(trace.get_tracer_provider()).__name__ != "ProxyTracerProvider":
        if _said[0] == "tracing on":  # not ours (an app made twice keeps the first line)
            _said[0] = "tracing on: spans go to the tracer provider already set up " + (
                f"({type(trace.get_tracer_provider()).__name__})"
            )
        return  # the operator's (opentelemetry-instrument, a test's in-memory exporter)
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        exporters = _exporters(os.environ.get("OTEL_TRACES_EXPORTER", "otlp"))
    except ImportError as e:
        log.warning(
            "tracing on, but spans are made and dropped: %s (pip install 'elmo-service[otel]')",
            e,
        )
        return
    name = os.environ.get("OTEL_SERVICE_NAME") or "elmo-service"  # the operator's wins
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    for processor, _ in exporters:
        provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    where = "; ".join(w for _, w in exporters) or "nowhere (OTEL_TRACES_EXPORTER=none)"
    _said[0] = f"tracing on: service {name!r}, spans go to {where}"


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
