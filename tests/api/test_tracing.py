"""Opt-in OpenTelemetry: a caller's traceparent is continued through the batcher to the
model call (the SDK's in-memory exporter), and none of our tracing is imported when off."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

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
        env={**os.environ, "ELMO_ENV_FILE": "", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert out.returncode == 0 and "clean" in out.stdout, out.stderr[-2000:]


@contextlib.contextmanager
def _serving(tiny_model_dir, tmp_path, **env_extra):
    """A real `elmo-service serve` process, ready; -> (its URL, a dict that gets its output
    as "out" once it has stopped)."""
    import socket

    from tests.support.procs import terminate

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "ELMO_ENV_FILE": "", "OMP_NUM_THREADS": "1", **env_extra}
    for k in [k for k in env if k.startswith("OTEL_") and k not in env_extra]:
        del env[k]  # the caller's own OTEL_* would change what is asserted
    path, seen = tmp_path / "out.log", {}
    with open(path, "w") as log:
        p = subprocess.Popen(
            [sys.executable, "-m", "elmo_cli.main", "serve", "--port", str(port),
             "--model", str(tiny_model_dir), "--threads", "1"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        try:
            _until_ready(p, f"http://127.0.0.1:{port}")
            yield f"http://127.0.0.1:{port}", seen
        finally:
            terminate(p, wait=30)
    seen["out"] = path.read_text()


def _until_ready(p, url):
    import httpx

    deadline = time.monotonic() + 180  # a deadline poll: load and warm-up, however loaded
    while time.monotonic() < deadline:
        assert p.poll() is None, "the server exited"
        try:
            if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("not ready in 180 s")


def _start_line(out: str) -> str:
    lines = [line for line in out.splitlines() if "tracing on" in line]
    assert len(lines) == 1, out[-3000:]  # one line, however many apps the process built
    return lines[0]


@pytest.mark.slow
def test_console_exporter_prints_the_spans_of_an_embed_request(tiny_model_dir, tmp_path):
    """The documented look at a trace: ELMO_OTEL=true OTEL_TRACES_EXPORTER=console, a real
    server process; an /v1/embed request's spans come out on stdout, in one trace."""
    import httpx

    env = {"ELMO_OTEL": "true", "OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "elmo-test"}
    with _serving(tiny_model_dir, tmp_path, **env) as (url, seen):
        r = httpx.post(
            url + "/v1/embed",
            json={"sentences": ["the river bank ."]},
            headers={"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN}-01"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
    out = seen["out"]
    assert "spans go to the console" in _start_line(out)
    # ConsoleSpanExporter: one indented JSON object per span, each starting at "{" alone
    spans, buf = [], None
    for line in out.splitlines():
        if line == "{":
            buf = [line]
        elif buf is not None:
            buf.append(line)
            if line == "}":
                spans.append(json.loads("\n".join(buf)))
                buf = None
    ours = [s for s in spans if s["context"]["trace_id"] == "0x" + TRACE_ID]
    names = {s["name"] for s in ours}
    assert tracing.SPAN_NAME in names and any("/v1/embed" in n for n in names), names
    assert all(s["resource"]["attributes"]["service.name"] == "elmo-test" for s in ours)


@pytest.mark.slow
def test_exporter_none_says_spans_go_nowhere(tiny_model_dir, tmp_path):
    with _serving(tiny_model_dir, tmp_path, ELMO_OTEL="true", OTEL_TRACES_EXPORTER="none") as (
        _,
        seen,
    ):
        pass
    assert "nowhere" in _start_line(seen["out"])
    assert "4318" not in seen["out"]  # no OTLP exporter retrying a collector nobody runs


def test_an_unknown_exporter_is_a_config_error_naming_the_variable(monkeypatch):
    from elmo_service.errors import ConfigError

    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console,zipkinn")
    with pytest.raises(ConfigError) as e:
        tracing._default_provider()
    assert e.value.field == "OTEL_TRACES_EXPORTER" and "zipkinn" in e.value.message
