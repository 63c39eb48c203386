"""Small generated corpora in Russian (Cyrillic, with spaces) and Japanese (no spaces), for
the tests of pretraining in other languages (no download): a toy grammar each, so that a
language model has structure to learn.
"""

from __future__ import annotations

import random
from pathlib import Path

_RU = {
    "subj": ["Кот", "Мальчик", "Учитель", "Старый солдат", "Моя сестра", "Рыбак", "Король"],
    "verb": ["видит", "любит", "находит", "читает", "строит", "ждёт", "помнит"],
    "obj": ["дом", "реку", "письмо", "город", "книгу", "корабль", "сад", "птицу"],
    "tail": ["", " утром", " у реки", " в городе", " каждый день", " снова"],
    "end": [".", ".", "!", "?"],
}
_JA = {
    "subj": ["猫", "先生", "子供", "東京の学生", "私の姉", "漁師", "王様"],
    "obj": ["本", "手紙", "川", "家", "花", "船", "鳥", "東京タワー"],
    "verb": ["を見ます", "を読みます", "を作ります", "が好きです", "を待ちます", "を覚えています"],
    "time": ["", "毎日", "朝", "今日", "昨日"],
    "end": ["。", "。", "！", "？"],
}


def sentence(lang: str, rng: random.Random) -> str:
    if lang == "ru":
        g = _RU
        return (
            f"{rng.choice(g['subj'])} {rng.choice(g['verb'])} {rng.choice(g['obj'])}"
            f"{rng.choice(g['tail'])}{rng.choice(g['end'])}"
        )
    if lang == "ja":
        g = _JA
        return (
            f"{rng.choice(g['time'])}{rng.choice(g['subj'])}は{rng.choice(g['obj'])}"
            f"{rng.choice(g['verb'])}{rng.choice(g['end'])}"
        )
    raise ValueError(f"no generated corpus for language {lang!r} (ru, ja)")


def write_corpus(path: str | Path, lang: str, n_sentences: int = 1000, seed: int = 0) -> Path:
    """Paragraphs of 1-4 sentences (Japanese ones without spaces between sentences)."""
    rng = random.Random(seed)
    sep = "" if lang == "ja" else " "
    paragraphs, n = [], 0
    while n < n_sentences:
        k = min(rng.randint(1, 4), n_sentences - n)
        paragraphs.append(sep.join(sentence(lang, rng) for _ in range(k)))
        n += k
    path = Path(path)
    path.write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    return path
