"""Corpora in other languages: the sources by language, Debian Reference's prose, the
sentence splitter on other scripts."""

from __future__ import annotations

import gzip
import io
import tarfile

import pytest

from elmo_pretrain.sources import corpus
from elmo_pretrain.text import split_sentences

DEBREF = (
    "1.2.8. 名前付きパイプ (FIFO)\n"
    "\n"
    "    名前付きパイプは、パイプのように働くファイルです。何かをファイル\n"
    "    に入れると、もう一方の端からそれが出てきます。\n"
    "\n"
    "    $ cd; mkfifo mypipe\n"
    "    $ echo hello >mypipe &\n"
    "\n"
    "    Eine benannte Pipe ist eine Datei, die wie eine Pipe arbeitet; was\n"
    "\u00a0\u00a0\u00a0 man hineinschreibt, kommt am anderen Ende heraus.\n"
    "\n"
    "    注記\n"
    "\n"
    "        indented listing that is not prose at all, but long enough\n"
)


def test_debian_reference_keeps_prose_and_joins_wrapped_cjk_without_a_space() -> None:
    text = corpus.clean_debian_reference(DEBREF)
    assert text.split("\n\n") == [
        "名前付きパイプは、パイプのように働くファイルです。何かをファイルに入れると、"
        "もう一方の端からそれが出てきます。",
        "Eine benannte Pipe ist eine Datei, die wie eine Pipe arbeitet; was man "
        "hineinschreibt, kommt am anderen Ende heraus.\n",
    ]


def test_debian_reference_is_read_from_its_package(tmp_path) -> None:
    pkg = tmp_path / "debian-reference-ja.tgz"
    data = gzip.compress(DEBREF.encode())
    with tarfile.open(pkg, "w:gz") as tar:
        info = tarfile.TarInfo("./usr/share/debian-reference/debian-reference.ja.txt.gz")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    assert corpus.debian_reference("ja")(pkg).startswith("名前付きパイプは")
    with pytest.raises(corpus.FetchError, match="debian-reference.de.txt.gz"):
        corpus.debian_reference("de")(pkg)


def test_fetch_corpus_picks_one_language(tmp_path, monkeypatch) -> None:
    built: list[str] = []

    def fake(src, out_dir, cache_dir):
        built.append(src.name)
        (out_dir / f"{src.name}.txt").write_text("x\n")
        return {"name": src.name, "bytes": 2, "words": 1}

    monkeypatch.setattr(corpus, "build_source", fake)
    corpus.fetch_corpus(tmp_path / "en", cache_dir=tmp_path, log=None)
    assert built and all(corpus.SOURCES[n].language == "en" for n in built)  # the default
    built.clear()
    corpus.fetch_corpus(tmp_path / "es", language="es", cache_dir=tmp_path, log=None)
    assert built == ["sparv", "debref_es"]
    with pytest.raises(ValueError, match="no source in language 'xx'"):
        corpus.fetch_corpus(tmp_path / "xx", language="xx", cache_dir=tmp_path, log=None)
    with pytest.raises(ValueError, match="not both"):
        corpus.fetch_corpus(tmp_path / "b", ["sparv"], language="es", cache_dir=tmp_path, log=None)


@pytest.mark.parametrize(
    ("text", "sentences"),
    [
        ("Y dijo Dios: Sea la luz. ¿Quién es? ¡Él vino! Élla fue.", 4),
        ("Он пришёл. Она ушла. Mr. Smith went.", 3),
        ("今日は晴れです。明日は雨！本当？はい", 4),
        ("Il a dit « oui. » Puis il est parti.", 2),
        ("this ends. lower case goes on", 1),  # no capital: no boundary
    ],
)
def test_sentences_split_in_other_scripts(text: str, sentences: int) -> None:
    got = split_sentences(text)
    assert len(got) == sentences, got
    assert "".join(got).replace(" ", "") == text.replace(" ", "")


def test_training_reads_bytes_and_refuses_a_lexicon_by_name() -> None:
    from elmo_pretrain.config import TrainConfig
    from elmo_service.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict({"model": {"char_vocab_size": 300}})
    assert e.value.field == "model.char_vocab_size" and "ELMoForManyLangs" in str(e.value)
