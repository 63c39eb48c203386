"""One batching owner on the serving path, and the serving weight mode.

The server's batcher plans batches with ``elmo_service.bilm.runner.plan_batches`` and hands
each one to ``Embedder.run_batch``; the embedder must not plan again. ``ELMO_WEIGHTS``
picks the int8 / bf16 paths, whose vectors never share cache entries with fp32 ones.
"""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from elmo_api.cache import cache_key
from elmo_api.encoding import decode_array
from elmo_api.main import create_app
from elmo_api.settings import load_settings
from elmo_service.bilm.runner import BatchBudget, plan_batches
from elmo_service.embedder import Embedder
from elmo_service.errors import ConfigError

SENTENCES = [
    "a b c d e f g h i j k l",
    "one",
    "two words",
    "the cat sat on the mat",
    "the cat sat on the mat and then it slept",
    "x y",
]


def test_plan_batches_budget_order_and_determinism():
    costs = [5, 32, 7, 7, 7, 7, 3, 14]
    budget = BatchBudget(tokens=40, sentences=3)
    batches = plan_batches(costs, budget)
    assert sorted(i for b in batches for i in b) == list(range(len(costs)))
    for b in batches:
        assert len(b) <= 3
        assert len(b) == 1 or len(b) * max(costs[i] for i in b) <= 40
        assert [costs[i] for i in b] == sorted((costs[i] for i in b), reverse=True)
    # equal costs keep their input order: the same input always gives the same batches
    assert [i for b in batches for i in b if costs[i] == 7] == [2, 3, 4, 5]
    assert plan_batches(costs, budget) == batches
    assert plan_batches([100], BatchBudget(tokens=10)) == [[0]]  # too long: a batch alone


@pytest.mark.parametrize(
    "field,kw", [("batch_tokens", {"tokens": 0}), ("max_batch_sentences", {"sentences": 0})]
)
def test_bad_budget_names_the_field(field, kw):
    with pytest.raises(ConfigError) as e:
        BatchBudget(**kw)
    assert e.value.field == field


def test_served_batches_are_planned_once(tiny_model_dir, tmp_path, monkeypatch):
    """Through HTTP: the embedder's own planner never runs, every model call is one planned
    batch under the budget, and the vectors equal the library's."""
    ref = [e.layers for e in Embedder.load(tiny_model_dir, threads=1).embed(SENTENCES)]
    calls: list[list[int]] = []
    real_run_batch = Embedder.run_batch

    def spy_run_batch(self, sentences):
        calls.append([len(s) + 2 for s in sentences])
        return real_run_batch(self, sentences)

    def no_replanning(self, lengths):
        raise AssertionError("the serving path planned twice")

    monkeypatch.setattr(Embedder, "run_batch", spy_run_batch)
    monkeypatch.setattr(Embedder, "plan_batches", no_replanning)
    settings = load_settings(
        model_path=tiny_model_dir, threads=1, data_dir=tmp_path, batch_tokens=40, cache=False
    )
    with TestClient(create_app(settings)) as client:
        calls.clear()  # warm-up ran before
        r = client.post("/v1/embed", json={"sentences": SENTENCES, "output": "layers"})
        assert r.status_code == 200, r.text
        got = [decode_array(d["layers"]) for d in r.json()["data"]]
    assert calls, "the model never ran"
    assert sum(len(c) for c in calls) == len(SENTENCES)
    for costs in calls:
        assert len(costs) == 1 or len(costs) * max(costs) <= 40
        assert costs == sorted(costs, reverse=True)
    for a, b in zip(ref, got, strict=True):
        assert a.shape == b.shape
        assert np.abs(a - b).max() <= 1e-5


@pytest.mark.parametrize("mode", ["int8", "bf16"])
def test_rounded_weights_setting_serves_its_vectors_under_their_own_cache_key(
    tiny_model_dir, tmp_path, mode
):
    """ELMO_WEIGHTS=int8|bf16: the vectors of that path, its own cache keys, and
    GET /v1/models names the path and its certificate."""
    fp32 = Embedder.load(tiny_model_dir, threads=1)
    expected = [e.layers for e in fp32.embed(SENTENCES[:3])]
    settings = load_settings(model_path=tiny_model_dir, threads=1, data_dir=tmp_path, weights=mode)
    with TestClient(create_app(settings)) as client:
        r = client.post("/v1/embed", json={"sentences": SENTENCES[:3], "output": "layers"})
        assert r.status_code == 200, r.text
        got = [decode_array(d["layers"]) for d in r.json()["data"]]
        served = client.app.state.holder.current
        assert served.embedder.weights == mode
        assert served.embedder.cache_key_prefix != fp32.cache_key_prefix
        key = served.cache.key(b"\0" * 32)  # the same sentence's key under fp32: another
        fp32_key = cache_key(settings.redis_prefix, fp32.cache_key_prefix, served.cache.dtype,
                             b"\0" * 32)  # fmt: skip
        assert f":w-{mode}:" in key and key != fp32_key
        info = client.get("/v1/models").json()["data"][0]
        assert info["speed_path"] == f"cpu-native {mode}"
        cert = info["certificate"]
        assert cert["weights"] == mode and 0 < cert["max_rel_diff"] < 1.0  # a tiny random model
    errors = [float(np.abs(a - b).max()) for a, b in zip(expected, got, strict=True)]
    assert all(np.isfinite(b).all() for b in got)
    # rounded weights: close to fp32, and really not the fp32 computation
    assert max(errors) <= 0.05 * max(float(np.abs(a).max()) for a in expected)
    assert max(errors) > 0


def test_fp32_serves_exact_path_without_certificate(tiny_model_dir, tmp_path):
    settings = load_settings(model_path=tiny_model_dir, threads=1, data_dir=tmp_path)
    with TestClient(create_app(settings)) as client:
        info = client.get("/v1/models").json()["data"][0]
        assert info["speed_path"] == "cpu-native fp32" and info["certificate"] is None
        assert ":w-" not in client.app.state.holder.current.cache.key(b"\0" * 32)


def test_bad_weights_setting_fails_at_startup_naming_it(monkeypatch):
    monkeypatch.setenv("ELMO_WEIGHTS", "int4")
    with pytest.raises(ConfigError, match="ELMO_WEIGHTS"):
        load_settings()


def test_warm_up_runs_one_sentence_alone_too(tiny_model_dir, tmp_path, monkeypatch):
    """A single sentence takes another path of the CPU kernel: the warm-up pays its first
    call before /readyz, not the first one-sentence request."""
    import elmo_service.bilm.kernels.bilstm as bilstm

    rows: list[int] = []
    real = bilstm.BiLstmKernel.__call__

    def spy(self, x, active, *rest):
        rows.append(x.shape[2])
        return real(self, x, active, *rest)

    monkeypatch.setattr(bilstm.BiLstmKernel, "__call__", spy)
    s = load_settings(model_path=tiny_model_dir, threads=1, data_dir=tmp_path)
    with TestClient(create_app(s)) as c:
        assert c.get("/readyz").status_code == 200
        assert 1 in rows and any(n > 1 for n in rows)
