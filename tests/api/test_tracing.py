"""Opt-in OpenTelemetry: a caller's traceparent is continued through the batcher to the
model call (the SDK's in-memory exporter), and none of our tracing is imported when off."""

from __future__ import annotations

import subprocess
import sys

import pytest
from fastapi.testclient import TestClient

from elmo_api import tracing
from elmo_api.main import create_app
from elmo_api.settings import load_settings

otel_sdk = pytest.importorskip("opentelemetry.sdk.trace", reason="the otel extra")

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def exporter():
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exp = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # the first SDK provider of the process
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exp))
    yield exp
    tracing.disable()


def test_traceparent_is_continued_to_the_model_call(tiny_model_dir, tmp_path, exporter):
    s = load_settings(
        model_path=tiny_model_dir, threads=1, data_dir=tmp_path, cache=False, otel=True
    )
    with TestClient(create_app(s)) as c:
        assert tracing.active()
        exporter.clear()
        r = c.post(
            "/v1/embed",
            json={"sentences": ["the river bank .", "a"]},
            headers={"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN}-01"},
        )
        assert r.status_code == 200, r.text
        r2 = c.post("/v1/embed", json={"sentences": ["another trace"]})  # no traceparent
        assert r2.status_code == 200
    spans = exporter.get_finished_spans()
    ours = [sp for sp in spans if format(sp.context.trace_id, "032x") == TRACE_ID]
    names = {sp.name for sp in ours}
    assert tracing.SPAN_NAME in names, names
    model = next(sp for sp in ours if sp.name == tracing.SPAN_NAME)
    assert model.attributes["elmo.batch.sentences"] == 2
    # parented inside the request: its chain of parents reaches the caller's span
    by_id = {sp.context.span_id: sp for sp in ours}
    parent, hops = model.parent, 0
    while parent is not None and parent.span_id in by_id and hops < 10:
        parent, hops = by_id[parent.span_id].parent, hops + 1
    assert parent is not None and format(parent.span_id, "016x") == PARENT_SPAN
    assert model.end_time > model.start_time
    # the other request's model call is in a trace of its own, not in ours
    others = [sp for sp in spans if sp.name == tracing.SPAN_NAME and sp not in ours]
    assert others and all(format(sp.context.trace_id, "032x") != TRACE_ID for sp in others)


@pytest.mark.slow
def test_off_by_default_imports_no_tracing(tiny_model_dir, tmp_path):
    code = f"""
import sys
from fastapi.testclient import TestClient
from elmo_api.main import create_app
from elmo_api.settings import load_settings
s = load_settings(model_path={str(tiny_model_dir)!r}, threads=1, data_dir={str(tmp_path)!r})
with TestClient(create_app(s)) as c:
    assert c.post("/v1/embed", json={{"sentences": ["a b"]}}).status_code == 200
# FastAPI itself imports opentelemetry-api (its own no-op hooks); ours -- the SDK and the
# instrumentation -- stays out, and no context is captured per sentence
ours = ("opentelemetry.sdk", "opentelemetry.instrumentation")
bad = sorted(m for m in sys.modules if m.startswith(ours))
assert not bad, bad
from elmo_api import tracing
assert not tracing.active() and tracing.capture() is None
print("clean")
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={**__import__("os").environ, "ELMO_ENV_FILE": "", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert out.returncode == 0 and "clean" in out.stdout, out.stderr[-2000:]


@pytest.mark.slow
def test_console_exporter_in_a_real_server_prints_the_spans(tmp_path):
    """OpenTelemetry's own variables drive a real server: OTEL_TRACES_EXPORTER=console prints
    each span (the request's and its batch's model call), and one start line says so."""
    import json
    import signal

    import httpx

    from tests.support.replicas import REPO, Replica

    rep = Replica(
        {
            "ELMO_MODEL_PATH": str(REPO / "models" / "default"),
            "ELMO_DATA_DIR": str(tmp_path / "data"),
            "ELMO_CACHE": "false",
            "ELMO_OTEL": "true",
            "OTEL_TRACES_EXPORTER": "console",
            "OTEL_SERVICE_NAME": "elmo-test",
        },
        tmp_path,
        "traced",
    ).start()
    try:
        rep.wait_ready(120)
        r = httpx.post(rep.url + "/v1/embed", json={"sentences": ["the river bank"]}, timeout=60)
        assert r.status_code == 200
        rep.proc.send_signal(signal.SIGTERM)
        rep.proc.wait(30)
        log = rep.log.read_text(errors="replace")
        assert "tracing on: service 'elmo-test', spans go to the console" in log, log[-3000:]
        assert '"name": "elmo.model_batch"' in log, log[-3000:]
        spans = [json.loads(m) for m in _json_objects(log) if '"trace_id"' in m]
        server = next(s for s in spans if s["name"] == "POST /v1/embed")
        batches = [s for s in spans if s["name"] == "elmo.model_batch"]
        # the request's trace holds the model call that computed it (the warm-up's are roots)
        mine = [b for b in batches if b["context"]["trace_id"] == server["context"]["trace_id"]]
        assert len(mine) == 1 and mine[0]["parent_id"] is not None, batches
        assert mine[0]["resource"]["attributes"]["service.name"] == "elmo-test"
    finally:
        rep.stop()


def _json_objects(text: str) -> list[str]:
    """The top-level ``{...}`` blocks the console exporter printed (one per span)."""
    out, depth, start = [], 0, None
    for i, ch in enumerate(text):
        if ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
            if depth == 0:
                out.append(text[start : i + 1])
    return out
