"""/docs works offline (Swagger UI from the package, no CDN); /metrics labels every route."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from elmo_api.main import create_app
from elmo_api.settings import load_settings


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    s = load_settings(model_path=tiny_model_dir, threads=1, data_dir=tmp_path_factory.mktemp("d"))
    with TestClient(create_app(s), raise_server_exceptions=False) as c:
        yield c


def test_docs_page_loads_nothing_from_other_hosts(client):
    r = client.get("/docs")
    assert r.status_code == 200 and "swagger" in r.text.lower()
    refs = re.findall(r"""(?:src|href)=["']([^"']+)["']""", r.text)
    refs += re.findall(r"""url: ['"]([^'"]+)['"]""", r.text)
    assert refs, r.text
    assert not [u for u in refs if "//" in u], f"external references in /docs: {refs}"
    assert '"validatorUrl": null' in r.text  # no badge fetched from swagger.io
    js = [u for u in refs if u.endswith(".js")]
    css = [u for u in refs if u.endswith(".css")]
    assert js and css
    for url in js + css + ["/openapi.json"]:
        got = client.get(url)
        assert got.status_code == 200 and len(got.content) > 1000, url
    assert "SwaggerUIBundle" in client.get(js[0]).text


def _count(text: str, route: str, method: str, status: str) -> float:
    m = re.search(
        rf'elmo_requests_total{{method="{method}",route="{re.escape(route)}",status="{status}"}} (\S+)',
        text,
    )
    return float(m.group(1)) if m else 0.0


def test_metrics_label_every_route(client):
    before = client.get("/metrics").text
    # the README's first curl: `curl -d` sends no JSON content type (the guard rewrites the scope)
    r = client.post(
        "/v1/embed",
        content=b'{"sentences": ["The bank of the river."]}',
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 200, r.text
    assert client.get("/docs").status_code == 200
    assert client.get("/openapi.json").status_code == 200
    assert client.get("/static-offline-docs/swagger-ui.css").status_code == 200
    assert client.get("/v1/tasks/shipped").status_code == 200
    assert client.delete("/readyz").status_code == 405
    assert client.get("/no/such/route").status_code == 404
    after = client.get("/metrics").text
    for route, method, status in [
        ("/v1/embed", "POST", "200"),
        ("/docs", "GET", "200"),
        ("/openapi.json", "GET", "200"),
        ("/static-offline-docs/{path}", "GET", "200"),
        ("/v1/tasks/{name}", "GET", "200"),
        ("/readyz", "DELETE", "405"),
        ("unmatched", "GET", "404"),
    ]:
        assert _count(after, route, method, status) == _count(before, route, method, status) + 1, (
            route,
            method,
        )
    assert _count(after, "unmatched", "POST", "200") == 0
