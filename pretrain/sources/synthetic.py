"""A small generated English-like corpus: ``elmo-pretrain synthetic``, smoke runs, tests, bench.

A toy grammar over a few hundred words: the text has real structure (agreement,
word order) for a language model to learn, and it is produced here so tests
need no download.
"""

from __future__ import annotations

import random
from pathlib import Path

_DET = ["the", "a", "every", "this", "that", "no", "one"]
_ADJ = [
    "old",
    "young",
    "red",
    "quiet",
    "happy",
    "dark",
    "bright",
    "small",
    "large",
    "strange",
    "clever",
    "silent",
    "famous",
    "gentle",
    "ancient",
]
_NOUN_S = [
    "dog",
    "cat",
    "king",
    "river",
    "city",
    "child",
    "teacher",
    "soldier",
    "farmer",
    "ship",
    "garden",
    "letter",
    "storm",
    "house",
    "bird",
]
_NOUN_P = [w + ("es" if w.endswith(("s", "sh", "ch")) else "s") for w in _NOUN_S]
_VERB_S = [
    "sees",
    "likes",
    "finds",
    "follows",
    "remembers",
    "builds",
    "carries",
    "watches",
    "helps",
    "answers",
]
_VERB_P = ["see", "like", "find", "follow", "remember", "build", "carry", "watch", "help", "answer"]
_ADV = ["slowly", "quickly", "often", "never", "always", "quietly", "gladly"]
_PREP = ["near", "under", "behind", "beside", "across", "beyond"]
_NAMES = ["Anna", "Boris", "Clara", "Daniel", "Elena", "Felix", "Grace", "Henry"]


def _np(rng: random.Random, plural: bool) -> str:
    words = (
        []
        if plural and rng.random() < 0.5
        else [rng.choice(_DET[:2] if not plural else ["the", "some", "many"])]
    )
    if rng.random() < 0.5:
        words.append(rng.choice(_ADJ))
    words.append(rng.choice(_NOUN_P if plural else _NOUN_S))
    if rng.random() < 0.2:
        words += [rng.choice(_PREP), "the", rng.choice(_NOUN_S)]
    return " ".join(words)


def sentence(rng: random.Random) -> str:
    plural = rng.random() < 0.4
    subj = rng.choice(_NAMES) if rng.random() < 0.15 else _np(rng, plural)
    if subj in _NAMES:
        plural = False
    verb = rng.choice(_VERB_P if plural else _VERB_S)
    parts = [subj, verb, _np(rng, rng.random() < 0.3)]
    if rng.random() < 0.3:
        parts.insert(1, rng.choice(_ADV))
    if rng.random() < 0.25:
        parts += ["and", rng.choice(_VERB_P if plural else _VERB_S), _np(rng, False)]
    s = " ".join(parts)
    s = s[0].upper() + s[1:]
    return s + rng.choice([".", ".", ".", "!", "?"])


def write_corpus(
    path: str | Path, n_sentences: int = 2000, seed: int = 0, per_paragraph: int = 5
) -> Path:
    """Running text: paragraphs of ``per_paragraph`` sentences, wrapped like a book."""
    rng = random.Random(seed)
    path = Path(path)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(0, n_sentences, per_paragraph):
            para = " ".join(sentence(rng) for _ in range(min(per_paragraph, n_sentences - i)))
            line, out = "", []
            for w in para.split():
                if len(line) + len(w) > 70:
                    out.append(line)
                    line = w
                else:
                    line = f"{line} {w}" if line else w
            out.append(line)
            f.write("\n".join(out) + "\n\n")
    return path
