"""Pretrain and serve other languages: prepare -> train -> export -> serve on
Russian (Cyrillic) and Japanese (written without spaces), generated corpora, tiny config.

What is held: the sentencepiece coverage chosen for the script, token offsets that
round-trip the text, what a word is (punctuation split off; in Japanese each model
token), pre-tokenized input keeping the caller's words, and the HTTP answer.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import yaml
from fastapi.testclient import TestClient

from elmo_api.main import create_app
from elmo_api.settings import load_settings
from elmo_pretrain.config import TrainConfig, apply_overrides
from elmo_pretrain.export import export
from elmo_pretrain.prepare import PrepareOptions, coverage_for, prepare
from elmo_pretrain.sources.synthetic_lang import write_corpus
from elmo_pretrain.train import run_training
from elmo_service.bilm.char_ids import token_ids
from elmo_service.embedder import Embedder
from elmo_service.tokenizers import SP_SPACE

pytestmark = pytest.mark.slow  # two tiny trainings

BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")
TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
TEXT = {
    "ru": "Старый солдат видит реку, у реки — дом. Кот ждёт!",
    "ja": "毎日猫は東京タワーを見ます。先生は手紙を読みます！",
}


def quiet(*_a, **_k) -> None:
    pass


@pytest.fixture(scope="module", params=["ru", "ja"])
def model(request, tmp_path_factory) -> tuple[str, Path, float]:
    lang = request.param
    d = tmp_path_factory.mktemp(lang)
    corpus = write_corpus(d / f"{lang}.txt", lang, n_sentences=800, seed=1)
    opts = PrepareOptions(vocab_size=400, heldout_fraction=0.05)  # 256 byte pieces + the characters
    prepare([str(corpus)], d / "prepared", opts, progress=False, log=quiet)
    raw = yaml.safe_load(TINY.read_text())
    sets = [f"data.path={d / 'prepared'}", "train.progress=false", "train.threads=1"]
    cfg = TrainConfig.from_dict(apply_overrides(raw, [*sets, "train.steps=30"]))
    res = run_training(cfg, d / "run", log=quiet)
    export(d / "run", d / "model")
    return lang, d / "model", res["heldout"]["avg_ppl"], corpus


def test_coverage_is_chosen_for_the_script(model) -> None:
    lang, _, _, corpus = model
    want = 0.9995 if lang == "ja" else 1.0
    assert coverage_for(corpus, PrepareOptions()) == want
    assert coverage_for(corpus, PrepareOptions(character_coverage=0.98)) == 0.98


def test_trained_model_embeds_with_offsets_that_round_trip(model) -> None:
    lang, path, ppl, _ = model
    assert np.isfinite(ppl) and ppl < 100  # far below the 400-token vocabulary: it learned
    emb = Embedder.load(path, threads=1)
    text = TEXT[lang]
    (tok,) = emb.embed([text])
    assert np.isfinite(tok.layers).all()
    for t in tok.tokens:  # every token's span is its text (▁ aside; sentencepiece reads NFKC)
        if not BYTE_PIECE.fullmatch(t.text):  # a character unseen in training: its bytes
            span = unicodedata.normalize("NFKC", text[t.start : t.end])
            assert span == t.text.replace(SP_SPACE, "")
    (word,) = emb.embed([text], granularity="word")
    words = [w.text for w in word.tokens]
    for w in word.tokens:
        assert text[w.start : w.end] == w.text
    assert "".join(words) == text.replace(" ", "")  # the words cover the text exactly
    if lang == "ru":  # punctuation split off, words whole
        assert words == ["Старый", "солдат", "видит", "реку", ",", "у", "реки", "—", "дом", ".",
                         "Кот", "ждёт", "!"]  # fmt: skip
    else:  # no spaces: each model token is a word
        assert len(words) == len(tok.tokens) and "".join(words) == text
    # pre-tokenized input (a segmenter's words) keeps the caller's words
    given = (
        ["毎日", "猫", "は", "東京タワー", "を", "見ます", "。"] if lang == "ja" else text.split()
    )
    (pre,) = emb.embed([given], granularity="word")
    assert [w.text for w in pre.tokens] == given


def test_long_cjk_pieces_keep_every_byte() -> None:
    """A sentencepiece piece holds at most 16 characters: 16 CJK characters are 48 UTF-8
    bytes, exactly what the character CNN reads (50 less the two word markers)."""
    piece = "東京" * 8
    ids = token_ids(piece, 50) - 1  # the +1 shift undone
    assert ids[0] == 258 and ids[49] == 259  # begin of word, 48 bytes, end of word
    assert bytes(int(i) for i in ids[1:49]).decode("utf-8") == piece  # nothing was cut
    longer = token_ids("東京" * 9, 50) - 1  # a longer (whitespace) word: cut at 48 bytes
    assert bytes(int(i) for i in longer[1:49]).decode("utf-8") == piece
    # sentencepiece never makes a longer piece (max_sentencepiece_length, 16 by default)


def test_served_over_http(model, tmp_path) -> None:
    lang, path, _, _ = model
    s = load_settings(model_path=path, threads=1, data_dir=tmp_path)
    with TestClient(create_app(s)) as client:
        r = client.post(
            "/v1/embed", json={"sentences": [TEXT[lang]], "granularity": "word", "output": "mix"}
        )
        assert r.status_code == 200, r.text
        (item,) = r.json()["data"]
        (want,) = Embedder.load(path, threads=1).embed([TEXT[lang]], granularity="word")
        assert [w["text"] for w in item["words"]] == [w.text for w in want.tokens]
        for w in item["words"]:
            assert TEXT[lang][w["start"] : w["end"]] == w["text"]
