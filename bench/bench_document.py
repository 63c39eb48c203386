"""Document mode at scale: one long document through ``Embedder.embed_document``.

    .venv/bin/python bench/bench_document.py                       # 1,000,000 tokens, models/default
    .venv/bin/python bench/bench_document.py --tokens 50000 --rounds 3   # quick, interleaved

What it reports (docs/documents.md keeps the figures):

* tokens/s of document mode over the whole text, and of sentence mode (``embed_sentences``,
  the same embedder, the same text cut into its sentences), run one after the other
  ``--rounds`` times, interleaved, so that load from other work hits both alike; the
  ratio is of the medians;
* memory: the process's resident set before the document run and its peak during it
  (``VmHWM``, reset first through ``/proc/self/clear_refs``): the growth is the
  difference. The spill file (page cache, not resident) is reported by size.

The text is the prose of CPython's ``pydoc_data`` help topics (shipped with every Python),
repeated up to ``--tokens`` tokens; the token cache sees the same words in both modes.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_embedder import pydoc_prose  # noqa: E402
from elmo_service.embedder import Embedder  # noqa: E402
from elmo_service.process import configure_process  # noqa: E402


def prose_sentences() -> list[str]:
    out = []
    for p in pydoc_prose():
        out.extend(s for s in re.split(r"(?<=[.!?])\s+", p) if len(s.split()) >= 3)
    return out


def build_text(embedder: Embedder, n_tokens: int) -> tuple[str, list[str], int]:
    """(the document, its sentences, its tokens) with at least ``n_tokens`` tokens."""
    base = prose_sentences()
    counts = [len(embedder.tokenizer(s)) for s in base]
    sents: list[str] = []
    total = 0
    while total < n_tokens:
        for s, c in zip(base, counts, strict=True):
            if total >= n_tokens:
                break
            if c > embedder.max_sentence_tokens:
                continue
            sents.append(s)
            total += c
    return " ".join(sents), sents, total


def status(key: str) -> int:
    """A ``/proc/self/status`` size in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def run_document(embedder: Embedder, text: str, chunk: int, spill_dir: str | None) -> dict:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = status("VmRSS")
    t0 = time.perf_counter()
    n = chunks = 0
    for part in embedder.embed_document(text, chunk_tokens=chunk, spill_dir=spill_dir):
        n += part.layers.shape[1]
        chunks += 1
    dt = time.perf_counter() - t0
    return {
        "tokens": n,
        "seconds": dt,
        "tps": n / dt,
        "chunks": chunks,
        "rss_before": before,
        "peak": status("VmHWM"),
        "growth": status("VmHWM") - before,
    }


def run_sentences(embedder: Embedder, sents: list[str], batch: int) -> dict:
    t0 = time.perf_counter()
    n = 0
    for s in embedder.embed_sentences(sents, batch_size=batch):
        n += s.layers.shape[1]
    dt = time.perf_counter() - t0
    return {"tokens": n, "seconds": dt, "tps": n / dt}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "default"))
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--chunk", type=int, default=None, help="chunk_tokens (default: the library's)")
    ap.add_argument(
        "--batch", type=int, default=256, help="sentence mode: sentences read at a time"
    )
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds of both modes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--spill-dir", default=None)
    ap.add_argument("--skip-sentences", action="store_true", help="document mode only")
    args = ap.parse_args(argv)

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    configure_process("cli")
    torch.set_num_threads(args.threads)
    flags = Path("/proc/cpuinfo").read_text()
    names = [
        ln.split(":", 1)[1].strip() for ln in flags.splitlines() if ln.startswith("model name")
    ]
    cpu = names[0] if names else platform.processor()
    isa = [f for f in ("avx512f", "avx512_bf16", "amx_tile") if f" {f}" in flags]
    print(
        f"- CPU: {cpu} ({os.cpu_count()} cores; {', '.join(isa)}); torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; load average {os.getloadavg()[0]:.2f}"
    )
    embedder = Embedder.load(args.model)
    embedder.warm_up()
    text, sents, total = build_text(embedder, args.tokens)
    print(
        f"- model {args.model} (kernel {embedder.kernel_name}); document: {total:,} tokens, "
        f"{len(text):,} characters, {len(sents):,} sentences"
    )
    docs, sens = [], []
    for r in range(args.rounds):
        if not args.skip_sentences:
            sens.append(run_sentences(embedder, sents, args.batch))
            print(
                f"  round {r}: sentence mode {sens[-1]['tps']:,.0f} tokens/s "
                f"({sens[-1]['seconds']:.1f} s)",
                flush=True,
            )
        docs.append(run_document(embedder, text, args.chunk, args.spill_dir))
        d = docs[-1]
        print(
            f"  round {r}: document mode {d['tps']:,.0f} tokens/s ({d['seconds']:.1f} s, "
            f"{d['chunks']} chunks); RSS {d['rss_before'] / 2**20:,.0f} MB before, peak "
            f"{d['peak'] / 2**20:,.0f} MB: growth {d['growth'] / 2**20:,.1f} MB",
            flush=True,
        )
    doc_tps = statistics.median(d["tps"] for d in docs)
    growth = max(d["growth"] for d in docs)
    p, n_out = embedder.cfg.projection_dim, embedder.n_layers
    spill = (total + 2) * (2 * n_out - 1) * p * 4
    print(
        f"- document mode: {doc_tps:,.0f} tokens/s (median of {len(docs)}); "
        f"RSS growth at most {growth / 2**20:,.1f} MB; spill file {spill / 2**30:,.2f} GiB"
    )
    if sens:
        sen_tps = statistics.median(s["tps"] for s in sens)
        print(
            f"- sentence mode: {sen_tps:,.0f} tokens/s; document / sentence = "
            f"{doc_tps / sen_tps:.2f}x"
        )
    print(f"- load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
