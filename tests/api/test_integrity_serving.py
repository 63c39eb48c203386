"""Never a wrong or non-finite vector with a 200.

Each test is a reproducer of an attack: a mix that overflows, a stored task
that would poison every user, a float16 overflow, a cache entry altered in
Redis, a model with NaN weights, a model name with a NUL byte, coerced types.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from elmo_api import outputs
from elmo_api.cache import LocalCache, SentenceCache, pack, token_digest
from elmo_api.encoding import decode_array
from elmo_api.main import create_app
from elmo_api.settings import load_settings
from elmo_cli.core import main as cli_main
from elmo_service.artifact import load_artifact, save_artifact
from elmo_service.embedder import Embedder
from elmo_service.errors import ArtifactError, ConfigError, InputError
from elmo_service.scalar_mix import MAX_GAMMA, MixSpec, ScalarMix
from elmo_service.settings_base import check_model_name
from elmo_service.tokenizers import WordTokenizer
from tests.support.core_fixtures import tiny_model
from tests.support.dialects import openai_as_ours

REPO = Path(__file__).resolve().parents[2]
ADMIN = {"Authorization": "Bearer admin-key"}


def _settings(model_dir, tmp_path, **kw):
    return load_settings(
        model_path=model_dir, threads=1, data_dir=tmp_path, admin_keys="admin-key", **kw
    )


def _err(r, status, field):
    raw = r.json()
    body = openai_as_ours(raw)
    if body is not raw:  # /v1/embeddings answers a bad request with OpenAI's 400
        status = 400 if status == 422 else status
    assert r.status_code == status, r.text
    assert set(body) == {"code", "message", "field"} and body["field"] == field, body
    return body


def _artifact(directory: Path, **tensors: float) -> Path:
    """The tiny model with some tensors filled with a value (manifest consistent)."""
    model = tiny_model(seed=3)
    with torch.no_grad():
        for name, value in tensors.items():
            dict(model.named_parameters())[name].fill_(value)
    save_artifact(model, WordTokenizer(), directory)
    return directory


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    s = _settings(tiny_model_dir, tmp_path_factory.mktemp("d"))
    with TestClient(create_app(s), raise_server_exceptions=False) as c:
        yield c


# -- 1. mixes: validated up front, checked on the result ------------------------------------------


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"mix": [0, 1, 2], "gamma": 1e308, "pooling": "mean"}, "gamma"),
        ({"mix": [0, 1, 2], "gamma": -1e5}, "gamma"),
        ({"mix": [1e308, -1e308, 0]}, "mix[0]"),
        ({"mix": [0, 1, 3e4]}, "mix[2]"),
        ({"mix": [0, 1, 2], "gamma": 1e5, "dtype": "float16"}, "gamma"),
    ],
)
def test_extreme_mixes_are_422_naming_the_field(client, extra, field):
    body = _err(client.post("/v1/embed", json={"sentences": ["hi there"], **extra}), 422, field)
    assert "finite" in body["message"]


def test_the_largest_allowed_mix_is_finite_and_correct(client, tiny_model_dir):
    """At the bounds softmax is still exact (shift-invariant) and the result finite."""
    w = [1e4, -1e4, 0.0]
    r = client.post(
        "/v1/embed",
        json={"sentences": ["hi there"], "mix": w, "gamma": MAX_GAMMA, "output": "both"},
    )
    assert r.status_code == 200, r.text
    d = r.json()["data"][0]
    layers, mix = decode_array(d["layers"]), decode_array(d["mix"])
    assert np.isfinite(mix).all()
    np.testing.assert_allclose(mix, MAX_GAMMA * layers[0], rtol=1e-5)  # all weight on layer 0


def test_softmax_is_stable_for_any_finite_weights():
    p = outputs.softmax([1e308, -1e308, 0.0])
    assert np.isfinite(p).all() and p.tolist() == [1.0, 0.0, 0.0]
    torch_mix = ScalarMix(3, weights=[1e4, -1e4, 0.0]).normalized_weights()
    assert torch.isfinite(torch_mix).all()


def test_mixspec_bounds_name_the_field():
    with pytest.raises(ConfigError) as e:
        MixSpec([0.0, 1.0, 2.0], gamma=1e308).validate(3, "weights", gamma_field="gamma")
    assert e.value.field == "gamma"
    with pytest.raises(ConfigError) as e:
        MixSpec([0.0, float("inf"), 2.0]).validate(3, "weights")
    assert e.value.field == "weights[1]"
    with pytest.raises(ConfigError):
        ScalarMix(3, gamma=1e308)  # the trainable module refuses it too


def test_a_task_with_gamma_1e308_cannot_be_stored(client):
    r = client.put("/v1/tasks/huge", json={"weights": [0, 1, 2], "gamma": 1e308}, headers=ADMIN)
    _err(r, 422, "gamma")
    r = client.put("/v1/tasks/huge", json={"weights": [0, 1e300, 2]}, headers=ADMIN)
    _err(r, 422, "weights[1]")
    assert client.get("/v1/tasks/huge").status_code == 404


def test_a_task_stored_before_the_bounds_is_refused_not_served(tiny_model_dir, tmp_path):
    """A tasks file written by an older version (or by hand) never yields null vectors."""
    bad = {"weights": [0.0, 1.0, 2.0], "gamma": 1e308, "per_direction": False}
    (tmp_path / "tasks.json").write_text(json.dumps({"tiny": {"poison": bad, "default": bad}}))
    with TestClient(create_app(_settings(tiny_model_dir, tmp_path))) as c:
        body = _err(c.post("/v1/embed", json={"sentences": ["a b"], "task": "poison"}), 422, "task")
        assert "poison" in body["message"] and "gamma" in body["message"]
        # the default mix (a stored 'default' task) of /v1/embed and /v1/embeddings
        _err(c.post("/v1/embed", json={"sentences": ["a b"], "output": "mix"}), 422, "task")
        r = c.post("/v1/embeddings", json={"input": "a b", "model": "tiny"})
        _err(r, 422, "task")


@pytest.fixture(scope="module")
def big_model_dir(tmp_path_factory):
    """Token-layer values of 1e6: finite in float32, beyond float16 (65504)."""
    return _artifact(
        tmp_path_factory.mktemp("big") / "big", **{"token_encoder.projection.bias": 1e6}
    )


def test_float16_overflow_is_422_on_dtype(big_model_dir, tmp_path):
    with TestClient(create_app(_settings(big_model_dir, tmp_path))) as c:
        for output in ("layers", "mix"):
            body = {"sentences": ["a b"], "output": output, "dtype": "float16"}
            msg = _err(c.post("/v1/embed", json=body), 422, "dtype")["message"]
            assert "float16" in msg and "sentences[0]" in msg
            body["dtype"] = "float32"
            r = c.post("/v1/embed", json=body)
            assert r.status_code == 200
            assert np.abs(decode_array(r.json()["data"][0][output])).max() > 65504


def test_a_mix_that_overflows_float32_names_gamma(tmp_path):
    huge = _artifact(tmp_path / "huge", **{"token_encoder.projection.bias": 3e35})
    with TestClient(create_app(_settings(huge, tmp_path))) as c:
        body = {"sentences": ["a b"], "mix": [10.0, -10.0, -10.0], "gamma": 1e4}
        assert "non-finite" in _err(c.post("/v1/embed", json=body), 422, "gamma")["message"]
        body["gamma"] = 1.0  # the same mix, unscaled, is finite
        assert c.post("/v1/embed", json=body).status_code == 200


def test_encode_checked_blames_the_right_party():
    x = np.array([1.0, np.inf], dtype=np.float32)
    with pytest.raises(InputError) as e:
        outputs.encode_checked(x, "json", "float32", what="sentences[0]", cause="task")
    assert e.value.field == "task"
    with pytest.raises(outputs.NonFiniteOutput) as e2:  # the model's own NaN: a 500, named
        outputs.encode_checked(x, "json", "float32", what="sentences[3]", cause=None)
    assert e2.value.field == "sentences[3]"
    big = np.array([1e5], dtype=np.float32)
    with pytest.raises(InputError) as e:
        outputs.encode_checked(big, "base64", "float16", what="input[0]", cause="gamma")
    assert e.value.field == "dtype"
    ok = outputs.encode_checked(big, "json", "float32", what="input[0]", cause=None)
    assert ok["shape"] == [1]


# -- 2. cache entries carry a checksum ------------------------------------------------------------


def _metric(c, name: str) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_redis_payload_altered_in_place_is_detected_deleted_and_recomputed(
    redis_server, tiny_model_dir, tmp_path
):
    redis_server.flushall()
    ref = Embedder.load(tiny_model_dir, threads=1)
    want = ref.embed(["the river bank"])[0].layers
    s = _settings(tiny_model_dir, tmp_path, redis_url=redis_server.url)
    r = redis_server.client()
    try:
        with TestClient(create_app(s)) as c:
            first = c.post("/v1/embed", json={"sentences": ["the river bank"]}).json()
            assert first["usage"]["cache_misses"] == 1
            (key,) = r.keys("elmo:emb:*")
            good = r.get(key)
            assert r.setrange(key, 64, b"ZZZZZZZZZZZZZZZZ")  # inside the vectors, not the header
            ttl_before = r.ttl(key)
            corrupt = 'elmo_cache_errors_total{kind="corrupt"}'
            before = _metric(c, corrupt)
            body = c.post("/v1/embed", json={"sentences": ["the river bank"]}).json()
            assert body["usage"] == {**body["usage"], "cache_hits": 0, "cache_misses": 1}
            np.testing.assert_allclose(decode_array(body["data"][0]["layers"]), want, atol=1e-5)
            assert _metric(c, corrupt) == before + 1
            assert r.get(key) == good  # replaced by the recomputed (identical) entry
            assert r.ttl(key) >= ttl_before  # a fresh entry, with a fresh TTL
            again = c.post("/v1/embed", json={"sentences": ["the river bank"]}).json()
            assert again["usage"]["cache_hits"] == 1
    finally:
        r.close()


def test_every_single_byte_flip_is_detected_in_memory_cache():
    cache = SentenceCache(
        LocalCache(1 << 20, 60), key_prefix="p", model_prefix="m", version="v1",
        dtype="float32", ttl=60, n_layers=2, dim=4,
    )  # fmt: skip
    toks = [["a", "b", "c"]]
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    digests = cache.digests(toks)
    blob = pack(x, "float32", "v1", digests[0])
    key = cache.key(digests[0])
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0x01
        cache.backend.set_many([(key, bytes(bad))], 60)
        assert cache.get(toks, digests) == [None], f"flip at byte {i} not detected"
        assert cache.backend.get_many([key]) == [None]  # deleted
    cache.put([x], digests)
    np.testing.assert_array_equal(cache.get(toks, digests)[0], x)
    assert token_digest(["a"]) != token_digest(["b"])


# -- 3. model loading refuses non-finite weights ---------------------------------------------------


@pytest.fixture(scope="module")
def nan_model_dir(tmp_path_factory):
    return _artifact(
        tmp_path_factory.mktemp("nan") / "nan", **{"forward_layers.1.w_hh.weight": float("nan")}
    )


def test_load_refuses_nan_weights_naming_the_tensor(nan_model_dir, tmp_path):
    with pytest.raises(ArtifactError) as e:
        load_artifact(nan_model_dir)
    assert e.value.field == "forward_layers.1.w_hh.weight"
    assert "non-finite" in e.value.message
    inf_dir = _artifact(tmp_path / "inf", **{"token_encoder.char_embed.weight": float("inf")})
    with pytest.raises(ArtifactError, match="token_encoder.char_embed.weight"):
        load_artifact(inf_dir)
    # huge but finite weights (their sum overflows: the fast path) are not refused
    big = _artifact(tmp_path / "big", **{"token_encoder.highways.0.bias": 3e38})
    bias = load_artifact(big).model.token_encoder.highways[0].bias.detach()
    assert float(bias.max()) == pytest.approx(3e38)


def test_embed_file_on_nan_weights_exits_non_zero_with_one_line(nan_model_dir, tmp_path, capsys):
    inp = tmp_path / "in.txt"
    inp.write_text("the bank\n")
    out = tmp_path / "out.hdf5"
    argv = ["embed-file", str(inp), str(out), "--model", str(nan_model_dir), "--quiet"]
    assert cli_main([*argv, "--threads", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "forward_layers.1.w_hh.weight" in err[0], err
    assert not out.exists() and not list(tmp_path.glob(".out.hdf5.*"))  # no temporary left


def _serve(model_dir: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    from tests.support.ports import free_port

    env = {**os.environ, "PYTHONPATH": str(REPO), "ELMO_DATA_DIR": str(tmp_path)}
    env.pop("REDIS_URL", None)
    cmd = [sys.executable, "-m", "elmo_cli.main", "serve", "--model", str(model_dir)]
    cmd += ["--port", str(free_port()), "--threads", "1"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)


@pytest.mark.slow
def test_serve_on_a_broken_artifact_is_one_line_and_non_zero(nan_model_dir, tmp_path):
    out = _serve(nan_model_dir, tmp_path)
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0
    assert len(lines) == 1, out.stderr  # no uvicorn traceback
    assert lines[0].startswith("error: ") and "forward_layers.1.w_hh.weight" in lines[0]


@pytest.mark.slow
def test_serve_on_a_truncated_weights_file_is_one_line(tiny_model_dir, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    w = broken / "weights.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    out = _serve(broken, tmp_path)
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0 and len(lines) == 1, out.stderr
    assert "weights.safetensors" in lines[0]


# -- 5. model names ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["default\x00", "a/b", "..", ".hidden", "a\\b", "", "x" * 65, "tab\there", "é"]
)
def test_model_names_are_validated_in_one_place(name):
    with pytest.raises(InputError) as e:
        check_model_name(name, "name")
    assert e.value.field == "name"


def test_activate_with_a_nul_byte_is_422_naming_the_field(client):
    for path in ("default%00", "default%00.json", "%2e%2e", "a%5cb"):
        r = client.post(f"/v1/models/{path}/activate", headers=ADMIN)
        assert r.status_code in (404, 422), (path, r.text)
        if r.status_code == 422:
            assert r.json()["field"] == "name"
    _err(client.post("/v1/models/default%00/activate", headers=ADMIN), 422, "name")
    with pytest.raises(ConfigError, match="ELMO_MODEL"):
        load_settings(model="default\x00")


# -- 10. strict request types, unknown fields ----------------------------------------------------------


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"layers": ["0"]}, "layers[0]"),
        ({"layers": [True]}, "layers[0]"),
        ({"layers": [0.0]}, "layers[0]"),
        ({"mix": [0, 1, 2], "per_direction": "false"}, "per_direction"),
        ({"mix": [0, 1, 2], "layer_norm": 1}, "layer_norm"),
        ({"mix": [0, True, 2]}, "mix[1]"),
        ({"mix": [0, 1, 2], "gamma": "1"}, "gamma"),
    ],
)
def test_no_coercion_in_request_types(client, extra, field):
    _err(client.post("/v1/embed", json={"sentences": ["a b"], **extra}), 422, field)


def test_unknown_fields_are_named(client):
    body = _err(client.post("/v1/embed", json={"sentence": ["a b"]}), 422, "sentence")
    assert "not permitted" in body["message"] and "'sentences'" in body["message"]
    _err(client.post("/v1/embed", json={"sentences": ["a"], "pooling2": "mean"}), 422, "pooling2")
    r = client.post("/v1/embeddings", json={"input": "a", "model": "tiny", "dimension": 16})
    assert "'dimensions'" in _err(r, 422, "dimension")["message"]
    r = client.post("/v1/embeddings", json={"input": "a", "model": "tiny", "dimensions": "16"})
    _err(r, 422, "dimensions")
    r = client.put("/v1/tasks/t", json={"weights": [0, 1, 2], "gama": 2}, headers=ADMIN)
    assert "'gamma'" in _err(r, 422, "gama")["message"]
    r = client.post("/v1/jobs", json={"corpus": "c.txt", "budget": {"stepz": 5}}, headers=ADMIN)
    assert "'steps'" in _err(r, 422, "budget.stepz")["message"]  # nested models too
