"""Embedder throughput on this machine, in one run, as a markdown table.

    .venv/bin/python bench/bench_embedder.py            # full run (~10 min with compile)
    .venv/bin/python bench/bench_embedder.py --quick    # ~2 min, no compile rows

Measures tokens/s (real tokens, sentence markers not counted) for requests of
1, 8, 32 and 128 sentences of ~12 words of natural English, for

* two model shapes, random weights: (a) AllenNLP-small (LSTM 1024 / proj 128,
  2048-filter CNN, 1 highway) and (b) the project's default config
  (``configs/default.yaml`` ``model:`` section, else LSTM 1024 / proj 128 with
  the 1024-filter CNN);
* fp32 and bf16 autocast;
* ``naive``: a reference written the plain way (Conv1d on every position of
  the padded batch, input matmul inside the time loop, torch.tanh, batches
  as they come, no token dedup);
* ``embedder, no cache``: ``Embedder(token_cache_size=0)`` (the CNN still
  runs once per distinct token of a batch);
* ``embedder, token cache``: the cache warmed on the text that precedes the
  measured sentences, the hit rate reported;
* ``compiled``: ``Embedder(compile=True)`` at batch 32 (full run only).

Also printed: FLOPs per token, the effective GFLOP/s, and fp32/bf16 matmul
peaks measured in the same run. The machine is shared: each cell is the
median over several windows of sentences, and the load average is printed;
compare ratios within one run, not absolute numbers across runs.

Text: ``--text FILE`` if given, else ``data/corpus/*.txt`` if present (600k
characters from the middle of each file), else the English prose paragraphs
of Python's own ``pydoc_data`` help topics (~38k words, shipped with every
CPython). Sources are interleaved in blocks of 16 sentences, like a service
with several clients; the word distribution (Zipfian repetition, which the
token cache depends on) is that of real text.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

# Spinning OpenMP threads collapse (2-20x) when another process holds a core,
# as it does on this shared machine; must be set before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import fair  # noqa: E402
from elmo_service.artifact import Artifact  # noqa: E402
from elmo_service.bilm.char_ids import batch_ids  # noqa: E402
from elmo_service.bilm.config import ELMO_FILTERS, BiLMConfig  # noqa: E402
from elmo_service.bilm.model import BiLM, length_mask, reverse_padded  # noqa: E402
from elmo_service.embedder import Embedder  # noqa: E402
from elmo_service.runtime import autocast  # noqa: E402
from elmo_service.tokenizers import WordTokenizer  # noqa: E402
from tests.support import reference  # noqa: E402

BATCHES = (1, 8, 32, 128)
FALLBACK_DEFAULT = dict(
    lstm_dim=1024,
    projection_dim=128,
    n_highway=1,
    filters=((1, 32), (2, 32), (3, 64), (4, 128), (5, 256), (6, 512)),
)


# -- text ---------------------------------------------------------------------------
def load_sources(path: str | None) -> tuple[dict[str, list[str]], str]:
    """Words of each text source: ``--text``, else data/corpus/*.txt, else pydoc prose."""
    files = [Path(path)] if path else sorted((ROOT / "data" / "corpus").glob("*.txt"))
    tok = WordTokenizer()
    if files:
        out = {}
        for f in files:
            text = f.read_text(errors="ignore")
            mid = max(0, len(text) // 2 - 300_000)  # 600k characters from the middle
            out[f.stem] = [t.text for t in tok.tokenize(text[mid : mid + 600_000])]
        return out, path or "data/corpus (" + ", ".join(out) + ")"
    words = [t.text for t in tok.tokenize("\n".join(pydoc_prose()))]
    return {"pydoc": words}, "pydoc_data help-topic prose (CPython)"


def pydoc_prose() -> list[str]:
    """CPython's help-topic prose (``pydoc_data``, always installed): its paragraphs that are
    not indented (code) and are mostly alphabetic words, one line each."""
    import pydoc_data.topics

    paras = re.split(r"\n\s*\n", "\n".join(pydoc_data.topics.topics.values()))
    return [
        " ".join(p.split())
        for p in paras
        if not p.startswith("   ")
        and len(p.split()) > 8
        and len(re.findall(r"[A-Za-z]+", p)) > 0.8 * len(p.split())
    ]


def make_sentences(
    sources: dict[str, list[str]], seed: int = 0, block: int = 16
) -> list[list[str]]:
    """Runs of 8-16 consecutive words (mean 12); the sources interleaved in blocks
    of ``block`` sentences, like a service serving several clients at once."""
    rng = random.Random(seed)
    per_source = []
    for words in sources.values():
        sents, i = [], 0
        while i + 16 <= len(words):
            n = rng.randint(8, 16)
            sents.append(words[i : i + n])
            i += n
        per_source.append(sents)
    out: list[list[str]] = []
    for k in range(0, max(len(s) for s in per_source), block):
        for sents in per_source:
            out.extend(sents[k : k + block])
    return out


# -- configs and FLOPs --------------------------------------------------------------
def default_config() -> tuple[BiLMConfig, str]:
    path = ROOT / "configs" / "default.yaml"
    if path.is_file():
        import yaml

        model = (yaml.safe_load(path.read_text()) or {}).get("model")
        if model:
            return BiLMConfig.from_dict(model), "configs/default.yaml"
    return BiLMConfig(**FALLBACK_DEFAULT), "fallback (no configs/default.yaml)"


def flops_per_token(cfg: BiLMConfig) -> dict[str, float]:
    """Dense FLOPs (2 per multiply-add) for one token position, inference."""
    w = cfg.max_chars_per_token
    f, p, c = cfg.n_filters, cfg.projection_dim, cfg.lstm_dim
    conv = sum(2 * cfg.char_dim * width * n * (w - width + 1) for width, n in cfg.filters)
    highway = cfg.n_highway * 2 * f * 2 * f
    proj = 2 * f * p
    lstm = 2 * cfg.n_layers * (2 * p * 4 * c + 2 * p * 4 * c + 2 * c * p)  # both directions
    return {"conv": conv, "highway": highway, "proj": proj, "lstm": lstm}


def matmul_peak(dtype: torch.dtype, m: int, k: int, n: int, reps: int = 5) -> float:
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    best = float("inf")
    for _ in range(reps + 1):
        t = time.perf_counter()
        for _ in range(4):
            a @ b
        best = min(best, (time.perf_counter() - t) / 4)
    return 2 * m * k * n / best / 1e9


# -- the naive reference ------------------------------------------------------------
@torch.inference_mode()
def naive_forward(model: BiLM, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The plain way: Conv1d on every padded position, per-step input matmul, tanh."""
    enc, cfg = model.token_encoder, model.cfg
    b, t, w = ids.shape
    x = enc.char_embed(ids.reshape(b * t, w)).transpose(1, 2)
    act = torch.tanh if cfg.activation == "tanh" else F.relu
    x = torch.cat([act(conv(x).amax(-1)) for conv in enc.convs], dim=-1)
    for hw in enc.highways:
        x = reference.highway(x, hw)
    tokens = enc.projection(x).reshape(b, t, -1)
    mask = length_mask(lengths, t).unsqueeze(-1).to(tokens.dtype)
    tokens = tokens * mask

    def direction(layer, xs: torch.Tensor) -> torch.Tensor:
        h = xs.new_zeros(b, layer.proj_dim)
        c = xs.new_zeros(b, layer.cell_dim)
        outs = []
        for s in range(t):  # the one reference's cell, all rows at once
            h, c = reference.lstmp_cell(xs[:, s], h, c, layer, xs.dtype)
            outs.append(h)
        return torch.stack(outs, dim=1)

    fwd_in, bwd_in = tokens, reverse_padded(tokens, lengths)
    layers = [torch.cat([tokens, tokens], dim=-1)]
    for i, (fl, bl) in enumerate(zip(model.forward_layers, model.backward_layers, strict=True)):
        f, r = direction(fl, fwd_in), direction(bl, bwd_in)
        if cfg.residual and i > 0:
            f, r = f + fwd_in, r + bwd_in
        fwd_in, bwd_in = f, r
        layers.append(torch.cat([f, reverse_padded(r, lengths)], dim=-1) * mask)
    return torch.stack(layers)


def naive_embed(model: BiLM, precision: str) -> Callable[[Sequence[Sequence[str]]], None]:
    def run(sentences: Sequence[Sequence[str]]) -> None:
        ids, lengths = batch_ids(sentences, model.cfg.max_chars_per_token)
        with autocast(torch.device("cpu"), precision):
            out = naive_forward(model, torch.from_numpy(ids), torch.from_numpy(lengths))
        out.float().numpy()

    return run


# -- measuring ----------------------------------------------------------------------
def regions(sentences: list[list[str]], n_windows: int, per_window: int):
    """Per batch size: one warm-up request, then ``n_windows`` windows of whole
    requests. Disjoint across batch sizes, so the token cache never sees a
    measured sentence twice; the same for every path."""
    out, off = {}, 0
    for batch in BATCHES:
        size = max(batch, per_window // batch * batch)
        warmup = sentences[off : off + batch]
        off += batch
        wins = [sentences[off + k * size : off + (k + 1) * size] for k in range(n_windows)]
        off += n_windows * size
        out[batch] = (warmup, wins)
    if off > len(sentences):
        sys.exit(
            f"text too short: need {off} sentences after the cache warm-up, have {len(sentences)}"
        )
    return out


def tokens_per_s(run, wins: list[list[list[str]]], batch: int, emb: Embedder | None = None):
    rates, hits, total = [], 0, 0
    for win in wins:
        h0, m0 = (emb.cache_hits, emb.cache_misses) if emb else (0, 0)
        t = time.perf_counter()
        for k in range(0, len(win), batch):
            run(win[k : k + batch])
        rates.append(sum(len(s) for s in win) / (time.perf_counter() - t))
        if emb:
            hits += emb.cache_hits - h0
            total += emb.cache_hits - h0 + emb.cache_misses - m0
    return statistics.median(rates), (hits / total if total else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="short run: fewer windows, no compile rows"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--text", help="a text file to draw sentences from")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    ap.add_argument("--out", help="also write the markdown to this file")
    args = ap.parse_args()
    print("\n".join(fair.header(args.threads)))
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    n_windows, per_window, warm_sents = (1, 32, 5_000) if args.quick else (3, 96, 20_000)
    do_compile = not (args.quick or args.no_compile)

    sources, source = load_sources(args.text)
    sentences = make_sentences(sources)
    warm, test = sentences[:warm_sents], sentences[warm_sents:]
    plan = regions(test, n_windows, per_window)
    lines: list[str] = []

    def emit(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    cfg_b, cfg_b_source = default_config()
    configs = [
        (
            "(a) AllenNLP-small",
            BiLMConfig(lstm_dim=1024, projection_dim=128, n_highway=1, filters=ELMO_FILTERS),
        ),
        (f"(b) default [{cfg_b_source}]", cfg_b),
    ]
    load0 = os.getloadavg()[0]
    peaks = {
        "fp32": (
            matmul_peak(torch.float32, 1024, 1024, 1024),
            matmul_peak(torch.float32, 32, 128, 4096),
        ),
        "bf16": (
            matmul_peak(torch.bfloat16, 1024, 1024, 1024),
            matmul_peak(torch.bfloat16, 32, 128, 4096),
        ),
    }
    emit(f"# Embedder benchmark ({'quick' if args.quick else 'full'} run)")
    emit()
    emit(
        f"torch {torch.__version__}, {args.threads} threads, {os.cpu_count()} cores, "
        f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}; load average at start {load0:.2f}"
    )
    emit(f"text: {source}: {len(sentences)} sentences of 8-16 words (mean 12), sources interleaved")
    emit(
        f"token cache (100k entries) warmed on the first {warm_sents} sentences (CNN only); "
        f"{n_windows} window(s) of >= {per_window} sentences per cell, median"
    )
    for prec, (big, small) in peaks.items():
        emit(
            f"matmul peak {prec}: {big:.0f} GFLOP/s (1024^3), {small:.0f} GFLOP/s (32x128x4096, an LSTM step)"
        )
    emit()
    emit("| model | path | precision | batch 1 | batch 8 | batch 32 | batch 128 | cache hit rate |")
    emit("|---|---|---|---|---|---|---|---|")
    results: dict[tuple[str, str, str], dict[int, float]] = {}
    for name, cfg in configs:
        model = BiLM(cfg).eval()
        art = Artifact(
            path=Path("bench"), config=cfg, tokenizer=WordTokenizer(), model=model, version="bench"
        )
        for prec in ("fp32", "bf16"):
            # a fair reference: same numbers as the embedder
            check = test[:4]
            ref = make_embedder(art, prec, 0).embed_tokens(check)
            ids, lengths = batch_ids(check, cfg.max_chars_per_token)
            with autocast(torch.device("cpu"), prec):
                naive_out = naive_forward(
                    model, torch.from_numpy(ids), torch.from_numpy(lengths)
                ).float()
            tol = 1e-4 if prec == "fp32" else 0.1
            for r, arr in enumerate(ref):
                diff = (naive_out[:, r, 1 : len(check[r]) + 1] - torch.from_numpy(arr)).abs().max()
                assert diff <= tol, f"naive reference disagrees with the embedder: {diff}"
            paths: list[tuple[str, Callable, Embedder | None]] = [
                ("naive", naive_embed(model, prec), None)
            ]
            nocache = make_embedder(art, prec, 0)
            paths.append(("embedder, no cache", nocache.embed_tokens, nocache))
            cached = make_embedder(art, prec, 100_000)
            warm_cache(cached, warm)
            paths.append(("embedder, token cache", cached.embed_tokens, cached))
            for path, run, emb in paths:
                row, hit_rates = {}, []
                for batch in BATCHES:
                    if emb is not None:
                        emb.budget = dataclasses.replace(emb.budget, sentences=batch)
                    warmup, wins = plan[batch]
                    run(warmup)  # first-call costs (allocator, tables)
                    row[batch], hit = tokens_per_s(run, wins, batch, emb)
                    if hit is not None and path.endswith("cache"):
                        hit_rates.append(hit)
                results[(name, path, prec)] = row
                hit = f"{statistics.mean(hit_rates):.0%}" if hit_rates else ""
                cells = " | ".join(f"{row[b]:,.0f}" for b in BATCHES)
                emit(f"| {name} | {path} | {prec} | {cells} | {hit} |")
            if do_compile:
                comp = make_embedder(art, prec, 0, compile=True)
                comp.budget = dataclasses.replace(comp.budget, sentences=32)
                warmup, wins = plan[32]
                t = time.perf_counter()
                comp.embed_tokens(warmup)
                compile_s = time.perf_counter() - t
                # every window's length bucket compiles once, outside the timing
                for win in wins:
                    for k in range(0, len(win), 32):
                        comp.embed_tokens(win[k : k + 32])
                rate, _ = tokens_per_s(comp.embed_tokens, wins, 32, comp)
                results[(name, "compiled", prec)] = {32: rate}
                # a model with the same LSTM shape reuses the graph (parameters are inputs)
                first = f"first call {compile_s:.0f} s" if compile_s >= 1 else "graph reused"
                emit(
                    f"| {name} | embedder, no cache, torch.compile ({first}) | {prec} | | | {rate:,.0f} | | |"
                )
    emit()
    emit(f"load average at end {os.getloadavg()[0]:.2f}")
    emit()
    emit("## FLOPs per token and effective GFLOP/s at batch 32")
    emit()
    emit(
        "Dense FLOPs per token position (CNN as convolution; LSTM both directions, all layers). "
        "Effective GFLOP/s = dense FLOPs x tokens/s: above the matmul peak means work was skipped "
        "(lookup CNN, in-batch dedup, cache). The LSTM column counts only LSTM work, which no path skips."
    )
    emit()
    emit(
        "| model | conv | highway+proj | LSTM | total MFLOP/token | path | precision | effective GFLOP/s | LSTM GFLOP/s | matmul peak (1024^3 / LSTM step) |"
    )
    emit("|---|---|---|---|---|---|---|---|---|---|")
    for name, cfg in configs:
        fl = flops_per_token(cfg)
        total = sum(fl.values())
        for (n, path, prec), row in results.items():
            if n != name or 32 not in row:
                continue
            big, small = peaks[prec]
            emit(
                f"| {name} | {fl['conv'] / 1e6:.1f} | {(fl['highway'] + fl['proj']) / 1e6:.1f} | {fl['lstm'] / 1e6:.1f} "
                f"| {total / 1e6:.1f} | {path} | {prec} | {total * row[32] / 1e9:.0f} | {fl['lstm'] * row[32] / 1e9:.0f} "
                f"| {big:.0f} / {small:.0f} |"
            )
    emit()
    emit("## Ratios at batch 32")
    emit()
    for name, _ in configs:
        for prec in ("fp32", "bf16"):
            r = {
                p: results[(name, p, prec)][32]
                for p in ("naive", "embedder, no cache", "embedder, token cache")
            }
            comp = results.get((name, "compiled", prec), {}).get(32)
            extra = f", compiled/no cache {comp / r['embedder, no cache']:.2f}x" if comp else ""
            emit(
                f"- {name} {prec}: no cache / naive {r['embedder, no cache'] / r['naive']:.1f}x, "
                f"cache / no cache {r['embedder, token cache'] / r['embedder, no cache']:.2f}x, "
                f"cache / naive {r['embedder, token cache'] / r['naive']:.1f}x{extra}"
            )
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


def warm_cache(emb: Embedder, sentences: list[list[str]]) -> None:
    """Fill the token cache as a stream of ``sentences`` would, CNN only (fast)."""
    distinct = list(dict.fromkeys(t for s in sentences for t in s))
    with emb.runner.session():
        for k in range(0, len(distinct), 512):
            emb.runner.token_vectors(distinct[k : k + 512])
    emb.runner.cache_hits = emb.runner.cache_misses = 0


def make_embedder(art: Artifact, precision: str, cache: int, compile: bool = False) -> Embedder:
    # one request = one batch: no token budget in the way
    return Embedder(
        art, device="cpu", precision=precision, token_cache_size=cache,
        batch_tokens=1 << 30, max_batch_sentences=max(BATCHES), compile=compile,
    )  # fmt: skip


if __name__ == "__main__":
    main()
