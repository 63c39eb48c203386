"""Reading raw text safely: inputs, binary detection, UTF-8 repair, cleaning, sentence splitting.

Everything here streams: one line or one paragraph at a time, never a whole
file. Each skip is counted under a reason so that `prepare` can say what it
dropped and why.
"""

from __future__ import annotations

import bz2
import glob
import gzip
import lzma
import re
import unicodedata
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from elmo_service.errors import InputError

TEXT_SUFFIXES = {".txt", ".text", ".md", ".rst", ".tok", ".raw", ".gz", ".bz2", ".xz", ""}
_OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}


def expand_inputs(specs: list[str]) -> list[Path]:
    """Files, folders (recursively, text-like suffixes) and globs -> sorted unique files."""
    files: list[Path] = []
    for spec in specs:
        p = Path(spec)
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            found = sorted(
                q
                for q in p.rglob("*")
                if q.is_file() and q.suffix.lower() in TEXT_SUFFIXES and not q.name.startswith(".")
            )
            if not found:
                raise InputError(
                    f"folder {p} holds no text files (looked for {sorted(TEXT_SUFFIXES - {''})})",
                    field="inputs",
                )
            files.extend(found)
        else:
            matched = sorted(Path(m) for m in glob.glob(spec, recursive=True) if Path(m).is_file())
            if not matched:
                raise InputError(
                    f"input {spec!r} is not a file or folder and matches nothing", field="inputs"
                )
            files.extend(matched)
    seen, out = set(), []
    for f in files:
        r = f.resolve()
        if r not in seen:
            seen.add(r)
            out.append(f)
    return out


def open_binary(path: Path):
    return _OPENERS.get(path.suffix.lower(), open)(path, "rb")


def looks_binary(head: bytes) -> bool:
    """NUL bytes, or many control bytes, in the first block: not text."""
    if not head:
        return False
    if b"\x00" in head:
        return True
    ctrl = sum(1 for b in head if b < 32 and b not in (9, 10, 12, 13))
    return ctrl / len(head) > 0.05


def read_lines(
    path: Path, stats: Counter, errors: str, max_line_chars: int, on_bytes=None
) -> Iterator[str]:
    """Decoded lines of one file; counts (and replaces or skips) invalid UTF-8 and overlong lines.

    ``errors``: ``replace`` (invalid bytes -> U+FFFD) or ``skip`` (drop the line).
    """
    with open_binary(path) as f:
        try:
            head = f.peek(8192)[:8192] if hasattr(f, "peek") else b""
        except OSError as e:
            stats["files_unreadable"] += 1
            raise InputError(f"{path}: cannot read ({e})", field="inputs") from e
        if looks_binary(head):
            stats["files_binary"] += 1
            return
        stats["files_read"] += 1
        for raw in f:
            if on_bytes is not None:
                on_bytes(len(raw))
            stats["lines"] += 1
            if len(raw) > 4 * max_line_chars:  # bytes; cheap check before decoding
                stats["lines_too_long"] += 1
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                stats["lines_bad_utf8"] += 1
                if errors == "skip":
                    continue
                line = raw.decode("utf-8", errors="replace")
                stats["bad_bytes_replaced"] += line.count("\ufffd")
            if len(line) > max_line_chars:
                stats["lines_too_long"] += 1
                continue
            yield line.rstrip("\r\n")


_WS = re.compile(r"\s+")


def clean(text: str, lowercase: bool = False) -> str:
    """NFC, control/format characters -> space, whitespace collapsed."""
    text = unicodedata.normalize("NFC", text)
    if any(
        unicodedata.category(ch) in ("Cc", "Cf", "Co", "Cs") and not ch.isspace() for ch in text
    ):
        text = "".join(
            " " if unicodedata.category(ch) in ("Cc", "Cf", "Co", "Cs") else ch for ch in text
        )
    text = _WS.sub(" ", text).strip()
    return text.lower() if lowercase else text


_ABBREV = frozenset(
    [
        "mr",
        "mrs",
        "ms",
        "dr",
        "prof",
        "st",
        "jr",
        "sr",
        "vs",
        "etc",
        "e.g",
        "i.e",
        "no",
        "nos",
        "vol",
        "fig",
        "figs",
        "inc",
        "ltd",
        "co",
        "corp",
        "mt",
        "gen",
        "col",
        "capt",
        "lt",
        "sgt",
        "rev",
        "hon",
        "gov",
        "sen",
        "rep",
        "jan",
        "feb",
        "mar",
        "apr",
        "jun",
        "jul",
        "aug",
        "sep",
        "sept",
        "oct",
        "nov",
        "dec",
        "al",
        "approx",
        "cf",
        "ch",
        "pp",
        "ed",
        "eds",
    ]
)
# a sentence ends at . ! ? (plus closing quotes/brackets) followed by space and an opening
# capital or digit of any script (Spanish opens with ¿ ¡, French quotes with «), or at a
# full-width 。！？ (Chinese, Japanese: no space follows)
_BOUNDARY = re.compile(
    r"([.!?]+(?:\s?[\"'\u201d\u2019\u00bb)\]])*)\s+(?=[\"'\u201c\u2018\u00ab\u00bf\u00a1(\[]*([^\W_]))"
    r"|([\u3002\uff01\uff1f]+[\u300d\u300f\uff09\u201d]*)\s*"
)


def _opens_sentence(ch: str) -> bool:
    """A capital, a digit, or a letter of a script without case (CJK, Arabic, ...)."""
    return ch.isupper() or ch.isdigit() or ch.lower() == ch.upper()


def split_sentences(text: str) -> list[str]:
    """Rule-based sentence splitter (English abbreviations and initials kept together;
    capitals of any script, full-width terminators)."""
    out, start = [], 0
    for m in _BOUNDARY.finditer(text):
        if m.group(3) is not None:  # 。！？: always a boundary
            piece = text[start : m.end(3)].strip()
            if piece:
                out.append(piece)
            start = m.end()
            continue
        if not _opens_sentence(m.group(2)):
            continue
        before = text[start : m.start(1)].rsplit(None, 1)
        word = before[-1].lstrip("\"'(\u201c\u2018[") if before else ""
        if (
            m.group(1).startswith(".")
            and not m.group(1).startswith("..")
            and (word.lower() in _ABBREV or (len(word) == 1 and word.isalpha()))
        ):
            continue
        piece = text[start : m.end(1)].strip()
        if piece:
            out.append(piece)
        start = m.end()
    tail = text[start:].strip()
    if tail:
        out.append(tail)
    return out


def units(lines: Iterator[str], mode: str, max_chars: int, stats: Counter) -> Iterator[str]:
    """Group lines into the units that get sentence-split.

    ``paragraphs``: blank-line separated blocks (wrapped running text);
    ``lines``: each line is running text; ``none``: each line is one sentence.
    """
    if mode in ("lines", "none"):
        yield from lines
        return
    buf: list[str] = []
    size = 0
    for line in lines:
        if line.strip():
            buf.append(line)
            size += len(line)
            if size > max_chars:  # a "paragraph" that never ends: cut it
                stats["paragraphs_cut"] += 1
                yield " ".join(buf)
                buf, size = [], 0
        elif buf:
            yield " ".join(buf)
            buf, size = [], 0
    if buf:
        yield " ".join(buf)


def sentences_of(unit: str, mode: str, lowercase: bool) -> list[str]:
    text = clean(unit, lowercase)
    if not text:
        return []
    return [text] if mode == "none" else split_sentences(text)


def has_word_chars(s: str) -> bool:
    return any(ch.isalnum() for ch in s)
