"""Text -> tokens with character offsets.

Three tokenizers sit behind one interface:

* ``SentencePieceTokenizer``: the project's own models; tokens are pieces
  (``"▁bank"``), a new word starts at each piece carrying ``▁`` or beginning a word
  of the raw text (below).
* ``WordTokenizer``: imported bilm-tf models, trained on word-tokenized text
  (1B Word Benchmark style: punctuation split off, ``n't`` split).
* ``LexiconTokenizer``: imported ELMoForManyLangs models: the same words, read
  through the model's own character (and word) lexicon (``elmo_service/bilm/lexicon.py``).

Words of raw text (``granularity="word"``, ``EmbeddedSentence.words``) are the same for
every tokenizer (:func:`word_starts`): runs of letters and digits with their inner
hyphens, apostrophes and periods, each punctuation mark its own word (``river.`` is
``river`` and ``.``, as AllenNLP's word splitter gives them), and in scripts written
without spaces (Chinese, Japanese, Thai, ...) each model token its own word: no
tokenizer here knows those languages' words, so their users pass pre-tokenized input.

Pre-tokenized input (a list of words) is accepted by all; offsets then refer
to the words joined by single spaces, and each given word is one word.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import re
import unicodedata
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elmo_service.bilm.lexicon import Lexicon
from elmo_service.errors import ArtifactError, ConfigError
from elmo_service.values import Token  # shared with the client (elmo_service/values.py)

SP_SPACE = "\u2581"  # sentencepiece's visible space


class Tokenizer(ABC):
    kind: str

    @abstractmethod
    def tokenize(self, text: str) -> list[Token]: ...

    @abstractmethod
    def tokenize_words(self, words: Sequence[str]) -> list[Token]: ...

    @property
    @abstractmethod
    def fingerprint(self) -> str:
        """Identifies the tokenization exactly; part of every cache key."""

    @abstractmethod
    def save(self, directory: Path) -> dict[str, Any]:
        """Write any files into ``directory``; return the config entry."""

    def __call__(self, sentence: str | Sequence[str]) -> list[Token]:
        if isinstance(sentence, str):
            return self.tokenize(sentence)
        return self.tokenize_words(sentence)


# Words with inner hyphens/apostrophes/periods stay whole; n't and clitics split off.
_WORD_RE = re.compile(
    r"\w+(?=n't\b)|n't\b|'(?:s|re|ve|ll|d|m)\b|\w+(?:[-.]\w+)*|[^\w\s]",
    re.IGNORECASE,
)


# scripts written without spaces between words: Thai, Lao, Myanmar, Khmer, kana, Han
_NO_SPACE = re.compile(
    "[\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u3040-\u30ff\u31f0-\u31ff"
    "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0003ffff]"
)


def word_starts(text: str) -> set[int]:
    """Where raw text's words begin (character offsets): see the module docstring. A
    position in a script without spaces starts a word wherever a model token starts."""
    starts = {m.start() for m in _WORD_RE.finditer(text)}
    if not text.isascii():
        starts.update(m.start() for m in _NO_SPACE.finditer(text))
    return starts


class WordTokenizer(Tokenizer):
    kind = "word"

    def __init__(self, lowercase: bool = False) -> None:
        self.lowercase = lowercase

    def _norm(self, s: str) -> str:
        return s.lower() if self.lowercase else s

    def tokenize(self, text: str) -> list[Token]:
        return [
            Token(m.group(), m.start(), m.end(), i, self._norm(m.group()))
            for i, m in enumerate(_WORD_RE.finditer(text))
        ]

    def tokenize_words(self, words: Sequence[str]) -> list[Token]:
        out, pos = [], 0
        for i, w in enumerate(words):
            out.append(Token(w, pos, pos + len(w), i, self._norm(w)))
            pos += len(w) + 1
        return out

    @property
    def fingerprint(self) -> str:
        return f"word-v1-lower{int(self.lowercase)}"

    def save(self, directory: Path) -> dict[str, Any]:
        return {"type": "word", "lowercase": self.lowercase}


def _has_removable(text: str) -> bool:
    """Whether ``text`` holds a format or control character (U+200B, U+00AD, ...), which
    sentencepiece's normalisation may remove."""
    if text.isascii() and text.isprintable():
        return False
    return any(unicodedata.category(c) in ("Cf", "Cc") for c in text)


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"
    FILE = "tokenizer.model"

    def __init__(self, model_proto: bytes) -> None:
        import sentencepiece as spm

        self._proto = model_proto
        self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self._fp = "sp-" + hashlib.sha256(model_proto).hexdigest()[:16]

    @classmethod
    def from_file(cls, path: str | Path) -> SentencePieceTokenizer:
        return cls(Path(path).read_bytes())

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def piece(self, i: int) -> str:
        return self.sp.id_to_piece(i)

    def _pieces(
        self, text: str, offset: int, word_base: int, word_at: Sequence[int] | None = None
    ) -> tuple[list[Token], int]:
        """Tokens of ``text``, offsets shifted by ``offset``; returns next word index.

        A token's span is the characters its piece encodes, leading whitespace aside. A
        piece that encodes no whole character of its own (the leading bytes of a character
        in byte pieces, a bare ``▁`` before one) shares the span of the piece that
        completes the character (or, failing one, of the piece before): no token is empty,
        and its text is always its span's (see ``Token``). ``word_at``: the caller's words'
        start offsets in ``text`` (a token belongs to the last word starting at or before
        it); else words are found in the text."""
        if not text:
            return [], word_base
        proto = self.sp.encode(text, return_type="proto")
        char_of = _char_offsets(text)
        starts = word_starts(text) if word_at is None else ()
        pieces: list[tuple[str, int, int, int]] = []
        word = word_base - 1
        open_word = False  # the current word holds a character (a bare "▁" holds none)
        for p in proto.pieces:
            piece, start, end = p.piece, char_of[p.begin], char_of[p.end]
            if start < end and text[start].isspace():
                seg = text[start:end]
                start += len(seg) - len(seg.lstrip())
                end = max(start, end)
            # a new word at a space or where raw text's words begin (punctuation split off)
            if not pieces or (open_word and (piece.startswith(SP_SPACE) or start in starts)):
                word += 1
                open_word = False
            open_word = open_word or end > start
            pieces.append((piece, start, end, word))
        spans = _shared_spans([(start, end) for _, start, end, _ in pieces])
        out = []
        for (piece, _, _, w), (start, end) in zip(pieces, spans, strict=True):
            if word_at is not None:
                w = bisect.bisect_right(word_at, start) - 1
            mark = SP_SPACE if piece.startswith(SP_SPACE) else ""
            out.append(Token(mark + text[start:end], offset + start, offset + end, w, piece))
        return out, word + 1

    def tokenize(self, text: str) -> list[Token]:
        return self._pieces(text, 0, 0)[0]

    def tokenize_words(self, words: Sequence[str]) -> list[Token]:
        joined = " ".join(words)
        # (sentencepiece reads a literal U+2581 as a space, and its normalisation removes
        # format and control characters, shifting offsets: such words go one by one)
        if (
            all(words)
            and len(joined.split()) == len(words)
            and SP_SPACE not in joined
            and not _has_removable(joined)
        ):
            # pieces never cross whitespace, so one encode of the joined words is
            # encoding each word alone, at a fraction of the per-call cost
            starts = list(itertools.accumulate((len(w) + 1 for w in words[:-1]), initial=0))
            toks, _ = self._pieces(joined, 0, 0, starts)
            if len({t.word for t in toks}) == len(words):  # else some word lost its pieces
                return toks
        # a word holds whitespace, is empty or lost a character: one encode per word
        out: list[Token] = []
        pos = 0
        for i, w in enumerate(words):
            pieces, _ = self._pieces(w, pos, i)
            # a word is one word, whatever pieces say
            out.extend(Token(t.text, t.start, t.end, i, t.piece) for t in pieces)
            pos += len(w) + 1
        return out

    @property
    def fingerprint(self) -> str:
        return self._fp

    def save(self, directory: Path) -> dict[str, Any]:
        (Path(directory) / self.FILE).write_bytes(self._proto)
        return {"type": "sentencepiece", "file": self.FILE}


class LexiconTokenizer(WordTokenizer):
    """An ELMoForManyLangs model's input: words (raw text split as :class:`WordTokenizer`
    splits it, or the caller's own words), read through its lexicon. Its published
    models were trained on UD-tokenized text, words as given, never lowercased."""

    kind = "lexicon"

    def __init__(self, lexicon: Lexicon) -> None:
        super().__init__(lowercase=False)
        self.lexicon = lexicon

    @property
    def fingerprint(self) -> str:
        return self.lexicon.fingerprint

    def save(self, directory: Path) -> dict[str, Any]:
        return {"type": "lexicon", **self.lexicon.save(directory)}


def _shared_spans(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Empty spans filled: with the next non-empty span when it starts there (a character's
    leading byte pieces, a bare ``▁`` before it), else the previous non-empty one (a piece
    that normalisation made of the character before), else the next one at all."""
    out = list(spans)
    if all(s < e for s, e in spans):
        return out
    after: tuple[int, int] | None = None
    for i in range(len(out) - 1, -1, -1):
        s, e = out[i]
        if s < e:
            after = (s, e)
        elif after is not None and after[0] == s:
            out[i] = after
    before: tuple[int, int] | None = None
    for i, (s, e) in enumerate(out):
        if s < e:
            before = (s, e)
        elif before is not None:
            out[i] = before
    after = None
    for i in range(len(out) - 1, -1, -1):
        s, e = out[i]
        if s < e:
            after = (s, e)
        elif after is not None:
            out[i] = after
    return out


def _char_offsets(text: str) -> Sequence[int]:
    """Byte offset -> character offset (sentencepiece reports bytes)."""
    if text.isascii():
        return range(len(text) + 1)
    char_of = [0] * (len(text.encode("utf-8")) + 1)
    b = 0
    for i, ch in enumerate(text):
        n = len(ch.encode("utf-8"))
        char_of[b : b + n] = [i] * n
        b += n
    char_of[b] = len(text)
    return char_of


def load_tokenizer(entry: dict[str, Any], directory: Path) -> Tokenizer:
    """Build the tokenizer an artifact's ``config.json`` describes."""
    kind = entry.get("type")
    if kind == "word":
        return WordTokenizer(lowercase=bool(entry.get("lowercase", False)))
    if kind == "lexicon":
        return LexiconTokenizer(Lexicon.from_dir(directory, words="words" in entry))
    if kind == "sentencepiece":
        path = Path(directory) / entry.get("file", SentencePieceTokenizer.FILE)
        if not path.is_file():
            raise ArtifactError(
                f"missing tokenizer file {path.name} in {directory}", field=path.name
            )
        try:
            return SentencePieceTokenizer.from_file(path)
        except Exception as e:  # sentencepiece raises bare RuntimeError/OSError
            raise ArtifactError(f"corrupt tokenizer file {path.name}: {e}", field=path.name) from e
    raise ConfigError(f"unknown tokenizer type {kind!r}", field="tokenizer.type")
