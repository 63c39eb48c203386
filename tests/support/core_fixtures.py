"""Small builders shared by the core tests: tiny models, tokenizers, artifacts."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from elmo_service.artifact import save_artifact
from elmo_service.bilm.model import BiLM
from elmo_service.tokenizers import SentencePieceTokenizer, Tokenizer, WordTokenizer
from tests.support.configs import small_test_config

WORDS = [
    "the",
    "bank",
    "of",
    "river",
    "money",
    "water",
    "flows",
    "near",
    "a",
    "old",
    "stone",
    "bridge",
    "where",
    "people",
    "walk",
    "every",
    "morning",
    "and",
    "evening",
    "to",
    "watch",
    "boats",
    "sail",
    "slowly",
    "past",
    "green",
    "fields",
    "naïve",
    "café",
]


def generated_text(n_lines: int = 400, seed: int = 0) -> str:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 14))]
        lines.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ","]))
    return "\n".join(lines) + "\n"


def train_sentencepiece(directory: Path, vocab_size: int = 80) -> SentencePieceTokenizer:
    import sentencepiece as spm

    text = directory / "sp_train.txt"
    text.write_text(generated_text())
    prefix = directory / "sp"
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(prefix), vocab_size=vocab_size, model_type="unigram",
        minloglevel=2, num_threads=1,
    )  # fmt: skip
    return SentencePieceTokenizer.from_file(f"{prefix}.model")


def tiny_model(seed: int = 0, **overrides) -> BiLM:
    torch.manual_seed(seed)
    model = BiLM(small_test_config(**overrides)).eval()
    # larger weights than the default init so every layer carries signal
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


def tiny_artifact(
    directory: Path, tokenizer: Tokenizer | None = None, seed: int = 0, **overrides
) -> Path:
    save_artifact(tiny_model(seed, **overrides), tokenizer or WordTokenizer(), directory)
    return directory
