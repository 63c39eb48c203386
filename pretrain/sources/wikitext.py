"""MediaWiki XML exports and wiki markup to plain paragraphs (the Wikipedia sample)."""

from __future__ import annotations

import html
import re
import xml.etree.ElementTree as ET

from .paragraphs import concat, join_paragraphs

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
