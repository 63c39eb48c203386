import re
from pathlib import Path

import numpy as np
import pytest

from elmo_service.embedder import words_of
from elmo_service.tokenizers import (
    SP_SPACE,
    SentencePieceTokenizer,
    Token,
    WordTokenizer,
    _shared_spans,
)
from elmo_service.values import EmbeddedSentence
from tests.support.core_fixtures import train_sentencepiece

BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")


@pytest.fixture(scope="module")
def sp(tmp_path_factory):
    return train_sentencepiece(tmp_path_factory.mktemp("sp"))


def test_word_tokenizer_offsets_point_into_the_text():
    text = "I don't know, Mr. Smith's well-known co-op."
    toks = WordTokenizer().tokenize(text)
    assert [t.text for t in toks] == [
        "I", "do", "n't", "know", ",", "Mr", ".", "Smith", "'s", "well-known", "co-op", ".",
    ]  # fmt: skip
    for t in toks:
        assert text[t.start : t.end] == t.text
    assert [t.word for t in toks] == list(range(len(toks)))


def test_word_tokenizer_lowercase_keeps_offsets_and_the_text():
    """A lowercasing model reads ``the``; the token's text is still what the input says."""
    for toks in (
        WordTokenizer(lowercase=True).tokenize("The Bank"),
        WordTokenizer(lowercase=True).tokenize_words(["The", "Bank"]),
    ):
        assert [(t.text, t.start, t.end) for t in toks] == [("The", 0, 3), ("Bank", 4, 8)]
        assert [t.piece for t in toks] == ["the", "bank"]


def test_sentencepiece_offsets_and_words(sp):
    text = "The  bank of the river, naïve café!"
    toks = sp.tokenize(text)
    assert toks, "no tokens"
    for t in toks:
        surface = t.text.replace(SP_SPACE, "")
        assert text[t.start : t.end] == surface == t.surface
    # raw text's words split punctuation off, as AllenNLP's do
    words, _ = words_of(toks, np.zeros((1, len(toks), 2), np.float32), text)
    assert words == ["The", "bank", "of", "the", "river", ",", "naïve", "café", "!"]


def test_pretokenized_input_keeps_given_words(sp):
    toks = sp.tokenize_words(["riverbank", "café", "x"])
    assert sorted({t.word for t in toks}) == [0, 1, 2]
    joined = "riverbank café x"
    for t in toks:
        assert joined[t.start : t.end] == t.text.replace(SP_SPACE, "")


def test_fingerprint_changes_with_model(sp, tmp_path):
    from tests.support.core_fixtures import train_sentencepiece

    other = train_sentencepiece(tmp_path, vocab_size=60)
    assert other.fingerprint != sp.fingerprint
    assert WordTokenizer().fingerprint != WordTokenizer(lowercase=True).fingerprint


def test_words_of_averages_pieces():
    toks = [Token("a", 0, 1, 0), Token("b", 1, 2, 0), Token("c", 3, 4, 1)]
    layers = np.arange(2 * 3 * 2, dtype=np.float32).reshape(2, 3, 2)
    words, vec = words_of(toks, layers, "ab c")
    assert words == ["ab", "c"]
    assert vec.shape == (2, 2, 2)
    np.testing.assert_allclose(vec[:, 0], (layers[:, 0] + layers[:, 1]) / 2)
    np.testing.assert_allclose(vec[:, 1], layers[:, 2])


def test_pretokenized_fast_path_equals_one_encode_per_word(sp):
    import random

    from elmo_service.tokenizers import Token

    def per_word(words):
        out, pos = [], 0
        for i, w in enumerate(words):
            toks, _ = sp._pieces(w, pos, i)
            out.extend(Token(t.text, t.start, t.end, i, t.piece) for t in toks)
            pos += len(w) + 1
        return [(t, t.piece) for t in out]

    rng = random.Random(0)
    # U+200B / U+00AD: characters sentencepiece's normalisation removes
    alphabet = list("abcdefghij,.!?'-") + ["é", "ß", "ﬁ", "名", "😀", "\u2581", "\u200b", "\u00ad"]
    for _ in range(300):
        words = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9)))
            for _ in range(rng.randint(1, 8))
        ]
        toks = sp.tokenize_words(words)
        assert [(t, t.piece) for t in toks] == per_word(words), words
        _spans_hold(" ".join(words), toks)  # no empty token, each text its span
    # words holding whitespace, or empty, take the per-word path and keep their index
    for words in (["New York", "city"], ["a", "", "b"], ["tab\there"], ["a", "\u200b", "c"]):
        toks = sp.tokenize_words(words)
        assert [(t, t.piece) for t in toks] == per_word(words)
        _spans_hold(" ".join(words), [t for t in toks if t.end > t.start])
        assert max(t.word for t in toks) == len(words) - 1 or "" in words


# ------------------------------------------------------- a token's text is its span (#57)
BUNDLED = Path(__file__).resolve().parents[2] / "models" / "default" / "tokenizer.model"
SENTENCE = "Ein Café in Köln – 😀 naïve Straße. ﬁne?"
WORDS = ["Ein", "Café", "in", "Köln", "–", "😀", "naïve", "Straße", ".", "ﬁne", "?"]


@pytest.fixture(scope="module")
def bundled() -> SentencePieceTokenizer:
    return SentencePieceTokenizer.from_file(BUNDLED)


def _spans_hold(text: str, toks: list[Token]) -> None:
    for t in toks:
        assert t.end > t.start, t  # no empty token
        span = text[t.start : t.end]
        mark = SP_SPACE if t.piece.startswith(SP_SPACE) else ""
        assert t.text == mark + span and t.surface == span, t


def test_byte_pieces_show_the_character_they_encode_and_share_its_span(bundled):
    toks = bundled.tokenize(SENTENCE)
    _spans_hold(SENTENCE, toks)
    # the model reads exactly sentencepiece's pieces: the same positions, the same vectors
    assert [t.piece for t in toks] == bundled.sp.encode_as_pieces(SENTENCE)
    assert all(not BYTE_PIECE.fullmatch(t.text) for t in toks)
    e = [t for t in toks if t.text == "é"]
    assert [t.piece for t in e] == ["<0xC3>", "<0xA9>"]  # one token per model position
    assert {(t.start, t.end) for t in e} == {(SENTENCE.index("é"), SENTENCE.index("é") + 1)}
    emoji = [t for t in toks if t.surface == "😀"]
    assert len(emoji) == 5 and emoji[0].piece == SP_SPACE  # a bare ▁, then four bytes
    (fine,) = [t for t in toks if t.surface == "ﬁne"]  # NFKC: the model reads "fine"
    assert fine.text == SP_SPACE + "ﬁne" and fine.piece == SP_SPACE + "fine"


def test_words_are_the_same_with_and_without_the_text(bundled):
    toks = bundled.tokenize(SENTENCE)
    layers = np.zeros((1, len(toks), 2), np.float32)
    assert words_of(toks, layers, SENTENCE)[0] == WORDS
    assert words_of(toks, layers)[0] == WORDS  # joined from the tokens' spans alone
    assert EmbeddedSentence(toks, layers).words()[0] == WORDS
    assert EmbeddedSentence(toks, layers, text=SENTENCE).words()[0] == WORDS


def test_pretokenized_words_keep_their_text_with_byte_pieces(bundled):
    words = ["Köln", "–", "Straße?", "😀😀"]
    toks = bundled.tokenize_words(words)
    joined = " ".join(words)
    _spans_hold(joined, toks)
    assert words_of(toks, np.zeros((1, len(toks), 1), np.float32))[0] == words
    assert [t.piece for t in toks] == bundled.sp.encode_as_pieces(joined)


def test_shared_spans_fill_every_empty_one():
    assert _shared_spans([(0, 0), (0, 0), (0, 1), (1, 3)]) == [(0, 1)] * 3 + [(1, 3)]
    assert _shared_spans([(0, 2), (2, 2)]) == [(0, 2), (0, 2)]  # the piece before
    assert _shared_spans([(3, 3), (5, 6)]) == [(5, 6), (5, 6)]  # the next one at all
    assert _shared_spans([(0, 1), (1, 2)]) == [(0, 1), (1, 2)]
