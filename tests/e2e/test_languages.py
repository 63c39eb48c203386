"""Pretrain and serve other languages: prepare -> train -> export -> serve on
Russian (Cyrillic) and Japanese (written without spaces), generated corpora, tiny config.

What is held: the sentencepiece coverage chosen for the script, token offsets that
round-trip the text, what a word is (punctuation split off; in Japanese each model
token), pre-tokenized input keeping the caller's words, and the HTTP answer.
"""

from __future__ import annotations

import random
import re
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import yaml
from fastapi.testclient import TestClient

from elmo_api.main import create_app
from elmo_api.settings import load_settings
from elmo_client import Client
from elmo_pretrain.config import TrainConfig, apply_overrides
from elmo_pretrain.export import export
from elmo_pretrain.prepare import LATIN_COVERAGE, PrepareOptions, coverage_for, prepare
from elmo_pretrain.sources.synthetic_lang import write_corpus
from elmo_pretrain.train import run_training
from elmo_service.bilm.char_ids import token_ids
from elmo_service.embedder import Embedder
from elmo_service.tokenizers import SP_SPACE, SentencePieceTokenizer
from tests.support.core_fixtures import tiny_artifact
from tests.support.determinism import same_vectors
from tests.support.live_server import LiveServer

pytestmark = pytest.mark.slow  # two tiny trainings

BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")
TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
BUNDLED = Path(__file__).resolve().parents[2] / "models" / "default"
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
    spans: dict[tuple[int, int], bytes] = {}
    for t in tok.tokens:  # every token's text is its span (▁ aside), never empty
        span = text[t.start : t.end]
        assert span and t.surface == span and t.text.replace(SP_SPACE, "") == span
        # what the model reads: the span's NFKC form, a character unseen in training as
        # byte pieces (the pieces sharing one span, together)
        piece = t.piece.replace(SP_SPACE, "")
        got = bytes([int(piece[3:5], 16)]) if BYTE_PIECE.fullmatch(piece) else piece.encode()
        spans[t.start, t.end] = spans.get((t.start, t.end), b"") + got
    for (start, end), read in spans.items():
        assert read.decode("utf-8") == unicodedata.normalize("NFKC", text[start:end])
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


# ------------------------------------------------ words as the user wrote them (#57)
SENTENCES = ["Ein Café in Köln – 😀 naïve Straße.", "Wo ist die Straße?"]
WORDS = [
    ["Ein", "Café", "in", "Köln", "–", "😀", "naïve", "Straße", "."],
    ["Wo", "ist", "die", "Straße", "?"],
]
_DE = {
    "subj": ["Der Bäcker", "Die Ärztin", "Mein Großvater", "Das Mädchen", "Der Fußballer"],
    "verb": ["sieht", "grüßt", "fährt über", "läuft durch", "öffnet", "schließt"],
    "obj": ["die Straße", "den Fluss", "das Tor", "die Brücke", "den Garten", "das Büro"],
    "tail": ["", " am Morgen", " in Köln", " täglich", " ohne Grüße", " schön"],
}


def _german_corpus(path: Path, n: int = 800) -> Path:
    """A German-like corpus in which '?' is rare (3 in ~35,000 characters): below the
    Latin coverage of 0.9995, so a model prepared from it reads '?' as a byte piece."""
    rng = random.Random(4)
    lines = []
    for i in range(n):
        end = "?" if i in (100, 400, 700) else rng.choice([".", ".", "!"])
        g = {k: rng.choice(v) for k, v in _DE.items()}
        lines.append(f"{g['subj']} {g['verb']} {g['obj']}{g['tail']}{end}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module", params=["bundled", "de"])
def words_model(request, tmp_path_factory) -> Path:
    """The bundled model, or a German model: its tokenizer prepared here, random weights."""
    if request.param == "bundled":
        return BUNDLED
    d = tmp_path_factory.mktemp("de")
    corpus = _german_corpus(d / "de.txt")
    assert coverage_for(corpus, PrepareOptions()) == LATIN_COVERAGE
    prepare([str(corpus)], d / "prepared", PrepareOptions(vocab_size=400), progress=False,
            log=quiet)  # fmt: skip
    tok = SentencePieceTokenizer.from_file(d / "prepared" / "tokenizer.model")
    assert [t.piece for t in tok.tokenize("?")][-1] == "<0x3F>"  # '?' is a byte piece here
    return tiny_artifact(d / "model", tokenizer=tok)


def test_a_token_s_text_is_its_span_and_words_agree_on_every_surface(words_model, tmp_path):
    """The library's tokens, ``words()`` and ``granularity="word"``, ``/v1/embed``'s
    ``tokens[].text`` and ``words[].text``, and the client's: the input's own characters,
    the same words everywhere; byte pieces keep their positions (what the model reads)."""
    emb = Embedder.load(words_model, threads=1)
    lib = emb.embed(SENTENCES)
    lib_words = emb.embed(SENTENCES, granularity="word")
    for text, want, got, words in zip(SENTENCES, WORDS, lib, lib_words, strict=True):
        for t in got.tokens:
            assert t.end > t.start and t.surface == text[t.start : t.end], t
            assert not BYTE_PIECE.search(t.text), t
        assert got.words()[0] == want and [w.text for w in words.tokens] == want
        # the model reads sentencepiece's own pieces: the vectors of those positions
        pieces = emb.tokenizer.sp.encode_as_pieces(text)
        assert [t.piece for t in got.tokens] == pieces
        assert same_vectors(got.layers, emb.embed_tokens([pieces])[0])  # batch vs alone
    if words_model != BUNDLED:  # '?' is bytes to this model, '?' to the user
        (q,) = [t for t in lib[1].tokens if t.surface == "?"]
        assert q.text == "?" and q.piece == "<0x3F>"
    settings = load_settings(model_path=words_model, threads=1, data_dir=tmp_path)
    app = create_app(settings)
    with TestClient(app) as http:
        for granularity, key in (("token", "tokens"), ("word", "words")):
            r = http.post("/v1/embed", json={"sentences": SENTENCES, "granularity": granularity})
            assert r.status_code == 200, r.text
            for item, want in zip(r.json()["data"], lib if key == "tokens" else lib_words,
                                  strict=True):  # fmt: skip
                assert [t["text"] for t in item[key]] == [t.text for t in want.tokens]
    with LiveServer(create_app(settings)) as srv, Client(srv.url, retries=0) as client:
        got = client.embed(SENTENCES)
        assert [[t.text for t in s.tokens] for s in got] == [
            [t.text for t in s.tokens] for s in lib
        ]
        assert [s.words()[0] for s in got] == WORDS
        words = client.embed(SENTENCES, granularity="word")
        assert [[t.text for t in s.tokens] for s in words] == WORDS
