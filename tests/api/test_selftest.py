"""The self-test: stored at export beside the artifact (outside its manifest), run by
``GET /v1/selftest``, required by ``/readyz`` when asked, shown in the fleet view -- and
a tampered weights file that the loader accepts is caught by the vectors alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save_file

from elmo_api.main import create_app
from elmo_api.settings import load_settings
from elmo_service.artifact import (
    FORMAT,
    MANIFEST,
    WEIGHTS,
    load_artifact,
    read_manifest,
    version_of,
)
from elmo_service.atomic import sha256_file
from elmo_service.selftest import (
    META,
    REL_BOUND,
    SENTENCES,
    VECTORS,
    compare,
    load_selftest,
    write_selftest,
)

ADMIN = {"Authorization": "Bearer admin"}


@pytest.fixture(scope="module")
def with_selftest(tiny_model_dir, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("st") / "tiny"
    shutil.copytree(tiny_model_dir, d)
    before = read_manifest(d)
    write_selftest(d)
    assert read_manifest(d) == before  # the manifest, and so the model version, unchanged
    return d


def _client(path: Path, tmp_path: Path, **extra) -> TestClient:
    s = load_settings(
        model_path=path, threads=1, data_dir=tmp_path, admin_keys="admin", cache=False, **extra
    )
    return TestClient(create_app(s))


def test_stored_selftest_round_trips_and_matches_itself(with_selftest):
    st = load_selftest(with_selftest)
    assert st is not None and len(st.tokens) == len(SENTENCES) == 8
    lengths = [len(t) for t in st.tokens]
    assert min(lengths) <= 2 and max(lengths) >= 30  # varied lengths
    assert st.meta["model_version"] == read_manifest(with_selftest)["version"]
    for toks, v in zip(st.tokens, st.vectors, strict=True):
        assert v.dtype == np.float32 and v.shape[1] == len(toks) and np.isfinite(v).all()
    same = compare(st.vectors, [v.copy() for v in st.vectors])
    assert same["within_bound"] and same["max_abs_diff"] == 0.0
    # just past the bound on one value of the largest magnitude: caught
    off = [v.copy() for v in st.vectors]
    i = int(np.argmax(np.abs(off[6])))
    scale = max(1.0, abs(float(off[6].flat[i])))
    off[6].flat[i] += 3 * REL_BOUND * scale
    bad = compare(st.vectors, off)
    assert not bad["within_bound"] and bad["worst_sentence"] == 6
    assert bad["max_rel_diff"] == pytest.approx(3 * REL_BOUND, rel=1e-2)


def test_selftest_route_passes_alone_and_batched_and_needs_an_admin_key(with_selftest, tmp_path):
    with _client(with_selftest, tmp_path, api_keys="user") as c:
        assert c.get("/v1/selftest").status_code == 401
        assert c.get("/v1/selftest", headers={"Authorization": "Bearer user"}).status_code == 403
        r = c.get("/v1/selftest", headers=ADMIN)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["ok"] is True and body["status"] == "passed" and body["sentences"] == 8
        assert body["alone"]["within_bound"] and body["batched"]["within_bound"]
        assert 0.0 <= body["max_rel_diff"] <= REL_BOUND
        assert body["model"]["version"] == read_manifest(with_selftest)["version"]
        # the fleet view (a fleet of one without Redis) shows this replica's result
        fleet = c.get("/v1/models", headers=ADMIN).json()["fleet"]
        assert fleet["replicas"][0]["selftest"]["status"] == "passed"


def _tamper(src: Path, dst: Path) -> None:
    """Scale one recurrent weight matrix by 1.01 and rewrite the manifest to match: the loader's checks
    (hashes, names, shapes, finite values) all pass, only the vectors are wrong."""
    shutil.copytree(src, dst)
    state = load_file(str(dst / WEIGHTS))
    name = "forward_layers.0.w_hh.weight"  # a recurrent weight: every token after the first
    state[name] = (state[name] * 1.01).contiguous()
    save_file(state, str(dst / WEIGHTS), metadata={"format": FORMAT})
    manifest = json.loads((dst / MANIFEST).read_text())
    manifest["files"][WEIGHTS] = sha256_file(dst / WEIGHTS)
    manifest["version"] = version_of(manifest["files"])
    (dst / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    load_artifact(dst)  # the artifact's own checks pass


def test_tampered_weights_fail_the_selftest_readyz_and_the_fleet_view(with_selftest, tmp_path):
    bad = tmp_path / "models" / "tampered"
    _tamper(with_selftest, bad)
    with _client(bad, tmp_path, ready_requires_selftest=True) as c:
        r = c.get("/readyz")
        assert r.status_code == 503, r.text
        assert r.json()["code"] == "selftest_failed" and r.json()["selftest"]["ok"] is False
        body = c.get("/v1/selftest", headers=ADMIN).json()
        assert body["ok"] is False and body["status"] == "failed"
        assert body["max_rel_diff"] > REL_BOUND
        assert not body["alone"]["within_bound"] and not body["batched"]["within_bound"]
        fleet = c.get("/v1/models", headers=ADMIN).json()["fleet"]
        assert fleet["replicas"][0]["selftest"]["ok"] is False


def test_readyz_requires_a_pass_only_when_asked(with_selftest, tmp_path):
    with _client(with_selftest, tmp_path, ready_requires_selftest=True) as c:
        r = c.get("/readyz")
        assert r.status_code == 200, r.text
        assert r.json()["selftest"]["status"] == "passed"
    with _client(with_selftest, tmp_path) as c:  # not asked: not run
        r = c.get("/readyz")
        assert r.status_code == 200 and r.json()["selftest"] is None


def test_absent_or_corrupt_selftest_is_said_not_passed(tiny_model_dir, with_selftest, tmp_path):
    with _client(tiny_model_dir, tmp_path, ready_requires_selftest=True) as c:
        r = c.get("/v1/selftest", headers=ADMIN)
        assert r.status_code == 404 and r.json()["code"] == "selftest_absent"
        assert c.get("/readyz").status_code == 503
    broken = tmp_path / "broken"
    shutil.copytree(with_selftest, broken)
    t = load_file(str(broken / VECTORS))
    t["s0"] = t["s0"] + 1.0
    save_file(t, str(broken / VECTORS))
    with pytest.raises(Exception, match="does not match"):
        load_selftest(broken)
    with _client(broken, tmp_path) as c:
        body = c.get("/v1/selftest", headers=ADMIN).json()
        assert body["status"] == "error" and body["ok"] is False
    assert json.loads((broken / META).read_text())["vectors_sha256"]


def test_export_and_convert_write_a_selftest(tmp_path):
    """``elmo-service convert``'s writer stores one (export calls the same writer)."""
    from elmo_service.convert import convert_bilm
    from tests.support.bilm_fixtures import write_bilm

    opts, weights = write_bilm(tmp_path / "src")
    out = tmp_path / "converted"
    convert_bilm(opts, weights, out)
    st = load_selftest(out)
    assert st is not None and st.meta["model_version"] == read_manifest(out)["version"]


def test_a_run_the_model_cannot_take_now_is_not_kept(with_selftest):
    """Overloaded / timed out / closed: answered as an error, tried again on the next call."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from elmo_api.admission import QueueFull
    from elmo_api.selftest import ensure_selftest

    class Refusing:
        calls = 0

        async def embed(self, token_lists, timeout=None, **kw):
            Refusing.calls += 1
            raise QueueFull("interactive queue full")

    io = ThreadPoolExecutor(1)
    served = SimpleNamespace(
        name="tiny", version="v", path=with_selftest, io=io, runner=Refusing(),
        request_timeout=1.0, selftest=None, selftest_run=None,
        embedder=SimpleNamespace(precision="fp32", weights="fp32"),
    )  # fmt: skip

    async def main():
        first = await ensure_selftest(served)
        second = await ensure_selftest(served)
        return first, second

    first, second = asyncio.run(main())
    io.shutdown()
    assert first["status"] == second["status"] == "error" and first["ok"] is False
    assert "QueueFull" in first["error"] and served.selftest is None and Refusing.calls == 2
