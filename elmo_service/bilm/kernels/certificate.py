"""The accuracy certificate of a fast path: a bound on how far its vectors are from
fp32's, measured on the model it runs.

    certify(path, weights, run_fast, run_fp32, token_texts) -> Certificate
    certificate_texts() -> the generated sentences it is measured on

A fast path (``weights="int8"`` / ``"bf16"``, ``kernels/native_rounded.py``) rounds the
model's weights; its error depends on the weights, so it is measured on the model
served, not quoted from another. The measure is per sentence, as a caller meets it:

* ``max_rel_diff``: ``max |fast - fp32| / max |fp32|`` over one sentence's layers,
  positions and dimensions (a bound on any single value, relative to the sentence's
  largest);
* ``rms_rel_diff``: ``rms(fast - fp32) / rms(fp32)`` over one sentence (the typical error).

Each is the worst over :data:`N_SENTENCES` generated sentences (``certificate_texts``:
deterministic, seeded; lengths from one token to :data:`MAX_TOKENS`; English words,
random Latin, accented, Cyrillic, Greek, CJK, emoji, digits, symbols and code points from
all over Unicode, mixed within a sentence), each run alone and all in batches, times a
stated margin (:data:`MARGIN`): text the set never saw (other scripts, other lengths up to
``longest``) stays within it (``tests/elmo_service/test_certificate.py`` holds that on
another generated set). The raw worst values are kept (``measured``). The error of a
rounded path has a heavy tail (a few positions of long sentences, where a gate flips),
which is why the margin is a factor, not a few percent; the typical error is ``rms``.
Not covered: sentences longer than ``longest`` tokens, and held-out perplexity (that
needs held-out text and the language model's softmax, which artifacts do not ship:
``heldout: None`` rather than a figure from elsewhere).

Measuring costs seconds (a big model: a minute), so the certificate is kept per model
weights, mode, kernel and machine in ``certificates.json`` beside the kernel route's
cache (``calibrate.cache_file``); only a machine's first load of a model pays.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from elmo_service.atomic import write_text

log = logging.getLogger(__name__)
_lock = threading.Lock()
_memory: dict[str, dict] = {}

# fixed: a certificate is comparable across runs and machines only on the same text
SENTENCES: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello world.",
    "In 1923, the committee met in Reykjavik to discuss the fisheries' quotas again.",
    "She said that the results, although preliminary, were far better than anyone "
    "had expected after the first two trials had failed so badly last spring.",
    "Buy 3 apples, 2 pears and a loaf of bread on your way home, please!",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "Why?",
    "The stock market fell sharply on Tuesday as investors worried about rising "
    "interest rates, weak earnings and the prospect of a long slowdown in China, "
    "Europe and the United States.",
    "Colorless green ideas sleep furiously.",
    "He plays the cello in an orchestra that tours Japan every other year.",
    "Zwei Bier, bitte, und eine Brezel.",
    "The defendant's attorney objected, and the judge sustained the objection.",
)


# the generated set: its seed, size, longest sentence, scripts (tests use others)
SEED, N_SENTENCES, MAX_TOKENS = 20261128, 128, 160
SCRIPTS = ("english", "latin", "accented", "cyrillic", "greek", "cjk", "emoji", "digits", "symbols", "codepoints")  # fmt: skip
# the certified bounds: the set's worst values times these (max: its heavy tail)
MARGIN = {"max": 3.0, "rms": 2.0}
FORMAT = 2  # bump when the set or the measure changes: cached certificates are remeasured

ALPHABETS = {
    "latin": "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "accented": "áéíóúàèìòùâêîôûäëïöüçñßøåæœÁÉÍÓÚÇÑØÅ",
    "cyrillic": "абвгдеёжзийклмнопрстуфхцчшщъыьэюяАБВГДЕЖЗИЙКЛМНОПРСТУФХЦЧШЩЭЮЯ",
    "greek": "αβγδεζηθικλμνξοπρστυφχψωΑΒΓΔΕΖΗΘΙΚΛΜΝΞΟΠΡΣΤΥΦΧΨΩ",
    "cjk": "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现分将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向情部正名定女问力机给等几很业最间新什打便位因重被走电四第门相次东政海口使教西再平真听世气信北少关并内加化由却代军产入先山五太水万市眼体别处总才场师书比住员九笑性通目华报立马命张活难神数件安表原车白应路期叫死常提感金何更反合放做系计或司利受光王果亲界及今京务制解各任至清物台象记边共风战干接它许八特觉望直服",
    "japanese": "あいうえおかきくけこさしすせそたちつてとなにぬねのはひふへほまみむめもやゆよらりるれろわをんアイウエオカキクケコサシスセソタチツテト",
    "arabic": "ابتثجحخدذرزسشصضطظعغفقكلمنهوي",
    "hebrew": "אבגדהוזחטיכלמנסעפצקרשת",
    "devanagari": "अआइईउऊएऐओऔकखगघचछजझटठडढणतथदधनपफबभमयरलवशषसह",
    "thai": "กขคฆงจฉชซญฎฏฐฑฒณดตถทธนบปผฝพฟภมยรลวศษสหฬอฮ",
    "hangul": "가나다라마바사아자차카타파하거너더러머버서어저처커터퍼허고노도로모보소오조초코토포호",
    "emoji": "😀😃😄😁😆😅😂🤣😊😇🙂🙃😉😌😍🥰😘🎉🎊👍👎👏🙏💪🔥✨⭐🌟💯✅❌🚀🌍🍕🍺",
    "digits": "0123456789",
    "symbols": "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~§¶†‡•…‰′″€£¥©®™°±×÷",
}
_COMMON = (
    "the of and to in a is that for it as was with be by on not he I this are or his from "
    "at which but have an they you were her she there would their we him been has when who "
    "will more no if out so said what up its about into than them can only other new some "
    "could time these two may then do first any my now such like our over man me even most "
    "made after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still "
    "own see men work long get here between both life being under never day same another"
)
COMMON = _COMMON.split()


def _code_point(rng: random.Random) -> str:
    """Anywhere in the BMP or the first astral planes; never a surrogate, never NUL."""
    lo, hi = rng.choice(((0x21, 0x2FF), (0x300, 0xD7FF), (0xE000, 0xFFFD), (0x10000, 0x2FFFF)))
    return chr(rng.randint(lo, hi))


def _word(rng: random.Random, script: str) -> str:
    if script == "english":
        return rng.choice(COMMON)
    if script == "codepoints":
        return "".join(_code_point(rng) for _ in range(rng.randint(1, 6)))
    n = rng.choice((1, 2, 3, 4, 5, 6, 8, 10, 14, rng.randint(20, 70)))  # long words get cut
    return "".join(rng.choice(ALPHABETS[script]) for _ in range(n))


def certificate_texts(
    seed: int = SEED,
    n: int = N_SENTENCES,
    scripts: Sequence[str] = SCRIPTS,
    max_words: int = MAX_TOKENS,
    fixed: Sequence[str] = SENTENCES,
) -> list[str]:
    """``n`` sentences: ``fixed`` (:data:`SENTENCES`), then generated ones of 1 to
    ``max_words`` words, each mostly in one of ``scripts`` with words of the others mixed in."""
    rng = random.Random(seed)
    out = list(fixed)[:n]
    while len(out) < n:
        k = rng.choice((1, 2, 3, 5, 8, 12, 20, 30, 45, rng.randint(1, max_words)))
        main = rng.choice(scripts)
        words = [_word(rng, main if rng.random() < 0.7 else rng.choice(scripts)) for _ in range(k)]
        out.append(" ".join(words))
    return out


@dataclass(frozen=True)
class Certificate:
    """What a fast path is certified to give against fp32 on this model (per sentence)."""

    path: str  # the kernel, e.g. "cpu-native int8"
    weights: str  # the mode: "int8" | "bf16"
    max_rel_diff: float  # bound: max |fast - fp32| / max |fp32| of any one sentence
    rms_rel_diff: float  # bound: rms(fast - fp32) / rms(fp32) of any one sentence
    measured: dict  # the set's worst values {"max", "rms"} before the margin
    margin: dict  # MARGIN
    sentences: int
    tokens: int
    longest: int  # tokens: longer sentences are not covered
    heldout: dict | None  # {"fp32": ppl, "path": ppl, "ratio": ...}; None: no held-out text

    def to_dict(self) -> dict:
        return asdict(self)


def sentence_errors(fast: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """One sentence's (max, rms) error relative to its fp32 vectors (the certified measure)."""
    d = np.abs(fast.astype(np.float64) - ref.astype(np.float64))
    scale = float(np.abs(ref).max()) if ref.size else 0.0
    rms = float(np.sqrt(np.mean(ref.astype(np.float64) ** 2))) if ref.size else 0.0
    worst = float(d.max()) / scale if scale > 0 else 0.0
    typical = float(np.sqrt(np.mean(d**2))) / rms if rms > 0 else 0.0
    return worst, typical


def certify(
    path: str,
    weights: str,
    run_fast: Callable[[Sequence[Sequence[str]]], list[np.ndarray]],
    run_fp32: Callable[[Sequence[Sequence[str]]], list[np.ndarray]],
    token_texts: Sequence[Sequence[str]],
) -> Certificate:
    """The certificate of ``run_fast`` against ``run_fp32`` (each: token texts ->
    ``[L+1, T, D]`` per sentence) on ``token_texts`` (the tokenized certificate set),
    each sentence alone and all of them batched."""
    sents = [list(s) for s in token_texts if len(s) > 0]
    ref = run_fp32(sents)
    worst = {"max": 0.0, "rms": 0.0}
    for got in (run_fast(sents), [run_fast([s])[0] for s in sents]):
        for g, r in zip(got, ref, strict=True):
            m, t = sentence_errors(g, r)
            worst = {"max": max(worst["max"], m), "rms": max(worst["rms"], t)}
    for k, v in worst.items():
        if not np.isfinite(v):
            worst[k] = float("inf")
    return Certificate(
        path=path,
        weights=weights,
        max_rel_diff=worst["max"] * MARGIN["max"],
        rms_rel_diff=worst["rms"] * MARGIN["rms"],
        measured=worst,
        margin=dict(MARGIN),
        sentences=len(sents),
        tokens=sum(len(s) for s in sents),
        longest=max((len(s) for s in sents), default=0),
        heldout=None,
    )


def cache_key(model: Any, weights: str, path: str) -> str:
    """The model's weights (hashed), the mode, the kernel, the machine (CPU, ISA, torch,
    threads: ``calibrate.machine_key``) and the measure's format."""
    from elmo_service.bilm.kernels.calibrate import machine_key

    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().to("cpu").contiguous().numpy().tobytes())
    return f"v{FORMAT}|{h.hexdigest()[:24]}|{weights}|{path}|{machine_key(model)}"


def _file() -> Path:
    from elmo_service.bilm.kernels.calibrate import cache_file

    return cache_file().with_name("certificates.json")


def cached(key: str, measure: Callable[[], Certificate]) -> dict:
    """The certificate stored under ``key``, else measured and stored (unwritable: kept
    for the process only)."""
    with _lock:
        if key in _memory:
            return _memory[key]
        try:
            stored = json.loads(_file().read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            stored = None
        if isinstance(stored, dict) and set(stored) == set(Certificate.__dataclass_fields__):
            _memory[key] = stored
            return stored
        cert = measure().to_dict()
        _memory[key] = cert
        try:
            path = _file()
            try:
                known = json.loads(path.read_text())
            except (OSError, ValueError):
                known = {}
            known = known if isinstance(known, dict) else {}
            known[key] = cert
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text(path, json.dumps(known, indent=1, sort_keys=True))
        except OSError as e:
            log.info("certificate not cached (%s): measured again by the next process", e)
        return cert
