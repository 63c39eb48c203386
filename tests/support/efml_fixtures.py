"""Random-weight ELMoForManyLangs model folders, written with the package's own classes.

The lexicon holds Latin, accented, Cyrillic, CJK and emoji characters, the ideographic
space (its one-field line) and the six specials; the network is small and its token
cut short (``max_characters_per_token`` 8) so that the cut is exercised.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHARS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,!?'-")
CHARS += list("éèàçñüöïâ")  # accented
CHARS += list("приветмдойсбкнгз")  # Cyrillic (repeats dropped below)
CHARS += list("中文字漢語日本東京")  # CJK
CHARS += ["😀", "🎉", "👍🏽"[0]]  # emoji (astral code points)
SPECIALS = ["<oov>", "<pad>", "<bow>", "<eow>", "<bos>", "<eos>"]
WORDS = ["the", "bank", "river", ".", "мир", "привет", "中文", "東京", "😀", "café", "<eos>"]


def network_config(word_dim: int, activation: str = "relu") -> dict:
    return {
        "encoder": {
            "name": "elmo",
            "projection_dim": 8,
            "cell_clip": 3,
            "proj_clip": 3,
            "dim": 16,
            "n_layers": 2,
        },
        "token_embedder": {
            "name": "cnn",
            "activation": activation,
            "filters": [[1, 4], [2, 4], [3, 8]],
            "n_highway": 2,
            "word_dim": word_dim,
            "char_dim": 5,
            "max_characters_per_token": 8,
        },
        "classifier": {"name": "sampled_softmax", "n_samples": 8},
        "dropout": 0.1,
    }


def _dic(keys: list[str]) -> str:
    lines = []
    for i, k in enumerate(keys):
        # its loader strips each line: the ideographic space is written (and read) alone
        lines.append(str(i) if k == "\u3000" else f"{k}\t{i}")
    return "\n".join(lines) + "\n"


def write_efml_model(
    directory: Path, *, word_dim: int, seed: int = 0, activation: str = "relu"
) -> Path:
    """An ELMoForManyLangs model folder with random weights (needs ``elmoformanylangs``)."""
    from elmoformanylangs.frontend import Model
    from elmoformanylangs.modules.embedding_layer import EmbeddingLayer

    directory.mkdir(parents=True, exist_ok=True)
    chars = list(dict.fromkeys(SPECIALS + CHARS + ["\u3000"]))
    char2id = {c: i for i, c in enumerate(chars)}
    (directory / "char.dic").write_text(_dic(chars), encoding="utf-8")
    net = network_config(word_dim, activation)
    word_layer = None
    if word_dim:
        words = list(dict.fromkeys(["<oov>", "<pad>"] + WORDS))
        (directory / "word.dic").write_text(_dic(words), encoding="utf-8")
        word_layer = EmbeddingLayer(word_dim, {w: i for i, w in enumerate(words)}, fix_emb=False)
    char_layer = EmbeddingLayer(net["token_embedder"]["char_dim"], char2id, fix_emb=False)
    model = Model(net, word_layer, char_layer, use_cuda=False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # large enough that both clips bite
            p.copy_(torch.randn(p.shape, generator=g) * 0.6)
    (directory / "cnn_net.json").write_text(json.dumps(net), encoding="utf-8")
    # as in published models: the path of the authors' machine; the loader falls back to the folder
    (directory / "config.json").write_text(
        json.dumps({"config_path": "/nonexistent/configs/cnn_net.json"}), encoding="utf-8"
    )
    torch.save(model.token_embedder.state_dict(), directory / "token_embedder.pkl")
    torch.save(model.encoder.state_dict(), directory / "encoder.pkl")
    return directory


# Latin, accented, Cyrillic, CJK, emoji; unknown characters (ß, ж, 字 is known);
# words in and out of the word lexicon; tokens cut at 8 - 2 = 6 characters; a literal
# <bos>; sentences of different lengths (the batch is sorted, padded)
SENTENCES = [
    ["the", "bank", "of", "the", "river", "."],
    ["привет", "мир", "!"],
    ["中文", "東京", "日本語字漢"],
    ["😀", "🎉", "café", "naïve", "Straße", "жук"],
    ["riverbanks", "приветствие", "中文字漢語日本東京"],
    ["a"],
    ["<bos>", "x", "<eos>", "the"],
    ["The", "BANK", "😀😀😀😀😀😀😀😀", "éèàçñüöïâ", "?"],
]
