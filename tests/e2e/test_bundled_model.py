"""The bundled default model is what the docs say it is.

`make serve` serves ``models/default``. It must be the artifact that
``configs/default.yaml`` trains (its provenance records the config, the step
and the corpus manifest), its files must match its manifest, and it ships the
``pos`` task learned by ``elmo-pretrain probe pos``, usable through
``/v1/embed`` as ``"task": "pos"``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from elmo_api.encoding import decode_array
from elmo_api.main import create_app
from elmo_api.settings import load_settings
from elmo_pretrain.config import RESUMABLE_KEYS, TrainConfig, flatten, load_config
from elmo_service.artifact import load_artifact
from elmo_service.embedder import Embedder, apply_mix

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "default"


def config_diff(recorded: dict, want, ignore) -> dict:
    """Keys where a recorded training config differs from ``want``: {key: (recorded, want)}."""
    got = flatten(TrainConfig.from_dict(recorded).to_dict())  # options added later: defaults

    def same(k: str, v) -> bool:
        if k == "train.precision" and v == "auto":  # auto is what the machine makes of it
            return got.get(k) in ("auto", "bf16", "fp32")
        return got.get(k) == (list(v) if isinstance(v, tuple) else v)

    return {
        k: (got.get(k), v)
        for k, v in flatten(want.to_dict()).items()
        if not same(k, v) and k not in ignore
    }


@pytest.fixture(scope="module")
def bundled():
    return load_artifact(MODEL)  # checks every file against manifest.json


def test_bundled_model_was_trained_by_the_committed_config(bundled):
    prov = bundled.provenance
    want = load_config(ROOT / "configs" / "default.yaml")
    diff = config_diff(prov["training_config"], want, RESUMABLE_KEYS - {"train.steps"})
    assert not diff, f"models/default was not trained by configs/default.yaml: {diff}"
    # the finished run, not an interim export
    assert prov["step"] == want.train.steps
    held = prov["heldout"]
    assert held["predictions"] > 50_000 and 1 < held["avg_ppl"] < 200
    sources = prov["corpus"]["sources"]["sources"]
    assert {s["name"] for s in sources} >= {"sotu", "shakespeare", "kjv", "austen", "moby_dick"}
    assert all(len(s["sha256"]) == 64 for s in sources)


def test_bundled_model_ships_a_learned_pos_task(bundled):
    pos = bundled.tasks["pos"]
    assert len(pos.weights) == bundled.config.n_output_layers
    assert pos.meta["model_version"] == bundled.version
    assert pos.meta["learned_by"] == "elmo-pretrain probe"
    assert pos.meta["test_accuracy"] > 0.9


@pytest.mark.slow
def test_pos_task_works_through_the_api(bundled, tmp_path):
    text = "The old man the boats."
    settings = load_settings(model_path=MODEL, threads=1, data_dir=tmp_path)
    with TestClient(create_app(settings)) as c:
        r = c.post(
            "/v1/embed",
            json={"sentences": [text], "output": "mix", "task": "pos", "granularity": "word"},
        )
        assert r.status_code == 200, r.text
        body = r.json()
    assert body["model"]["version"] == bundled.version
    got = decode_array(body["data"][0]["mix"])
    ref = Embedder(bundled, device="cpu").embed([text])[0]
    words, layers = ref.words()
    want = apply_mix(layers, bundled.tasks["pos"])
    assert got.shape == (len(words), 2 * bundled.config.projection_dim) and len(words) >= 5
    assert np.abs(got - want).max() <= 1e-4


# -- models/ptb: the literature benchmark's LM ------------------------------

PTB = ROOT / "models" / "ptb"
PTB_CONFIG = "ptb.yaml"


def test_a_pretokenized_word_the_sentencepiece_model_drops_is_refused(bundled):
    """sentencepiece normalises some characters away (a zero-width space): such a word
    would leave no token, and the output would hold fewer words than given."""
    from elmo_service.errors import InputError

    emb = Embedder(bundled)
    assert len(emb.tokenize([["New York", "city"]])[0]) >= 2  # a word with a space is fine
    with pytest.raises(InputError) as e:
        emb.tokenize([["a", "b"], ["a", "\u200b", "c"]])
    assert e.value.field == "sentences[1][1]" and "no character" in e.value.message
    with pytest.raises(InputError) as e:
        emb.embed([["x", "  "]])
    assert e.value.field == "sentences[0][1]"


def test_bundled_ptb_lm_is_the_finished_committed_config():
    import json

    run = json.loads((PTB / "run.json").read_text())
    want = load_config(ROOT / "configs" / PTB_CONFIG)
    diff = config_diff(run["config"], want, RESUMABLE_KEYS)
    assert not diff, f"models/ptb was not trained by configs/{PTB_CONFIG}: {diff}"
    assert run["lm"]["step"] == want.train.steps
    assert (PTB / "lm.safetensors").stat().st_size <= 30 * 2**20  # the size bound


def test_bundled_ptb_lm_evaluates_exactly(tmp_path):
    from elmo_pretrain.evaluate import evaluate

    # Mikolov-style text (lower case, N for numbers, <unk>): in-domain, so a
    # trained LM is far below the 10k-word uniform perplexity
    text = tmp_path / "ptb-like.txt"
    text.write_text(
        " the company said it expects to report a loss for the third quarter \n"
        " shares of the company rose N cents to $ N in new york stock exchange trading \n"
        " mr. <unk> is chairman of this <unk> group \n"
    )
    res = evaluate(PTB, file=str(text), threads=1)
    assert (
        res["sentences"] == 3
        and res["step"] == load_config(ROOT / "configs" / PTB_CONFIG).train.steps
    )
    assert res["predictions"] == sum(
        len(line.split()) + 1 for line in text.read_text().splitlines()
    )
    assert 1.0 < res["forward_ppl"] < 100.0  # 7.3 when committed; random weights give ~10,000
