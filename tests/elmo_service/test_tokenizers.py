import numpy as np
import pytest

from elmo_service.embedder import words_of
from elmo_service.tokenizers import SP_SPACE, Token, WordTokenizer
from tests.support.core_fixtures import train_sentencepiece


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


def test_word_tokenizer_lowercase_keeps_offsets():
    toks = WordTokenizer(lowercase=True).tokenize("The Bank")
    assert [(t.text, t.start, t.end) for t in toks] == [("the", 0, 3), ("bank", 4, 8)]


def test_sentencepiece_offsets_and_words(sp):
    text = "The  bank of the river, naïve café!"
    toks = sp.tokenize(text)
    assert toks, "no tokens"
    for t in toks:
        surface = t.text.replace(SP_SPACE, "")
        assert text[t.start : t.end] == surface
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
            out.extend(Token(t.text, t.start, t.end, i) for t in toks)
            pos += len(w) + 1
        return out

    rng = random.Random(0)
    # U+200B / U+00AD: characters sentencepiece's normalisation removes
    alphabet = list("abcdefghij,.!?'-") + ["é", "ß", "ﬁ", "名", "😀", "\u2581", "\u200b", "\u00ad"]
    for _ in range(300):
        words = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9)))
            for _ in range(rng.randint(1, 8))
        ]
        assert sp.tokenize_words(words) == per_word(words), words
    # words holding whitespace, or empty, take the per-word path and keep their index
    for words in (["New York", "city"], ["a", "", "b"], ["tab\there"], ["a", "\u200b", "c"]):
        toks = sp.tokenize_words(words)
        assert toks == per_word(words)
        assert max(t.word for t in toks) == len(words) - 1 or "" in words
