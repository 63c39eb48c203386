"""The rounded-weights fast paths (``weights="int8"`` / ``"bf16"``) against exact fp32, on
real shapes: the bundled model and a random model of the original ELMo's proportions.
Correctness only (speed: ``bench/bench_latency.py``)."""

from pathlib import Path

import numpy as np
import pytest

from elmo_service.artifact import Artifact
from elmo_service.bilm.config import ELMO_FILTERS
from elmo_service.bilm.kernels.certificate import SENTENCES
from elmo_service.convert import load_bilm
from elmo_service.embedder import Embedder
from elmo_service.tokenizers import WordTokenizer
from tests.support.bilm_fixtures import write_bilm

pytestmark = pytest.mark.slow  # four certificates measured on real shapes (~15 s each)

ROOT = Path(__file__).resolve().parents[2]
# the certified bounds the docs state on these models (docs/bench-embedder.md, per sentence:
# any value within max_rel_diff x the sentence's largest, its rms within rms_rel_diff)
BOUND = {"int8": 0.2, "bf16": 0.1}
RMS_BOUND = {"int8": 5e-2, "bf16": 2e-2}


def original_like(tmp_path: Path) -> Artifact:
    """bilm-tf random weights in the original's proportions (cell = 8 x projection, the
    original's filters, 2 highways, clips 3), scaled down to 512/64 to stay quick."""
    options, weights = write_bilm(
        tmp_path / "orig", n_characters=262, filters=[list(f) for f in ELMO_FILTERS],
        char_dim=16, clip=3.0, lstm_dim=512, projection_dim=64, n_highway=2,
    )  # fmt: skip
    model, _ = load_bilm(options, weights)
    return Artifact(path=tmp_path, config=model.cfg, tokenizer=WordTokenizer(), model=model,
                    version="orig-like")  # fmt: skip


def check_path(fp32: Embedder, fast: Embedder, mode: str) -> None:
    cert = fast.certificate
    assert cert["weights"] == mode and cert["path"] == f"cpu-native {mode}"
    assert 1e-6 < cert["max_rel_diff"] <= BOUND[mode], cert
    assert 1e-6 < cert["rms_rel_diff"] <= RMS_BOUND[mode], cert
    # measured independently here: the worst sentence alone, relative to the set's scale
    ref = fp32.embed(list(SENTENCES))
    scale = max(float(np.abs(r.layers).max()) for r in ref)
    worst = max(
        float(np.abs(fast.embed([s])[0].layers - r.layers).max())
        for s, r in zip(SENTENCES, ref, strict=True)
    )
    assert np.isfinite(worst) and 0 < worst / scale <= BOUND[mode]
    assert worst / scale <= cert["max_rel_diff"] * (1 + 1e-3) + 1e-9


@pytest.mark.parametrize("mode", ["int8", "bf16"])
def test_bundled_model_fast_path_error_bound(mode):
    fp32 = Embedder.load(ROOT / "models" / "default", threads=1, token_cache_size=0)
    fast = Embedder.load(ROOT / "models" / "default", threads=1, weights=mode)
    check_path(fp32, fast, mode)


@pytest.mark.parametrize("mode", ["int8", "bf16"])
def test_original_like_model_fast_path_error_bound(tmp_path, mode):
    art = original_like(tmp_path)
    fp32 = Embedder(art, device="cpu", token_cache_size=0)
    fast = Embedder(art, device="cpu", weights=mode)
    check_path(fp32, fast, mode)
