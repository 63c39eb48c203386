"""The stated determinism bound holds on the bundled model's hardest inputs: byte-fallback
pieces, long sentences, random batch mixes, alone vs batched, through the library and through the server (cached and not)."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from elmo_api.encoding import decode_array
from elmo_api.main import create_app
from elmo_api.settings import load_settings
from elmo_service.embedder import Embedder
from tests.support.determinism import same_vectors

torch.set_num_threads(1)
pytestmark = pytest.mark.slow  # the bundled model, many batches

MODEL = Path(__file__).resolve().parents[2] / "models" / "default"
HARD = [
    "Emoji 🙂🚀🧪 and symbols ∀x∈ℝ: x² ≥ 0 ⇒ ✓",
    "中文句子，混合 English 和 日本語のテキスト。",
    "Ελληνικά, русский, עברית, العربية, हिन्दी, ไทย ...",
    "ﬁ ligatures ﬂ, fullwidth ＡＢＣ１２３, math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    " ".join(chr(0x1F300 + 7 * i) for i in range(30)),
    "".join(chr(0x4E00 + 331 * i) for i in range(40)),
    "The long one . " * 60,
    "A plain sentence about banks and rivers .",
]


@pytest.fixture(scope="module")
def emb():
    return Embedder.load(MODEL, threads=1)


def test_batched_equals_alone_within_the_bound(emb):
    toks = [[t.piece for t in ts] for ts in emb.tokenize(HARD)]
    alone = [emb.run_batch([t])[0] for t in toks]
    rng = random.Random(15)
    worst = 0.0
    for _ in range(6):
        idx = rng.sample(range(len(toks)), rng.randint(2, len(toks)))
        for i, got in zip(idx, emb.run_batch([toks[i] for i in idx]), strict=True):
            assert same_vectors(got, alone[i]), (HARD[i], np.abs(got - alone[i]).max())
            worst = max(worst, float(np.abs(got - alone[i]).max()))
    assert worst > 0  # the paths really differ: the bound is not vacuous


def test_the_server_holds_the_bound(emb, tmp_path):
    want = {s: emb.embed([s])[0].layers for s in HARD}
    s = load_settings(model_path=MODEL, threads=1, data_dir=tmp_path)
    with TestClient(create_app(s)) as c:
        for _ in range(2):  # computed, then from the cache
            r = c.post("/v1/embed", json={"sentences": HARD, "encoding": "base64"})
            assert r.status_code == 200
            for text, d in zip(HARD, r.json()["data"], strict=True):
                assert same_vectors(decode_array(d["layers"]), want[text]), text
