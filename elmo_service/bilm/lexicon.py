"""ELMoForManyLangs' lexicons: Unicode characters and words -> ids, exactly its way.

An ELMoForManyLangs model (HIT-SCIR, PyPI ``elmoformanylangs``) reads characters from
``char.dic`` and, when it has word embeddings, words from ``word.dic``: one
``key<TAB>id`` a line. Both files travel verbatim with a converted artifact and are read
here the way its loader reads them (``line.strip().split("\\t")``; a line left with one
field is the ideographic space U+3000; a later line wins).

Character ids of one token, as its ``create_one_batch`` builds them (``[W]``, W =
``max_characters_per_token``):

* a token longer than ``W - 2`` characters is cut to ``W - 2`` (its ``read_list``);
* position 0 holds the id of ``<eow>`` and the position after the last character the
  id of ``<bow>``: its code reads ``bow_id, eow_id = char2id['<eow>'], char2id['<bow>']``,
  swapped against the names, and its models were trained that way;
* the sentence markers ``<bos>``/``<eos>`` (and the same literal tokens in a sentence)
  are ``[<eow> id, their own char.dic id, <bow> id]``;
* unknown characters are ``<oov>``, the rest of the row ``<pad>`` (a learned row, not zero).

With a word lexicon, a ``[W + 1]`` row: the W character ids, then the word id of the
(cut) token, ``<oov>`` for an unknown word (``<bos>``/``<eos>`` too unless listed).
``elmo_service/bilm/model.py`` ``CharCNN`` reads that last column as the word.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from elmo_service.errors import ArtifactError

BOS, EOS = "<bos>", "<eos>"
OOV, PAD, BOW, EOW = "<oov>", "<pad>", "<bow>", "<eow>"
CHAR_SPECIALS = (OOV, PAD, BOW, EOW, BOS, EOS)
WORD_SPECIALS = (OOV, PAD)
CHAR_FILE, WORD_FILE = "char.dic", "word.dic"


def parse_dic(text: str, name: str) -> dict[str, int]:
    """A ``.dic`` file's text as ELMoForManyLangs reads it (``Embedder.get_model``)."""
    out: dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), start=1):
        fields = line.strip().split("\t")
        if len(fields) == 1:
            fields.insert(0, "\u3000")
        if len(fields) != 2:
            raise ArtifactError(f"{name} line {n}: expected 'key<TAB>id'", field=name)
        try:
            out[fields[0]] = int(fields[1])
        except ValueError as e:
            raise ArtifactError(
                f"{name} line {n}: id {fields[1]!r} is not an integer", field=name
            ) from e
    return out


def _read(path: Path) -> tuple[bytes, dict[str, int]]:
    if not path.is_file():
        raise ArtifactError(f"missing lexicon file {path}", field=path.name)
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ArtifactError(f"{path.name} is not UTF-8: {e}", field=path.name) from e
    return data, parse_dic(text, path.name)


def _need_specials(lexicon: dict[str, int], specials: tuple[str, ...], name: str) -> None:
    missing = [s for s in specials if s not in lexicon]
    if missing:
        raise ArtifactError(f"{name} lacks {', '.join(missing)}", field=name)


class Lexicon:
    """A model's character lexicon (and word lexicon): token texts -> id rows."""

    def __init__(self, char_file: bytes, word_file: bytes | None = None) -> None:
        self.char_file, self.word_file = char_file, word_file
        self.chars = parse_dic(char_file.decode("utf-8"), CHAR_FILE)
        _need_specials(self.chars, CHAR_SPECIALS, CHAR_FILE)
        self.words = None if word_file is None else parse_dic(word_file.decode("utf-8"), WORD_FILE)
        if self.words is not None:
            _need_specials(self.words, WORD_SPECIALS, WORD_FILE)
        c = self.chars
        # swapped as in its create_one_batch: the row starts with <eow>'s id, ends with <bow>'s
        self._begin, self._end = c[EOW], c[BOW]
        self._oov, self._pad = c[OOV], c[PAD]
        h = hashlib.sha256(char_file)
        h.update(b"\0" + (word_file or b""))
        self.fingerprint = "efml-" + h.hexdigest()[:16]

    @classmethod
    def from_dir(cls, directory: str | Path, words: bool) -> Lexicon:
        """``char.dic`` (and ``word.dic`` when ``words``) from a model or artifact folder."""
        directory = Path(directory)
        char_file, _ = _read(directory / CHAR_FILE)
        word_file = _read(directory / WORD_FILE)[0] if words else None
        return cls(char_file, word_file)

    def save(self, directory: Path) -> dict[str, str]:
        (Path(directory) / CHAR_FILE).write_bytes(self.char_file)
        files = {"chars": CHAR_FILE}
        if self.word_file is not None:
            (Path(directory) / WORD_FILE).write_bytes(self.word_file)
            files["words"] = WORD_FILE
        return files

    @property
    def max_char_id(self) -> int:
        return max(self.chars.values())

    @property
    def max_word_id(self) -> int:
        return -1 if self.words is None else max(self.words.values())

    def token_ids(self, token: str, max_chars: int) -> np.ndarray:
        """One token's row: ``[max_chars]`` character ids (``[max_chars + 1]`` with words)."""
        token = token[: max_chars - 2]  # its read_list cut
        row = np.full(max_chars + (self.words is not None), self._pad, dtype=np.int64)
        row[0] = self._begin
        if token in (BOS, EOS):
            row[1], row[2] = self.chars[token], self._end
        else:
            get, oov = self.chars.get, self._oov
            row[1 : len(token) + 1] = [get(ch, oov) for ch in token]
            row[len(token) + 1] = self._end
        if self.words is not None:
            row[-1] = self.words.get(token, self.words[OOV])
        return row

    def bos_ids(self, max_chars: int) -> np.ndarray:
        return self.token_ids(BOS, max_chars)

    def eos_ids(self, max_chars: int) -> np.ndarray:
        return self.token_ids(EOS, max_chars)


__all__ = ["CHAR_FILE", "WORD_FILE", "Lexicon", "parse_dic"]
