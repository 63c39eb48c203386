"""Tokens -> character ids, in bilm-tf's scheme (see docs/architecture.md).

A token is its UTF-8 bytes cut to ``max_chars - 2``, wrapped in
begin-of-word (258) and end-of-word (259), padded with 260. Sentence
markers are ``[258, 256|257, 259, 260...]``. Every id is then shifted by +1
so that 0 means "no token" (batch padding) and its embedding row is zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

BOS_CHAR = 256  # begin of sentence
EOS_CHAR = 257  # end of sentence
BOW_CHAR = 258  # begin of word
EOW_CHAR = 259  # end of word
PAD_CHAR = 260  # padding inside a token
SHIFT = 1  # id 0 is reserved for "no token"


def _marker(char: int, max_chars: int) -> np.ndarray:
    ids = np.full(max_chars, PAD_CHAR, dtype=np.int64)
    ids[:3] = (BOW_CHAR, char, EOW_CHAR)
    return ids + SHIFT


def bos_ids(max_chars: int = 50) -> np.ndarray:
    """Character ids of the ``<S>`` marker, shape ``[max_chars]``."""
    return _marker(BOS_CHAR, max_chars)


def eos_ids(max_chars: int = 50) -> np.ndarray:
    """Character ids of the ``</S>`` marker, shape ``[max_chars]``."""
    return _marker(EOS_CHAR, max_chars)


# bilm-tf (vocabulary lookup) and AllenNLP (ELMoCharacterMapper) both read the
# literal tokens "<S>" and "</S>" as the sentence markers, in training and at
# prediction time; a pre-tokenized "<S>" must give the same vectors here.
MARKER_TOKENS = {"<S>": BOS_CHAR, "</S>": EOS_CHAR}


def token_ids(token: str, max_chars: int = 50) -> np.ndarray:
    """Character ids of one token, shape ``[max_chars]`` (int64).

    The literal tokens ``<S>`` and ``</S>`` get the marker ids, as in bilm-tf
    and AllenNLP.
    """
    if token in MARKER_TOKENS:
        return _marker(MARKER_TOKENS[token], max_chars)
    data = token.encode("utf-8", "ignore")[: max_chars - 2]
    ids = np.full(max_chars, PAD_CHAR, dtype=np.int64)
    ids[0] = BOW_CHAR
    ids[1 : len(data) + 1] = np.frombuffer(data, dtype=np.uint8)
    ids[len(data) + 1] = EOW_CHAR
    return ids + SHIFT


def sentence_ids(tokens: Sequence[str], max_chars: int = 50) -> np.ndarray:
    """``<S> tokens </S>`` as ids, shape ``[len(tokens) + 2, max_chars]``."""
    out = np.empty((len(tokens) + 2, max_chars), dtype=np.int64)
    out[0] = bos_ids(max_chars)
    for i, tok in enumerate(tokens):
        out[i + 1] = token_ids(tok, max_chars)
    out[-1] = eos_ids(max_chars)
    return out


def batch_ids(
    sentences: Sequence[Sequence[str]], max_chars: int = 50
) -> tuple[np.ndarray, np.ndarray]:
    """Pad a batch with "no token" rows (all zeros).

    Returns ``(ids [B, T_max + 2, max_chars], lengths [B])`` where lengths
    count the two sentence markers.
    """
    lengths = np.array([len(s) + 2 for s in sentences], dtype=np.int64)
    width = int(lengths.max()) if len(sentences) else 2
    out = np.zeros((len(sentences), width, max_chars), dtype=np.int64)
    for b, sent in enumerate(sentences):
        out[b, : lengths[b]] = sentence_ids(sent, max_chars)
    return out, lengths
