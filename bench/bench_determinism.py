"""How far a sentence's vectors move between "alone" and "in a batch" (the determinism bound).

One sentence runs the single-sentence path (the whole step loop in native code);
a batch runs the batched kernels (BLAS matmuls over the batch): the same
arithmetic in another order, so float32 rounding differs. This measures the
largest difference on hard inputs -- byte-fallback pieces (emoji, CJK, rare
scripts), sentences up to the model's token limit, and many random batch mixes --
absolute and relative to the sentence's largest value, and prints one table.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python bench/bench_determinism.py \\
        [--model models/default] [--mixes 40] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import fair  # noqa: E402
from elmo_pretrain.sources.synthetic import sentence  # noqa: E402

HARD = [
    "Emoji 🙂🚀🧪 and symbols ∀x∈ℝ: x² ≥ 0 ⇒ ✓",
    "中文句子，混合 English 和 日本語のテキスト。",
    "Ελληνικά, русский, עברית, العربية, हिन्दी, ไทย ...",
    "Zalgo t̷̢e̸̡x̵t̴ and combining marks a\u0301e\u0301i\u0301",
    "\u2028odd\u00a0spaces\u2009and\u200bzero-width\ufeffjoiners",
    "ﬁ ligatures ﬂ, fullwidth ＡＢＣ１２３, math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


def inputs(rng: random.Random, max_tokens: int) -> list[str]:
    plain = [sentence(rng) for _ in range(24)]
    hard = list(HARD)
    hard += ["".join(chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(40)) for _ in range(4)]
    hard += [" ".join(chr(rng.randrange(0x1F300, 0x1FAFF)) for _ in range(30)) for _ in range(4)]
    long = [" ".join(sentence(rng) for _ in range(n)) for n in (8, 16, 24)]
    return plain + hard + long


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO / "models" / "default"))
    ap.add_argument("--mixes", type=int, default=40, help="random batches per sentence set")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    print("\n".join(fair.header(args.threads)))

    import torch

    from elmo_service.embedder import Embedder

    torch.set_num_threads(args.threads)
    emb = Embedder.load(args.model, threads=args.threads)
    rng = random.Random(28)
    sents = inputs(rng, emb.max_sentence_tokens)
    toks = []
    for s in sents:
        t = [x.piece for x in emb.tokenize([s])[0]][: emb.max_sentence_tokens]
        toks.append(t)
    t0 = time.monotonic()
    alone = [emb.run_batch([t])[0] for t in toks]
    rows: dict[str, list[float]] = {"plain": [0, 0], "hard": [0, 0], "long": [0, 0]}
    kind = ["plain"] * 24 + ["hard"] * (len(HARD) + 8) + ["long"] * 3
    n_vectors = 0
    over = 0
    for _ in range(args.mixes):
        idx = rng.sample(range(len(toks)), rng.randint(2, 12))
        for i, got in zip(idx, emb.run_batch([toks[i] for i in idx]), strict=True):
            d = np.abs(got - alone[i])
            scale = float(np.abs(alone[i]).max())
            r = rows[kind[i]]
            r[0] = max(r[0], float(d.max()))
            r[1] = max(r[1], float(d.max()) / max(scale, 1e-30))
            n_vectors += d.shape[0] * d.shape[1]
            over += int((d.max(axis=-1) > 1e-5).sum())
    print(f"model {args.model} (version {emb.version}), {len(toks)} sentences "
          f"(longest {max(map(len, toks))} tokens), {args.mixes} random batches, "
          f"threads {args.threads}, {time.monotonic() - t0:.0f} s")  # fmt: skip
    print("| inputs | max abs difference | max difference / max abs value |")
    print("|---|---|---|")
    for k, (a, r) in rows.items():
        print(f"| {k} | {a:.3g} | {r:.3g} |")
    print(f"vectors compared: {n_vectors}; beyond 1e-5 absolute: {over}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
