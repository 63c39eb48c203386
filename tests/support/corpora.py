"""Prepared synthetic corpora for the pretraining tests (each module keeps its own size)."""

from __future__ import annotations

from pathlib import Path

from elmo_pretrain.prepare import PrepareOptions, prepare
from elmo_pretrain.sources.synthetic import write_corpus


def quiet(*_a, **_k) -> None:
    pass


def prepared_corpus(folder: Path, n_sentences: int, vocab_size: int, seed: int) -> Path:
    """A synthetic book of ``n_sentences`` prepared under ``folder / "prepared"``: a
    sentencepiece vocabulary of ``vocab_size`` without byte fallback, 5 % held out."""
    text = write_corpus(folder / "book.txt", n_sentences=n_sentences, seed=seed)
    opts = PrepareOptions(vocab_size=vocab_size, byte_fallback=False, heldout_fraction=0.05)
    prepare([str(text)], folder / "prepared", opts, progress=False, log=quiet)
    return folder / "prepared"
