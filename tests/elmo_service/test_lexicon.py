"""ELMoForManyLangs' lexicons, read and turned into ids its way (no package needed), and
raw text's words (punctuation split off; each token a word in scripts without spaces)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elmo_service.bilm.config import BiLMConfig
from elmo_service.bilm.lexicon import Lexicon, parse_dic
from elmo_service.bilm.model import BiLM
from elmo_service.errors import ArtifactError, ConfigError
from elmo_service.tokenizers import LexiconTokenizer, load_tokenizer, word_starts

CHARS = "<oov>\t0\n<pad>\t1\n<bow>\t2\n<eow>\t3\n<bos>\t4\n<eos>\t5\na\t6\nб\t7\n中\t8\n😀\t9\n10\n"
WORDS = "<oov>\t0\n<pad>\t1\naб\t2\n<eos>\t3\n"


def test_dic_is_read_as_its_loader_reads_it() -> None:
    d = parse_dic(CHARS + "a\t11\n", "char.dic")
    assert d["\u3000"] == 10  # a line left with one field is the ideographic space
    assert d["a"] == 11  # a later line wins
    with pytest.raises(ArtifactError, match="char.dic line 1"):
        parse_dic("a\tb\tc\n", "char.dic")
    with pytest.raises(ArtifactError, match="lacks <bow>, <eow>"):
        Lexicon(b"<oov>\t0\n<pad>\t1\n<bos>\t2\n<eos>\t3\n")


def test_token_ids_with_its_quirks() -> None:
    lex = Lexicon(CHARS.encode(), WORDS.encode())
    row = lex.token_ids("aб中😀x", 8)
    # [<eow>, chars..., <bow>, <pad>...] (its swapped names), unknown x -> <oov>, then the word id
    assert row.tolist() == [3, 6, 7, 8, 9, 0, 2, 1, 0]
    assert lex.token_ids("aбaбaбaб", 8)[:8].tolist() == [3, 6, 7, 6, 7, 6, 7, 2]  # cut to 6
    assert lex.token_ids("aбaбaбaб", 8)[-1] == 0  # the cut word is unknown
    assert lex.token_ids("aб", 8)[-1] == 2
    assert lex.bos_ids(8).tolist() == [3, 4, 2, 1, 1, 1, 1, 1, 0]  # <bos>: no word entry
    assert lex.eos_ids(8).tolist() == [3, 5, 2, 1, 1, 1, 1, 1, 3]  # <eos>: listed
    assert lex.token_ids("<bos>", 8).tolist() == lex.bos_ids(8).tolist()  # as its code does
    assert Lexicon(CHARS.encode()).token_ids("a", 8).shape == (8,)  # no words: no column


def test_lexicon_tokenizer_travels_with_the_artifact(tmp_path) -> None:
    tok = LexiconTokenizer(Lexicon(CHARS.encode(), WORDS.encode()))
    entry = tok.save(tmp_path)
    back = load_tokenizer(entry, tmp_path)
    assert isinstance(back, LexiconTokenizer) and back.fingerprint == tok.fingerprint
    assert (tmp_path / "char.dic").read_text() == CHARS
    assert [t.text for t in back("Ну, aб!")] == ["Ну", ",", "aб", "!"]
    assert [t.text for t in back(["aб,", "x"])] == ["aб,", "x"]  # the caller's words
    other = LexiconTokenizer(Lexicon(CHARS.encode()))
    assert other.fingerprint != tok.fingerprint


def test_a_model_reads_lexicon_ids_and_word_vectors() -> None:
    cfg = BiLMConfig(
        char_dim=4, filters=((1, 4), (2, 4)), n_highway=1, max_chars_per_token=8,
        projection_dim=8, lstm_dim=8, n_layers=1, char_vocab_size=11, word_dim=3,
        word_vocab_size=4,
    )  # fmt: skip
    model = BiLM(cfg).eval()
    lex = Lexicon(CHARS.encode(), WORDS.encode())
    ids = torch.from_numpy(np.stack([lex.token_ids(t, 8) for t in ("aб", "中", "aб")]))
    with torch.no_grad():
        out = model.token_encoder(ids)
        word = model.token_encoder.word_embed.weight
        word.add_(1.0)  # the word vector reaches the output
        moved = model.token_encoder(ids)
    assert out.shape == (3, 8) and torch.allclose(out[0], out[2], atol=1e-6)
    assert not torch.allclose(out, moved)
    with pytest.raises(ConfigError, match="word_dim"):
        BiLMConfig(word_dim=3)


@pytest.mark.parametrize(
    ("text", "starts"),
    [
        ("river.", {0, 5}),
        ("don't stop", {0, 2, 6}),
        ("well-known U.S. (yes)", {0, 11, 14, 16, 17, 20}),
        ("東京は", {0, 1, 2}),  # no spaces: every character may start a word
    ],
)
def test_word_starts(text: str, starts: set[int]) -> None:
    assert word_starts(text) == starts


def test_a_lexicon_model_is_saved_loaded_and_never_exported_as_bilm_tf(tmp_path) -> None:
    from elmo_service.artifact import load_artifact, save_artifact
    from elmo_service.convert import export_bilm

    cfg = BiLMConfig(
        char_dim=4, filters=((1, 4),), n_highway=0, max_chars_per_token=8, projection_dim=8,
        lstm_dim=8, n_layers=1, char_vocab_size=11, word_dim=3, word_vocab_size=4,
    )  # fmt: skip
    tok = LexiconTokenizer(Lexicon(CHARS.encode(), WORDS.encode()))
    save_artifact(BiLM(cfg).eval(), tok, tmp_path / "m")
    art = load_artifact(tmp_path / "m")
    assert art.config.word_dim == 3 and art.tokenizer.kind == "lexicon"
    with pytest.raises(ConfigError, match="lexicon") as e:
        export_bilm(tmp_path / "m", tmp_path / "o.json", tmp_path / "w.hdf5")
    assert e.value.field == "tokenizer" and not (tmp_path / "w.hdf5").exists()
