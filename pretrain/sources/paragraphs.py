"""The corpus sources' common output form: paragraphs of running text.

One paragraph a line, a blank line between paragraphs (and documents),
whitespace collapsed, NFC-normalised, ending in a newline.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable


def norm_ws(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def join_paragraphs(paragraphs: Iterable[str]) -> str:
    """Canonical output form: whitespace collapsed inside each paragraph, empty
    paragraphs dropped, blank line between paragraphs, NFC, final newline."""
    out = []
    for p in paragraphs:
        p = norm_ws(unicodedata.normalize("NFC", p))
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
