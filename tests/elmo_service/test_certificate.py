"""The fast paths' certificate is a bound (#56 item 5): measured on a large generated set
(``kernels/certificate.py`` ``certificate_texts``) times a stated margin, it holds on text
it never saw (another seed, other scripts, every sentence alone and batched), and it is
measured once per model, mode, kernel and machine (cached on disk)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from elmo_service.bilm.kernels import certificate as cert_mod
from elmo_service.embedder import Embedder
from elmo_service.values import invalid_text
from tests.support.core_fixtures import tiny_artifact

ROOT = Path(__file__).resolve().parents[2]
# scripts the certificate's set never holds (and English, Latin words between them)
UNSEEN = ("japanese", "arabic", "hebrew", "devanagari", "thai", "hangul", "english", "latin")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Each test measures into its own cache: nothing read from an earlier run."""
    monkeypatch.setenv("ELMO_KERNEL_CACHE", str(tmp_path / "cache" / "kernel-route.json"))
    monkeypatch.setattr(cert_mod, "_memory", {})


def test_the_set_is_generated_deterministically_and_varied():
    texts = cert_mod.certificate_texts()
    assert texts == cert_mod.certificate_texts() and len(texts) == cert_mod.N_SENTENCES
    assert texts[: len(cert_mod.SENTENCES)] == list(cert_mod.SENTENCES)
    joined = "".join(texts)
    assert all(invalid_text(t) is None for t in texts)  # text every surface accepts
    for lo, hi in [
        (0x400, 0x4FF),
        (0x370, 0x3FF),
        (0x4E00, 0x9FFF),
        (0x1F300, 0x1FAFF),
        (0x10000, 0x2FFFF),
    ]:
        assert any(lo <= ord(c) <= hi for c in joined), hex(lo)  # Cyrillic ... astral
    lengths = [len(t.split()) for t in texts]
    assert min(lengths) == 1 and max(lengths) >= 60
    other = cert_mod.certificate_texts(seed=7, n=40, scripts=UNSEEN, fixed=())
    assert not set(other) & set(texts)


def _within(emb: Embedder, ref: Embedder, cert: dict, texts: list[str]) -> tuple[float, float]:
    """The worst per-sentence errors on ``texts`` (alone and batched), as the certificate
    measures them."""
    toks = [[t.text for t in emb.tokenizer(s)][: cert["longest"]] for s in texts]
    toks = [t for t in toks if t]
    want = ref.embed_tokens(toks)
    worst = [0.0, 0.0]
    for got in (emb.embed_tokens(toks), [emb.embed_tokens([t])[0] for t in toks]):
        for g, r in zip(got, want, strict=True):
            m, rms = cert_mod.sentence_errors(g, r)
            worst = [max(worst[0], m), max(worst[1], rms)]
    assert np.isfinite(worst).all()
    return worst[0], worst[1]


@pytest.mark.slow  # the bundled model's certificates measured (about 10 s per mode)
@pytest.mark.parametrize("mode", ["int8", "bf16"])
def test_unseen_text_stays_within_the_certified_bound(mode):
    model = ROOT / "models" / "default"
    ref = Embedder.load(model, threads=1, token_cache_size=0)
    fast = Embedder.load(model, threads=1, weights=mode, token_cache_size=0)
    cert = fast.certificate
    assert cert["margin"] == cert_mod.MARGIN and cert["heldout"] is None
    assert cert["max_rel_diff"] == pytest.approx(cert["measured"]["max"] * cert_mod.MARGIN["max"])
    assert cert["rms_rel_diff"] == pytest.approx(cert["measured"]["rms"] * cert_mod.MARGIN["rms"])
    assert cert["sentences"] >= 100 and cert["longest"] == cert_mod.MAX_TOKENS
    unseen = cert_mod.certificate_texts(seed=7, n=48, scripts=UNSEEN, max_words=120, fixed=())
    worst, rms = _within(fast, ref, cert, unseen)
    assert 0 < worst <= cert["max_rel_diff"] and 0 < rms <= cert["rms_rel_diff"], (worst, rms, cert)


def test_measured_once_per_model_mode_and_machine(tmp_path, monkeypatch):
    art = tiny_artifact(tmp_path / "m")
    first = Embedder.load(art, threads=1, weights="int8").certificate
    stored = json.loads((tmp_path / "cache" / "certificates.json").read_text())
    assert list(stored.values()) == [first]
    # a new process (the memory emptied) reads it back without measuring
    monkeypatch.setattr(cert_mod, "_memory", {})

    def no_measure(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(cert_mod, "certify", no_measure)
    assert Embedder.load(art, threads=1, weights="int8").certificate == first
    # another mode, or other weights, is another certificate
    with pytest.raises(AssertionError, match="measured again"):
        Embedder.load(art, threads=1, weights="bf16").certificate  # noqa: B018
    with pytest.raises(AssertionError, match="measured again"):
        Embedder.load(tiny_artifact(tmp_path / "m2", seed=1), threads=1, weights="int8").certificate  # noqa: B018
