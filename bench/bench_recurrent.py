"""The batched recurrent product's library, forced both ways in one process: oneDNN's packed
``W_hh`` against MKL on ``W_hh^T`` (what ``kernels/calibrate.py`` chooses between per
machine, as ``recurrent_rows``), on the bundled model, sides alternating.

Three workloads, each a target's in-process side: sentence batches of 16 (target (a) of #54),
of 150 (sentence mode of a corpus), and 8 documents of ~2,000 tokens advancing together,
8 rows a step (target (c)). Prints tokens/s per side and round, their medians and ratio, and
whether the two give the same vectors.

    .venv/bin/python bench/bench_recurrent.py              # ~2 min, a quiet machine
    .venv/bin/python bench/bench_recurrent.py --rounds 1   # quicker
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import fair  # noqa: E402
from elmo_service.process import configure_process  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each side twice a round")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    configure_process("library", args.threads)
    import numpy as np  # noqa: PLC0415 - after the process's threads are set
    import torch  # noqa: PLC0415

    from bench.bench_document import build_text  # noqa: PLC0415
    from elmo_service.bilm.kernels.packed import EVERY_STEP  # noqa: PLC0415
    from elmo_service.document import DocumentRun, advance, tokenize_document  # noqa: PLC0415
    from elmo_service.embedder import Embedder  # noqa: PLC0415

    print("\n".join(fair.header(args.threads)))
    emb = Embedder.load(threads=args.threads)
    emb.warm_up()
    print(f"route on this machine: {emb.kernel.route}")
    _, sents, _ = build_text(emb, 16_500)
    toks = [[t.piece or t.text for t in emb.tokenizer(s)] for s in sents]
    per = len(sents) // 8
    docs = [
        tokenize_document(emb.tokenizer, " ".join(sents[d * per : (d + 1) * per]), max_tokens=None)
        for d in range(8)
    ]
    spec = emb.output_spec(None, "token")
    sides = {"oneDNN": 0, "W^T (MKL)": EVERY_STEP}  # recurrent_rows: MKL below this many rows

    def batches(size: int, n: int) -> float:
        work = [toks[i : i + size] for i in range(0, n, size)]
        t = time.perf_counter()
        for b in work:
            emb.run_batch(b)
        return sum(len(s) for b in work for s in b) / (time.perf_counter() - t)

    def documents() -> float:
        runs = [DocumentRun(emb, d, spec, 512, round_tokens=256) for d in docs]
        t = time.perf_counter()
        while not all(r.done for r in runs):
            advance([r for r in runs if not r.done])
        seconds = time.perf_counter() - t
        for r in runs:
            r.close()
        return sum(len(d.ids) for d in docs) / seconds

    work = {
        "sentences, batches of 16": lambda: batches(16, 320),
        "sentences, batches of 150": lambda: batches(150, 600),
        "8 documents a step": documents,
    }
    got: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        order = list(sides) + list(sides)[::-1]
        for side in order if r % 2 == 0 else order[::-1]:
            emb.kernel.recurrent_rows = sides[side]
            for name, fn in work.items():
                got.setdefault((name, side), []).append(fn())
    for name in work:
        cells = []
        for side in sides:
            v = got[(name, side)]
            cells.append(
                f"{side} {statistics.median(v):,.0f} tok/s ({', '.join(f'{x:,.0f}' for x in v)})"
            )
        ratio = statistics.median(got[(name, "W^T (MKL)")]) / statistics.median(
            got[(name, "oneDNN")]
        )
        print(f"{name}: {'; '.join(cells)}; W^T / oneDNN {ratio:.2f}x")
    g = torch.Generator().manual_seed(0)
    x, n = torch.randn(40, 20, emb.cfg.projection_dim, generator=g), torch.randint(5, 21, (40,))
    n[0] = 20
    outs = []
    for rows in sides.values():
        emb.kernel.recurrent_rows = rows
        with torch.inference_mode():
            outs.append(emb.kernel.contextualize(x, n).numpy())
    print(
        f"vectors, oneDNN against W^T (40 rows x 20 steps): max |diff| {np.abs(outs[0] - outs[1]).max():.2e}"
    )
    print(fair.footer())


if __name__ == "__main__":
    main()
