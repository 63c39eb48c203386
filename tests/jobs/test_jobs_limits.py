"""Job configs are bounded by what a worker can hold: the memory estimate (exact parameter
count, activations measured against real runs in docs/reliability.md) refuses a job above
ELMO_JOBS_MAX_MEMORY with a 422 naming the field that weighs most."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from fastapi.testclient import TestClient

from elmo_api.main import create_app
from elmo_jobs.memory import RUNTIME_BYTES, check_memory, estimate, memory_limit
from elmo_jobs.runner import JobFailed, JobRunner
from elmo_pretrain.config import TrainConfig, apply_overrides
from elmo_pretrain.lm import LanguageModel
from elmo_service.errors import ConfigError
from tests.jobs.test_jobs import ADMIN, TINY_CONFIG, dirs, job_body, settings_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def idle(tiny_model_dir, tmp_path):
    d = dirs(tmp_path)
    s = settings_for(tiny_model_dir, d, jobs_embedded_worker=False, jobs_max_memory="4GiB")
    with TestClient(create_app(s)) as c:
        yield c


def with_config(**sections: dict[str, Any]) -> dict[str, Any]:
    body = job_body()
    body["config"] = {k: {**v, **sections.get(k, {})} for k, v in TINY_CONFIG.items()}
    return body


@pytest.mark.parametrize(
    ("patch", "prepare", "field"),
    [
        ({"model": {"lstm_dim": 10_000_000}}, {}, "config.model.lstm_dim"),
        ({"data": {"tokens_per_batch": 100_000_000}}, {}, "config.data.tokens_per_batch"),
        ({"model": {"filters": [[1, 4], [2, 60_000]]}}, {}, "config.model.filters"),
        ({"model": {"projection_dim": 4096}}, {"vocab_size": 2_000_000}, "prepare.vocab_size"),
    ],
)
def test_a_job_too_big_for_a_worker_is_refused_naming_the_field(idle, patch, prepare, field):
    body = with_config(**patch)
    body["prepare"] = {**body["prepare"], **prepare}
    r = idle.post("/v1/jobs", json=body, headers=ADMIN)
    assert r.status_code == 422, r.text
    err = r.json()
    assert err["field"] == field and err["code"] == "invalid_config", err
    assert "GiB of memory" in err["message"] and "4.0 GiB" in err["message"]
    assert idle.get("/v1/jobs", headers=ADMIN).json()["data"] == []  # nothing was queued


@pytest.mark.slow
def test_a_job_within_the_bound_is_accepted(idle):
    r = idle.post("/v1/jobs", json=with_config(model={"lstm_dim": 256}), headers=ADMIN)
    assert r.status_code == 202, r.text


def tiny_cfg(*sets: str) -> TrainConfig:
    raw = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    return TrainConfig.from_dict(apply_overrides(raw, ["data.path=x", *sets]))


@pytest.mark.parametrize(
    "sets",
    [
        (),
        ("model.n_highway=2", "model.n_layers=3", "softmax.kind=full"),
        ("softmax.kind=adaptive", "softmax.cutoffs=[50, 100]", "model.char_dim=7"),
    ],
)
def test_the_parameter_count_is_the_models(sets):
    cfg = tiny_cfg(*sets)
    vocab = 300
    table = torch.zeros(vocab, cfg.model.max_chars_per_token, dtype=torch.long)
    lm = LanguageModel(cfg.model, cfg.softmax, vocab, table, cfg.train.directions)
    real = sum(p.numel() for p in lm.parameters())
    est = estimate(cfg.to_dict(), vocab)
    if cfg.softmax.kind == "adaptive":  # the estimate counts a full V x P softmax: an upper bound
        assert real <= est.parameters <= real + vocab * cfg.model.projection_dim
    else:
        assert est.parameters == real
    assert est.state_bytes == 16 * est.parameters  # adam: weights, grads, two moments
    assert est.total == est.state_bytes + est.activation_bytes + RUNTIME_BYTES


def test_the_limit_and_the_worker_side_check(tmp_path):
    assert memory_limit(123, 0.5) == 123
    assert 0 < memory_limit(None, 0.5) < memory_limit(None, 1.0)
    cfg = tiny_cfg("model.lstm_dim=100000").to_dict()
    with pytest.raises(ConfigError) as e:
        check_memory(cfg, 300, 2**30, "corpus")
    assert e.value.field == "config.model.lstm_dim"
    # the worker checks again with the prepared corpus's vocabulary and its own memory
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text(json.dumps({"vocab": {"softmax_size": 300}}))
    me = SimpleNamespace(settings=SimpleNamespace(jobs_max_memory=2**30, jobs_memory_fraction=0.5))
    with pytest.raises(JobFailed, match=r"config.model.lstm_dim: .* \(on this worker\)"):
        JobRunner._check_memory(me, cfg, data)
    JobRunner._check_memory(me, tiny_cfg().to_dict(), data)  # fits: no error
