"""`elmo-pretrain prepare`: sentences, split, vocabularies, shards, and every bad-input case."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import numpy as np
import pytest

from elmo_pretrain.cli import main
from elmo_pretrain.data import Corpus
from elmo_pretrain.prepare import (
    ALPHABET_COVERAGE,
    LATIN_COVERAGE,
    RICH_SCRIPT_COVERAGE,
    PrepareOptions,
    coverage_for,
    prepare,
)
from elmo_pretrain.sources.synthetic import write_corpus
from elmo_pretrain.text import split_sentences
from elmo_service.errors import InputError

SP = dict(vocab_size=200, byte_fallback=False, heldout_fraction=0.05)


def quiet(*_a, **_k):
    pass


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("text") / "book.txt", n_sentences=600, seed=1)


@pytest.fixture(scope="module")
def prepared(text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("prep") / "corpus"
    prepare([str(text_file)], out, PrepareOptions(**SP), progress=False, log=quiet)
    return out


def test_split_sentences_keeps_abbreviations_and_initials():
    text = 'Mr. Smith met Dr. J. Watson at 5 p.m. on Baker Street. He said "Hello." Then he left! Did he? Yes.'
    assert split_sentences(text) == [
        "Mr. Smith met Dr. J. Watson at 5 p.m. on Baker Street.",
        'He said "Hello."',
        "Then he left!",
        "Did he?",
        "Yes.",
    ]


def test_prepare_writes_shards_vocab_and_summary(prepared, text_file):
    m = json.loads((prepared / "manifest.json").read_text())
    s = m["summary"]
    assert (
        s["train_sentences"] + s["heldout_sentences"] + s.get("skipped_duplicate", 0)
        == s["sentences_seen"]
    )
    assert s["heldout_sentences"] > 0 and s["train_sentences"] > 400
    corpus = Corpus(prepared)
    assert corpus.vocab[:3] == ["<S>", "</S>", "<unk>"]
    counts = [
        int(line.split("\t")[1]) for line in (prepared / "vocab.txt").read_text().splitlines()
    ]
    assert counts[3:] == sorted(
        counts[3:], reverse=True
    )  # frequency order for the log-uniform sampler
    train = corpus.split("train")
    assert isinstance(train.tokens[0], np.memmap)  # never loaded into Python objects
    assert len(train) == s["train_sentences"] and train.n_tokens == s["train_tokens"]
    # the shards decode back to the cleaned sentences
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(prepared / "tokenizer.model"))
    first = (prepared / "sentences.train.txt").read_text().splitlines()[0]
    assert sp.decode([sp.piece_to_id(corpus.vocab[i]) for i in train.sentence(0)]) == first


def test_same_preparation_is_a_noop_and_a_different_one_is_refused(prepared, text_file):
    before = (prepared / "manifest.json").stat().st_mtime_ns
    prepare([str(text_file)], prepared, PrepareOptions(**SP), progress=False, log=quiet)
    assert (prepared / "manifest.json").stat().st_mtime_ns == before
    with pytest.raises(InputError, match="different prepared corpus"):
        prepare(
            [str(text_file)],
            prepared,
            PrepareOptions(**{**SP, "vocab_size": 150}),
            progress=False,
            log=quiet,
        )
    assert (prepared / "manifest.json").stat().st_mtime_ns == before  # nothing overwritten


def test_force_replaces_and_foreign_folder_is_refused(text_file, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="not a prepared corpus"):
        prepare([str(text_file)], out, PrepareOptions(**SP), progress=False, log=quiet)
    assert (out / "notes.txt").read_text() == "mine"
    prepare([str(text_file)], out, PrepareOptions(**SP), force=True, progress=False, log=quiet)
    assert (out / "manifest.json").is_file() and not (out / "notes.txt").exists()


def test_empty_corpus_is_an_error(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "punct.txt").write_text("*** --- ***\n\n...\n")
    with pytest.raises(InputError, match="empty corpus"):
        prepare(
            [str(tmp_path / "empty.txt"), str(tmp_path / "punct.txt")],
            tmp_path / "o",
            PrepareOptions(**SP),
            progress=False,
            log=quiet,
        )
    assert not (tmp_path / "o").exists()


def test_missing_input_is_an_error(tmp_path):
    with pytest.raises(InputError, match="matches nothing"):
        prepare(
            [str(tmp_path / "nope*.txt")],
            tmp_path / "o",
            PrepareOptions(**SP),
            progress=False,
            log=quiet,
        )


def test_binary_files_are_skipped_and_counted(text_file, tmp_path):
    (tmp_path / "image.txt").write_bytes(
        b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 4
    )
    m = prepare(
        [str(text_file), str(tmp_path / "image.txt")],
        tmp_path / "o",
        PrepareOptions(**SP),
        progress=False,
        log=quiet,
    )
    assert m["summary"]["files_binary"] == 1 and m["summary"]["files_read"] == 1
    with pytest.raises(InputError, match="empty corpus.*1 skipped as binary"):
        prepare(
            [str(tmp_path / "image.txt")],
            tmp_path / "o2",
            PrepareOptions(**SP),
            progress=False,
            log=quiet,
        )


@pytest.mark.parametrize("mode", ["replace", "skip"])
def test_invalid_utf8_is_replaced_or_skipped_and_counted(text_file, tmp_path, mode):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(
        "Caf\u00e9 society meets the old dog.\n\nNa\u00efve farmers see a ship.\n".encode("latin-1")
    )
    m = prepare(
        [str(text_file), str(bad)],
        tmp_path / mode,
        PrepareOptions(**SP, encoding_errors=mode),
        progress=False,
        log=quiet,
    )
    s = m["summary"]
    assert s["lines_bad_utf8"] == 2
    text = (tmp_path / mode / "sentences.train.txt").read_text() + (
        tmp_path / mode / "sentences.heldout.txt"
    ).read_text()
    if mode == "replace":
        assert s["bad_bytes_replaced"] == 2 and "Caf\ufffd society" in text
    else:
        assert "society" not in text


def test_absurdly_long_lines_are_skipped_and_counted(text_file, tmp_path):
    long = tmp_path / "long.txt"
    long.write_text("word " * 50_000 + "\n\nA short sentence about the dog.\n")
    m = prepare(
        [str(text_file), str(long)],
        tmp_path / "o",
        PrepareOptions(**SP, max_line_chars=10_000),
        progress=False,
        log=quiet,
    )
    assert m["summary"]["lines_too_long"] == 1


def test_folders_globs_and_gzip(tmp_path):
    d = tmp_path / "texts" / "sub"
    d.mkdir(parents=True)
    write_corpus(d / "a.txt", n_sentences=300, seed=2)
    with gzip.open(tmp_path / "texts" / "b.txt.gz", "wt") as f:
        f.write((d / "a.txt").read_text().replace("dog", "wolf"))
    m = prepare(
        [str(tmp_path / "texts")], tmp_path / "o", PrepareOptions(**SP), progress=False, log=quiet
    )
    assert m["summary"]["files_read"] == 2 and len(m["inputs"]["train"]) == 2


def test_word_vocab_top_k_unk_and_heldout_file(tmp_path):
    train = tmp_path / "train.txt"
    train.write_text("a b c a b a <unk> z\nb a c\n")
    held = tmp_path / "valid.txt"
    held.write_text("a q c\n")
    opts = PrepareOptions(
        tokenizer="word",
        vocab_size=5,
        split="none",
        pretokenized=True,
        dedupe=False,
        heldout_files=[str(held)],
    )
    prepare([str(train)], tmp_path / "o", opts, progress=False, log=quiet)
    c = Corpus(tmp_path / "o")
    assert c.vocab[:5] == ["<S>", "</S>", "<unk>", "a", "b"] and c.softmax_size == 5
    assert "q" in c.vocab  # held-out-only word: spelled for the char CNN, target <unk>
    assert c.vocab.index("q") >= c.softmax_size
    assert [c.vocab[i] for i in c.split("heldout").sentence(0)] == ["a", "q", "c"]


def test_cli_bad_input_exits_2_with_a_message(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("\n\n")
    rc = main(
        ["prepare", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "o"), "--no-progress"]
    )
    assert rc == 2
    assert "empty corpus" in capsys.readouterr().err


@pytest.mark.parametrize("tokenizer", ["word", "sentencepiece"])
def test_a_vocabulary_smaller_than_asked_is_said(text_file, tmp_path, tokenizer):
    said: list[str] = []
    opts = PrepareOptions(tokenizer=tokenizer, vocab_size=16000, byte_fallback=False)
    m = prepare([str(text_file)], tmp_path / "o", opts, progress=False, log=said.append)
    size = m["vocab"]["softmax_size"]
    assert size < 16000 and m["vocab"]["requested_size"] == 16000
    note = [s for s in said if s.startswith("note: the vocabulary")]
    assert note and f"has {size} entries, not the 16000 asked for" in note[0]
    assert f"softmax {size} (asked for 16000)" in said[-1]  # the summary line


def test_synthetic_corpus_command_feeds_prepare(tmp_path, capsys):
    out = tmp_path / "new" / "smoke.txt"
    assert main(["synthetic", "--out", str(out), "--sentences", "300"]) == 0
    words = out.read_text().split()
    assert len(words) > 300 * 3 and "wrote 300 sentences" in capsys.readouterr().out
    rc = main(["prepare", str(out), "--out", str(tmp_path / "p"), "--vocab-size", "300",
               "--no-byte-fallback", "--no-progress"])  # fmt: skip
    assert rc == 0 and Corpus(tmp_path / "p").split("train").__len__() > 200


def test_a_file_without_blank_lines_is_warned_about_under_split_paragraphs(tmp_path):
    """One sentence a line without end punctuation: --split paragraphs (the default) runs
    the lines together; prepare says so and names the option that reads it right."""
    lines = [f"headline number {i} about the river and the town" for i in range(60)]
    (tmp_path / "lines.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "book.txt").write_text("One paragraph here.\nStill it.\n\nAnother one.\n")
    words = {"tokenizer": "word", "vocab_size": 100, "heldout_fraction": 0.0}
    said: list[str] = []
    m = prepare([str(tmp_path / "lines.txt"), str(tmp_path / "book.txt")], tmp_path / "p",
                PrepareOptions(**words), progress=False, log=said.append)  # fmt: skip
    warned = [x for x in said if x.startswith("warning:") and "no blank line" in x]
    assert len(warned) == 1 and "lines.txt" in warned[0] and "--split none" in warned[0]
    assert m["summary"]["files_without_blank_lines"] == 1
    assert m["summary"]["train_sentences"] < 10  # what the warning is about: 60 lines merged
    said.clear()
    m = prepare([str(tmp_path / "lines.txt")], tmp_path / "q",
                PrepareOptions(**words, split="none"), progress=False, log=said.append)  # fmt: skip
    assert not any("no blank line" in x for x in said)
    assert m["summary"]["train_sentences"] == 60


# ------------------------------------------------------------- the one character-coverage rule
ROOT = Path(__file__).resolve().parents[2]


def _coverage_table(page: str) -> dict[str, float]:
    """docs/languages.md's table of the coverage chosen for the script: row -> number."""
    rows = re.findall(r"^\s*\| ([^|]+?) \| ([0-9.]+) \|$", page, flags=re.M)
    return {name: float(value) for name, value in rows}


def test_the_docs_help_and_configs_say_the_coverage_the_code_chooses(capsys):
    """docs/languages.md's table, `prepare --help` and the Spanish recipe say what
    ``coverage_for`` does (#57): one rule, stated from the code's constants."""
    page = (ROOT / "docs" / "languages.md").read_text(encoding="utf-8")
    table = _coverage_table(page)
    assert len(table) == 3, table
    by_row = {
        "Chinese, Japanese or Korean": RICH_SCRIPT_COVERAGE,
        "Latin": LATIN_COVERAGE,
        "another alphabet": ALPHABET_COVERAGE,
    }
    for words, want in by_row.items():
        (row,) = [name for name in table if words in name]
        assert table[row] == want, (row, table[row], want)
    with pytest.raises(SystemExit):
        main(["prepare", "--help"])
    helptext = " ".join(capsys.readouterr().out.split())
    assert (
        f"{RICH_SCRIPT_COVERAGE} for text mostly in Chinese/Japanese/Korean characters, "
        f"{LATIN_COVERAGE} for Latin text" in helptext
    )
    assert f"{ALPHABET_COVERAGE} for another alphabet" in helptext
    # the Spanish model: the table's coverage is the one its commands give (Latin text:
    # given, since the default would be LATIN_COVERAGE)
    (said,) = re.findall(r"\| tokenizer \| sentencepiece unigram, [\d,]+ pieces, character "
                         r"coverage ([0-9.]+)", page)  # fmt: skip
    steps = page.split("## Train a model in another language")[1].split("```")[1]
    config = (ROOT / "configs" / "lang-small.yaml").read_text(encoding="utf-8")
    for recipe in (steps, config):
        (prep,) = [line for line in recipe.splitlines() if "elmo-pretrain prepare" in line]
        given = re.search(r"--character-coverage ([0-9.]+)", prep)
        assert float(given.group(1) if given else LATIN_COVERAGE) == float(said), prep


def test_coverage_for_follows_the_script(tmp_path):
    texts = {
        "Die Straße in Köln ist schön, oder? " * 50: LATIN_COVERAGE,
        "Старый солдат видит реку у дома. " * 50: ALPHABET_COVERAGE,
        "毎日猫は東京タワーを見ます。" * 50: RICH_SCRIPT_COVERAGE,
    }
    for i, (text, want) in enumerate(texts.items()):
        (tmp_path / f"{i}.txt").write_text(text, encoding="utf-8")
        assert coverage_for(tmp_path / f"{i}.txt", PrepareOptions()) == want
    assert coverage_for(tmp_path / "0.txt", PrepareOptions(character_coverage=1.0)) == 1.0
