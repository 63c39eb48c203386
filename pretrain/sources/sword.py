"""A reader of SWORD zText Bible modules (zlib blocks + index files) and their OSIS
markup, so neither libsword nor ``mod2imp`` is needed."""

from __future__ import annotations

import html
import re
import struct
import zlib

from .paragraphs import join_paragraphs


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
