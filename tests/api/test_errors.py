"""Every documented limit and client mistake -> a 4xx JSON {code, message, field}; never a 500."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from elmo_api.main import create_app
from elmo_api.settings import load_settings
from elmo_service.errors import ConfigError
from tests.support.dialects import openai_as_ours

LIMITS = dict(
    max_sentences=4,
    max_tokens_per_sentence=8,
    max_chars=120,
    max_body_bytes=2048,
    openai_max_inputs=4,
    openai_max_chars=120,
)


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    s = load_settings(
        model_path=tiny_model_dir, threads=1, data_dir=tmp_path_factory.mktemp("d"), **LIMITS
    )
    with TestClient(create_app(s), raise_server_exceptions=False) as c:
        yield c


def _err(r, status, code=None, field=None):
    raw = r.json()
    body = openai_as_ours(raw)
    if body is not raw:  # /v1/embeddings answers a bad request with OpenAI's 400
        status = 400 if status == 422 else status
    assert r.status_code == status, r.text
    assert set(body) == {"code", "message", "field"}, body
    assert body["message"]
    if code is not None:
        assert body["code"] == code, body
    if field is not None:
        assert body["field"] == field, body
    return body


@pytest.mark.parametrize(
    "body, status, code, field",
    [
        ({"sentences": ["a"] * 5}, 413, "limit_exceeded", "sentences"),
        (
            {"sentences": ["one two three four five six seven eight nine"]},
            413,
            "limit_exceeded",
            "sentences[0]",
        ),
        ({"sentences": ["ok", ["a"] * 9]}, 413, "limit_exceeded", "sentences[1]"),
        ({"sentences": ["x" * 60, "y" * 61]}, 413, "limit_exceeded", "sentences"),
        ({"sentences": []}, 422, "invalid_input", "sentences"),
        ({"sentences": ["ok", "fine", 3]}, 422, "invalid_request", "sentences[2]"),
        ({"sentences": ["ok", ["a", 1]]}, 422, "invalid_request", "sentences[1]"),
        ({"sentences": "not a list"}, 422, "invalid_request", "sentences"),
        ({}, 422, "invalid_request", "sentences"),
        ({"sentences": ["a"], "bogus": 1}, 422, "invalid_request", "bogus"),
        ({"sentences": ["a"], "output": "everything"}, 422, "invalid_request", "output"),
        ({"sentences": ["a"], "pooling": "sum"}, 422, "invalid_request", "pooling"),
        ({"sentences": ["a"], "encoding": "hex"}, 422, "invalid_request", "encoding"),
        ({"sentences": ["a"], "dtype": "int8"}, 422, "invalid_request", "dtype"),
        ({"sentences": ["a"], "mix": [1, 2]}, 422, "invalid_config", "mix"),
        (
            {"sentences": ["a"], "mix": [1, 2, 3], "per_direction": True},
            422,
            "invalid_config",
            "mix",
        ),
        ({"sentences": ["a"], "mix": [1, "x", 3]}, 422, "invalid_request", "mix[1]"),
        ({"sentences": ["a"], "mix": [1, 2, 3], "task": "shipped"}, 422, "invalid_input", "mix"),
        ({"sentences": ["a"], "gamma": 2.0}, 422, "invalid_input", "gamma"),
        ({"sentences": ["a"], "task": "nope"}, 422, "unknown_task", "task"),
        ({"sentences": ["a"], "task": "shipped", "output": "layers"}, 422, "invalid_input", "task"),
        ({"sentences": ["a"], "layers": [0, 3]}, 422, "invalid_input", "layers[1]"),
        ({"sentences": ["a"], "layers": [1, 1]}, 422, "invalid_input", "layers[1]"),
        ({"sentences": ["a"], "layers": [-1]}, 422, "invalid_input", "layers[0]"),
        ({"sentences": ["a"], "layers": []}, 422, "invalid_input", "layers"),
        ({"sentences": ["a"], "output": "mix", "layers": [0]}, 422, "invalid_input", "layers"),
    ],
)
def test_embed_rejections(client, body, status, code, field):
    _err(client.post("/v1/embed", json=body), status, code, field)


def test_mix_message_names_expected_count(client):
    body = _err(
        client.post("/v1/embed", json={"sentences": ["a"], "mix": [1, 2]}), 422, field="mix"
    )
    assert "3 weights" in body["message"]


def test_body_limits(client):
    big = {"sentences": ["word " * 500]}
    _err(client.post("/v1/embed", json=big), 413, "body_too_large", "body")

    def chunks():  # no Content-Length: counted while streaming
        yield b'{"sentences": ["'
        for _ in range(50):
            yield b"x" * 100
        yield b'"]}'

    _err(
        client.post("/v1/embed", content=chunks(), headers={"content-type": "application/json"}),
        413,
        "body_too_large",
        "body",
    )


def test_malformed_json_and_content_type(client):
    h = {"content-type": "application/json"}
    _err(
        client.post("/v1/embed", content=b'{"sentences": [', headers=h), 400, "invalid_json", "body"
    )
    _err(client.post("/v1/embed", content=b"\xff\xfe", headers=h), 400, "invalid_json", "body")
    _err(client.post("/v1/embed", content=b"[1, 2]", headers=h), 422, "invalid_request")
    _err(client.post("/v1/embed", content=b"null", headers=h), 422, "invalid_request")
    _err(
        client.post(
            "/v1/embed", content=b'{"sentences": ["a"]}', headers={"content-type": "text/plain"}
        ),
        415,
        "unsupported_media_type",
        "content-type",
    )
    # curl -d labels JSON as a form: the body is read as JSON, and real form data is not JSON
    _err(client.post("/v1/embed", data={"sentences": "a"}), 400, "invalid_json", "body")
    r = client.post(
        "/v1/embed",
        content=b'{"sentences": ["The bank of the river."]}',
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 200 and r.json()["data"][0]["tokens"]
    _err(client.post("/v1/embed"), 422, "invalid_request", "body")
    # application/*+json and a charset are fine
    r = client.post(
        "/v1/embed",
        content=b'{"sentences": ["a"]}',
        headers={"content-type": "application/json; charset=utf-8"},
    )
    assert r.status_code == 200


def test_unknown_routes_and_methods(client):
    _err(client.get("/v1/nothing"), 404, "not_found")
    r = client.get("/v1/embed")
    _err(r, 405, "method_not_allowed")
    assert r.headers["allow"] == "POST"
    # a path several routes serve: the 405 lists every one of its methods (#50)
    r = client.post("/v1/tasks/x", json={})
    _err(r, 405, "method_not_allowed")
    assert set(r.headers["allow"].split(", ")) == {"DELETE", "GET", "PUT"}, r.headers
    _err(client.get("/v1/tasks/nope"), 404, "not_found", "name")
    _err(client.get("/v1/models/other"), 404, "not_found", "model_id")


def test_openai_rejections(client):
    ok = {"input": "hello", "model": "tiny"}
    _err(
        client.post("/v1/embeddings", json={**ok, "model": "gpt-4"}),
        404,
        "model_not_found",
        "model",
    )
    _err(
        client.post("/v1/embeddings", json={**ok, "dimensions": 7}),
        422,
        "invalid_input",
        "dimensions",
    )
    _err(client.post("/v1/embeddings", json={**ok, "input": []}), 422, "invalid_input", "input")
    _err(
        client.post("/v1/embeddings", json={**ok, "input": ["a"] * 5}),  # ELMO_OPENAI_MAX_INPUTS
        413,
        "limit_exceeded",
        "input",
    )
    _err(
        client.post("/v1/embeddings", json={**ok, "input": ["a", "b " * 9]}),
        413,
        "limit_exceeded",
        "input[1]",
    )
    # token ids are OpenAI's input too (api/token_ids.py); a negative one is no id
    _err(client.post("/v1/embeddings", json={**ok, "input": [[1, -2]]}), 422, "invalid_request")
    _err(
        client.post("/v1/embeddings", json={**ok, "encoding_format": "hex"}),
        422,
        "invalid_request",
        "encoding_format",
    )
    r = client.post("/v1/embeddings", json={**ok, "dimensions": 16})
    assert r.status_code == 200


def test_auth(tiny_model_dir, tmp_path):
    s = load_settings(
        model_path=tiny_model_dir,
        threads=1,
        data_dir=tmp_path,
        api_keys="user-key",
        admin_keys="admin-key",
    )
    with TestClient(create_app(s)) as c:
        body = {"sentences": ["a"]}
        r = c.post("/v1/embed", json=body)
        _err(r, 401, "unauthorized", "authorization")
        assert r.headers["www-authenticate"] == "Bearer"
        _err(
            c.post("/v1/embed", json=body, headers={"authorization": "Bearer wrong"}),
            401,
            "unauthorized",
        )
        _err(
            c.post("/v1/embed", json=body, headers={"authorization": "Basic dXNlcg=="}),
            401,
            "unauthorized",
        )
        for key in ("user-key", "admin-key"):
            assert (
                c.post(
                    "/v1/embed", json=body, headers={"authorization": f"Bearer {key}"}
                ).status_code
                == 200
            )
        _err(c.get("/v1/models"), 401)
        task = {"weights": [0, 0, 1]}
        _err(
            c.put("/v1/tasks/t", json=task, headers={"authorization": "Bearer user-key"}),
            403,
            "forbidden",
        )
        _err(c.put("/v1/tasks/t", json=task), 401, "unauthorized")
        assert (
            c.put(
                "/v1/tasks/t", json=task, headers={"authorization": "Bearer admin-key"}
            ).status_code
            == 201
        )
        # health and metrics stay open
        assert c.get("/healthz").status_code == 200
        assert c.get("/readyz").status_code == 200
        assert c.get("/metrics").status_code == 200


def test_writes_refused_without_admin_keys(client):
    _err(client.put("/v1/tasks/t", json={"weights": [0, 0, 1]}), 403, "forbidden")
    _err(client.delete("/v1/tasks/t"), 403, "forbidden")


@pytest.mark.parametrize(
    "env, name",
    [
        ({"ELMO_THREADS": "0"}, "ELMO_THREADS"),
        ({"ELMO_CACHE_DTYPE": "int8"}, "ELMO_CACHE_DTYPE"),
        ({"ELMO_MAX_SENTENCES": "lots"}, "ELMO_MAX_SENTENCES"),
        ({"REDIS_URL": "http://localhost"}, "REDIS_URL"),
        ({"ELMO_REQUEST_TIMEOUT": "-1"}, "ELMO_REQUEST_TIMEOUT"),
        ({"ELMO_REQUEST_TIMEOUT": "inf"}, "ELMO_REQUEST_TIMEOUT"),  # passes gt=0, not finite
        ({"ELMO_BATCH_FILL_WAIT_MS": "nan"}, "ELMO_BATCH_FILL_WAIT_MS"),
        ({"ELMO_MAX_SENTENCES": "100", "ELMO_MAX_QUEUE": "10"}, "ELMO_MAX_QUEUE"),
    ],
)
def test_bad_settings_fail_with_a_clear_message(monkeypatch, env, name):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError) as e:
        load_settings()
    assert name in e.value.message


def test_bad_settings_fail_startup(monkeypatch, tmp_path):
    from elmo_api.main import create_app as factory

    monkeypatch.setenv("ELMO_CACHE_TTL", "0")
    with pytest.raises(ConfigError, match="ELMO_CACHE_TTL"), TestClient(factory()):
        pass
    monkeypatch.delenv("ELMO_CACHE_TTL")
    monkeypatch.setenv("ELMO_MODEL_PATH", str(tmp_path / "missing"))
    with pytest.raises(Exception, match="does not exist"), TestClient(factory()):
        pass


def test_no_500_on_garbage_bodies(client):
    h = {"content-type": "application/json"}
    for raw in [b"{}", b'{"sentences": null}', b'{"sentences": [null]}', b'{"sentences": [[[]]]}', b'"x"', b"1e999",
                b'{"sentences": ["a"], "layers": [1.5]}', b'{"sentences": ["a"], "mix": [1e400, 0, 0]}',
                b'{"sentences": ["a"], "mix": [NaN, 0, 0]}', b'{"sentences": ["\\ud800"]}']:  # fmt: skip
        r = client.post("/v1/embed", content=raw, headers=h)
        assert 400 <= r.status_code < 500 or r.status_code == 200, (raw, r.status_code, r.text)
        if r.status_code != 200:
            assert set(r.json()) == {"code", "message", "field"}


def test_settings_from_env_file_and_plain_redis_url(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ELMO_ENV_FILE", ".env")  # the default outside the tests
    (tmp_path / ".env").write_text(
        "ELMO_MAX_SENTENCES=7\nELMO_ADMIN_KEYS=a, b\nREDIS_URL=redis://127.0.0.1:1/0\nELMO_MODEL=other\n"
    )
    s = load_settings()
    assert (
        s.max_sentences == 7
        and s.admin_keys == ["a", "b"]
        and s.redis_url == "redis://127.0.0.1:1/0"
    )
    assert s.resolved_model_path == s.models_dir / "other"
    monkeypatch.setenv("ELMO_MODEL_PATH", str(tmp_path / "explicit"))
    assert (
        load_settings().resolved_model_path == tmp_path / "explicit"
    )  # wins over models_dir/model


def test_unknown_fields_are_named(client):
    # the typo README readers make: "sentence" for "sentences"
    r = client.post("/v1/embed", json={"sentence": ["a b"]})
    _err(r, 422, "invalid_request", "sentence")
    assert (
        r.json()["message"] == "sentence: unknown field, not permitted (did you mean 'sentences'?)"
    )
    r = client.post("/v1/embed", json={"sentences": ["a b"], "poolng": "mean"})
    _err(r, 422, "invalid_request", "poolng")
    assert r.json()["message"] == "poolng: unknown field, not permitted (did you mean 'pooling'?)"
    r = client.post("/v1/embeddings", json={"inputs": ["a"], "model": "tiny"})
    assert "did you mean 'input'" in _err(r, 422, "invalid_request", "inputs")["message"]
