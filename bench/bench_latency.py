"""AllenNLP 2.10 vs this embedder, side by side, each in its own process, next to the machine's limits.

    PYTHONPATH=. .venv/bin/python bench/bench_latency.py                 # the table (~5 min)
    PYTHONPATH=. .venv/bin/python bench/bench_latency.py --rounds 3      # quicker, noisier
    PYTHONPATH=. .venv/bin/python bench/bench_latency.py --shapes small  # one shape
    PYTHONPATH=. .venv/bin/python bench/bench_latency.py --kernels       # the matmul kernels behind elmo_service/bilm/kernels/packed.py
    PYTHONPATH=. .venv/bin/python bench/bench_latency.py --phases        # where our time goes, per cell

Fair by construction (``bench/fair.py``): AllenNLP runs in a process of its own with
its defaults (no OpenMP / MKL variable of ours; ``torch.set_num_threads(n)`` as its users
set it), ours in another as the README says (``configure_process("library", n)``), the
same ``n`` threads, the same sentences; the two processes take turns, one round each,
the order alternating. The first lines name the CPU (model, ISA), torch and the load.

Cells: the AllenNLP-small shape (LSTM 1024/128, 2048 filters, 1 highway) at
batch 1 and 32, and the original ELMo shape (LSTM 4096/512, 2048 filters, 2
highway) at batch 1 and 20; random bilm-tf weights (``tests/support/bilm_fixtures``)
loaded by AllenNLP's own ``_ElmoBiLm`` and converted for ours; natural
sentences of 16-24 words (mean 20). Model time only: AllenNLP's
``batch_to_ids`` + ``_ElmoBiLm`` (states reset per request) against our
``Embedder.embed_tokens`` (no token cache: char ids, CNN per distinct token,
biLSTM, per-sentence numpy arrays). Ours also runs with its token cache warmed,
and with ``weights="int8"`` and ``weights="bf16"`` (the certified fast paths; their
certificates on this model are printed under the table), all in our process, their
order rotated each round.

A cell reports each side's median tokens/s over the rounds and the median of the
per-round ratios (the machine may be shared: compare ratios, not times).

Limits, measured in our process with the same thread count: the fp32 matmul
peak (1024^3), the memory bandwidth (streaming a 512 MB tensor) and the
last-level cache's (re-reading 8 MB). Per cell, the dense FLOPs per token
(biLSTM + highway/projection once per distinct token; the convolutions are
table lookups) and the weight bytes per token (the recurrent weights
once per step, the rest once per batch) give an upper bound on tokens/s: the
slower of FLOPs / peak and bytes / bandwidth, the recurrent weights read from
the cache when they fit in half of it (the small shape's 10 MB), the rest
from memory. Each path's bound uses its own bytes per recurrent weight (fp32 4,
bf16 2, int8 1; the rest of the weights are read as fp32 by all three).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import fair  # noqa: E402
from elmo_service.bilm.config import ELMO_FILTERS  # noqa: E402

SHAPES = {
    "small": dict(lstm_dim=1024, projection_dim=128, n_highway=1),
    "original": dict(lstm_dim=4096, projection_dim=512, n_highway=2),
}
CELLS = (("small", 1), ("small", 32), ("original", 1), ("original", 20))
WARM = 2000  # sentences that warm the token cache
# the targets against AllenNLP as its users run it: fp32, and the fastest certified path
TARGETS = {("small", 1): 2.5, ("small", 32): 5.0, ("original", 1): 1.8, ("original", 20): 2.8}
FAST_TARGETS = {("small", 1): 4.0, ("original", 1): 3.5}
FAST = ("int8", "bf16")
BYTES = {"fp32": 4, "bf16": 2, "int8": 1}  # per recurrent weight, as each path streams them
LABEL = {
    "small": "AllenNLP-small (LSTM 1024/128, 2048 filters, 1 highway)",
    "original": "original ELMo (LSTM 4096/512, 2048 filters, 2 highway)",
}


def sentences_of(n_words: tuple[int, int], seed: int = 0) -> list[list[str]]:
    from bench.bench_embedder import load_sources

    sources, _ = load_sources(None)
    words = [w for ws in sources.values() for w in ws]
    rng = random.Random(seed)
    out, i = [], 0
    while i + n_words[1] <= len(words):
        k = rng.randint(*n_words)
        out.append(words[i : i + k])
        i += k
    return out


# -- limits ---------------------------------------------------------------------------
def matmul_peak(reps: int = 6) -> float:
    import torch

    a = torch.randn(1024, 1024)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t)
    return 2 * 1024**3 / best


def bandwidth(mb: float = 512, reps: int = 5) -> float:
    """Bytes/s reading an ``mb`` MB tensor (512: far larger than the caches; a few MB
    read again and again: the last-level cache)."""
    import torch

    a = torch.ones(int(mb * 2**20) // 4)
    best = float("inf")
    for _ in range(reps * (1 if mb >= 64 else 20)):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.numel() * 4 / best


def l3_bytes() -> int:
    """The last-level cache's size (Linux sysfs), 0 when unknown."""
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return 0
    return int(text[:-1]) * 1024 if text.endswith("K") else int(text)


def step_bytes(cfg, per_weight: int = 4) -> int:
    """Bytes of W_hh and W_proj, all layers and directions: read once per step."""
    c, p = cfg.lstm_dim, cfg.projection_dim
    return per_weight * 2 * cfg.n_layers * (p * 4 * c + c * p)


def batch_bytes(cfg) -> int:
    """fp32 bytes read once per batch: LSTM input weights, CNN lookup tables, highway, projection."""
    c, p, f = cfg.lstm_dim, cfg.projection_dim, cfg.n_filters
    tables = sum(w * 262 * n for w, n in cfg.filters)
    return 4 * (2 * cfg.n_layers * p * 4 * c + tables + cfg.n_highway * f * 2 * f + f * p)


def flops_per_token(cfg, distinct: float) -> float:
    """Dense FLOPs per real token as our embedder runs it: the biLSTM for every token,
    highway + projection once per distinct token of a batch (convolutions: lookups)."""
    c, p, f = cfg.lstm_dim, cfg.projection_dim, cfg.n_filters
    lstm = 2 * cfg.n_layers * 2 * (p * 4 * c + p * 4 * c + c * p)
    cnn = 2 * (cfg.n_highway * f * 2 * f + f * p)
    return lstm + distinct * cnn


# -- the sides ------------------------------------------------------------------------
def shape_files(shape: str, directory: Path) -> tuple[Path, Path]:
    from tests.support.bilm_fixtures import write_bilm

    return write_bilm(
        directory / shape, n_characters=262, filters=[list(f) for f in ELMO_FILTERS],
        char_dim=16, clip=3.0, **SHAPES[shape],
    )  # fmt: skip


def our_artifact(options: str, weights: str):
    from elmo_service.artifact import Artifact
    from elmo_service.convert import load_bilm
    from elmo_service.tokenizers import WordTokenizer

    model, _ = load_bilm(Path(options), Path(weights))
    return Artifact(path=Path(options).parent, config=model.cfg, tokenizer=WordTokenizer(),
                    model=model, version=Path(options).parent.name)  # fmt: skip


class OursSide:
    """Our process's sides on one model: the Embedder without a token cache (fp32, int8,
    bf16) and fp32 with its default cache warmed on ``warm``; run in turn, rotated."""

    def __init__(self, options: str, weights: str, warm: list[list[str]]) -> None:
        from elmo_service.embedder import Embedder

        art = our_artifact(options, weights)

        def ours(mode: str, cache: int = 0) -> Embedder:
            return Embedder(
                art, device="cpu", token_cache_size=cache, batch_tokens=1 << 30,
                max_batch_sentences=1 << 20, weights=mode,
            )  # fmt: skip

        self.cached = ours("fp32", 100_000)
        from bench.bench_embedder import warm_cache

        warm_cache(self.cached, warm)
        self.embedders = {"ours": ours("fp32"), "cache": self.cached}
        self.embedders.update({m: ours(m) for m in FAST})
        self.cfg = art.config
        self.requests: list = []
        self._reset = cache_reset(self.cached)

    def set_requests(self, requests: list) -> int:
        self.requests = requests
        for emb in self.embedders.values():
            emb.embed_tokens(requests[0])  # warm-up: allocator, packed weights, numba
        self._reset()
        return sum(len(s) for r in requests for s in r)

    def run(self, k: int = 0) -> dict[str, float]:
        n = sum(len(s) for r in self.requests for s in r)
        names = list(self.embedders)
        rates = {}
        for name in names[k % len(names) :] + names[: k % len(names)]:
            if name == "cache":
                self._reset()  # each round meets the measured sentences for the first time
            emb = self.embedders[name]
            t = time.perf_counter()
            for r in self.requests:
                emb.embed_tokens(r)
            rates[name] = n / (time.perf_counter() - t)
        return rates

    def hits(self) -> float:
        self._reset()
        self.cached.cache_hits = self.cached.cache_misses = 0
        for r in self.requests:
            self.cached.embed_tokens(r)
        return self.cached.cache_hits / max(1, self.cached.cache_hits + self.cached.cache_misses)

    def layers(self, batch: list[list[str]], path: str) -> str:
        import numpy as np

        np.savez(path, *self.embedders["ours"].embed_tokens(batch))
        return path

    def certificates(self) -> dict[str, dict]:
        return {m: self.embedders[m].certificate for m in FAST}

    def limits(self) -> dict[str, float]:
        return {"peak": matmul_peak(), "bw": bandwidth(), "l3": l3_bytes(), "bw_l3": bandwidth(8)}

    def config(self) -> dict:
        return self.cfg.to_dict()


def cache_reset(emb):
    """A function that puts ``emb``'s token cache back to its current (warmed) contents,
    so that every round meets the measured sentences for the first time."""
    snapshot, size = emb.runner.cache_items(), emb.runner.cache_size

    def reset() -> None:
        emb.runner.resize_cache(size)
        emb.runner.fill_cache(snapshot)

    return reset


def parity(rival: fair.Side, ours: fair.Side, batch, tmp: Path) -> float:
    """Largest difference between AllenNLP's layers and ours (fp32) on ``batch``."""
    import numpy as np

    ref = np.load(rival.call("layers", batch=batch, path=str(tmp / "theirs.npz")))
    got = np.load(ours.call("layers", batch=batch, path=str(tmp / "ours.npz")))
    ref = [ref[f"arr_{j}"] for j in range(len(ref.files))]
    worst = 0.0
    for b in range(len(got.files)):
        arr, n = got[f"arr_{b}"], len(batch[b])
        for j in range(arr.shape[0]):
            worst = max(worst, float(abs(arr[j] - ref[j][b, 1 : n + 1]).max()))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--kernels", action="store_true", help="only the matmul kernel table")
    ap.add_argument(
        "--phases", action="store_true", help="only our side's time per phase (CNN, biLSTM, rest)"
    )
    ap.add_argument("--out", help="also write the markdown to this file")
    ap.add_argument(
        "--rival-passive",
        action="store_true",
        help="also AllenNLP with OMP_WAIT_POLICY=PASSIVE (not its default), in a third process: "
        "on a machine loaded past its cores its default spin collapses; ratios against the "
        "better of its two runs are then printed too",
    )
    ap.add_argument(
        "--shapes", nargs="+", choices=("small", "original"), default=["small", "original"]
    )
    args = ap.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    if args.kernels or args.phases:  # ours alone, in this process, as the README says
        from elmo_service import configure_process

        configure_process("library", args.threads)
    lines: list[str] = []

    def emit(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    for line in fair.header(args.threads):
        emit(line)
    if args.kernels:
        kernel_table(emit)
    elif args.phases:
        phase_table(args, emit)
    else:
        latency_table(args, emit)
    emit(fair.footer())
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


def latency_table(args, emit) -> None:
    sents = sentences_of((16, 24))
    warm, sents = sents[:WARM], sents[WARM:]
    emit(
        f"{args.rounds} rounds per cell, AllenNLP and ours in two processes taking turns; "
        f"sentences of 16-24 words (mean 20); token cache warmed on the {WARM} sentences "
        "before the measured ones"
    )
    certs, lim = {}, None
    offset = 0
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for shape in args.shapes:
            options, weights = shape_files(shape, tmp)
            files = dict(options=str(options), weights=str(weights))
            with contextlib.ExitStack() as stack:
                side = lambda role, factory, files=files, **kw: stack.enter_context(  # noqa: E731
                    fair.Side(role, factory, args.threads, **kw, **files)
                )
                rival = side("rival", "bench.rival_allennlp:AllenSide")
                ours = side("ours", "bench.bench_latency:OursSide", warm=warm)
                passive = None
                if args.rival_passive:
                    passive = side("rival", "bench.rival_allennlp:AllenSide",
                                   env={"OMP_WAIT_POLICY": "PASSIVE"})  # fmt: skip
                if lim is None:
                    lim = ours.call("limits")
                    table_head(args, emit, lim)
                from elmo_service.bilm.config import BiLMConfig

                cfg = BiLMConfig(**ours.call("config"))
                certs[shape] = ours.call("certificates")
                for cell_shape, batch in CELLS:
                    if cell_shape != shape:
                        continue
                    n_req = max(1, (8 if shape == "small" else 2) // batch)
                    requests = [
                        sents[offset + k * batch : offset + (k + 1) * batch] for k in range(n_req)
                    ]
                    offset += n_req * batch
                    diff = parity(rival, ours, requests[0], tmp)
                    rival.call("set_requests", requests=requests)
                    ours.call("set_requests", requests=requests)
                    sides = {"allennlp": rival, "ours": ours}
                    if passive is not None:
                        passive.call("set_requests", requests=requests)
                        sides["passive"] = passive
                    per_round = fair.alternate(sides, "run", args.rounds)
                    hits = ours.call("hits")
                    rates = {k: [r[k] for r in per_round["ours"]] for k in per_round["ours"][0]}
                    rates["allennlp"] = [r["allennlp"] for r in per_round["allennlp"]]
                    if passive is not None:
                        rates["passive"] = [r["allennlp"] for r in per_round["passive"]]
                    emit(cell_row(shape, batch, cfg, requests, rates, hits, diff, lim))
    emit()
    for shape, cs in certs.items():
        for mode, c in cs.items():
            emit(f"certificate, {shape} shape, {mode}: max |{mode} - fp32| / max |fp32| = "
                 f"{c['max_rel_diff']:.2e} over {c['sentences']} sentences ({c['tokens']} "
                 "tokens); held-out perplexity: none (random weights, no held-out text)")  # fmt: skip


def table_head(args, emit, lim) -> None:
    emit(
        f"measured limits (our process): fp32 matmul peak {lim['peak'] / 1e9:.0f} GFLOP/s "
        f"(1024^3), memory bandwidth {lim['bw'] / 1e9:.1f} GB/s (512 MB stream), last-level "
        f"cache {lim['l3'] / 2**20:.0f} MB at {lim['bw_l3'] / 1e9:.0f} GB/s (8 MB re-read)"
    )
    emit()
    emit(
        "| shape | batch | AllenNLP tok/s | ours fp32 tok/s | ratio (target) | ours + token cache "
        "(hits) | ratio | int8 tok/s | ratio | bf16 tok/s | ratio | fastest certified (target) "
        "| MFLOP/token | limit tok/s fp32 / bf16 / int8 (FLOPs-bound) | % of own limit fp32 / "
        "bf16 / int8 | parity max diff |"
        + (" AllenNLP PASSIVE tok/s (not its default) | fp32 vs AllenNLP's better run | "
           "fastest certified vs its better run |" if args.rival_passive else "")
    )  # fmt: skip
    emit("|" + "---|" * (19 if args.rival_passive else 16))


def cell_row(shape, batch, cfg, requests, rates, hits, diff, lim) -> str:
    med = {k: statistics.median(v) for k, v in rates.items()}
    ratio = {
        k: statistics.median(o / a for o, a in zip(v, rates["allennlp"], strict=True))
        for k, v in rates.items()
        if k != "passive"
    }
    words = [w for r in requests for s in r for w in s]
    distinct = len(set(words)) / len(words) if batch > 1 else 1.0
    fl = flops_per_token(cfg, distinct)
    n_req = len(requests)
    steps = sum(len(s) + 2 for r in requests for s in r) / (n_req * batch)
    real = steps - 2
    lim_f = lim["peak"] / fl
    limits = {}
    for mode, per_weight in BYTES.items():
        rec_step = step_bytes(cfg, per_weight)
        # seconds per token reading the weights: the recurrent ones from the cache when
        # they fit in half of it (read once per sentence from memory), the rest from memory
        rec = rec_step * steps / (batch * real)
        rest = batch_bytes(cfg) / (batch * real)
        if rec_step <= lim["l3"] / 2:
            sec = rec / lim["bw_l3"] + (rest + rec_step / (batch * real)) / lim["bw"]
        else:
            sec = (rec + rest) / lim["bw"]
        limits[mode] = min(lim_f, 1 / sec)
    target = TARGETS[(shape, batch)]
    met = "met" if ratio["ours"] >= target else "missed"
    fast = max(FAST, key=lambda m: ratio[m])
    ft = FAST_TARGETS.get((shape, batch))
    fast_cell = f"{fast} **{ratio[fast]:.2f}x**" + (
        f" ({ft}x: {'met' if ratio[fast] >= ft else 'missed'})" if ft else ""
    )
    lim_cell = " / ".join(f"{limits[m]:,.0f}" for m in ("fp32", "bf16", "int8"))
    lim_cell += f" ({lim_f:,.0f})"
    pct = " / ".join(f"{med[k]/limits[m]:.0%}" for k, m in (("ours", "fp32"), ("bf16", "bf16"),
                                                              ("int8", "int8")))  # fmt: skip
    extra = ""
    if "passive" in rates:
        best = [max(a, b) for a, b in zip(rates["allennlp"], rates["passive"], strict=True)]
        vs = {k: statistics.median(o / a for o, a in zip(rates[k], best, strict=True))
              for k in ("ours", fast)}  # fmt: skip
        extra = f" {med['passive']:,.0f} | {vs['ours']:.2f}x | {fast} {vs[fast]:.2f}x |"
    return (
        f"| {LABEL[shape]} | {batch} | {med['allennlp']:,.0f} | {med['ours']:,.0f} | "
        f"**{ratio['ours']:.2f}x** ({target}x: {met}) | {med['cache']:,.0f} ({hits:.0%}) | "
        f"{ratio['cache']:.2f}x | {med['int8']:,.0f} | {ratio['int8']:.2f}x | "
        f"{med['bf16']:,.0f} | {ratio['bf16']:.2f}x | {fast_cell} | {fl / 1e6:.1f} | "
        f"{lim_cell} | {pct} | {diff:.1e} |{extra}"
    )


def phase_table(args, emit) -> None:
    """Our fp32 side (no token cache) per request: the character CNN (``token_vectors``),
    the biLSTM (``BiLstmKernel``) and the rest of ``embed_tokens``, median over rounds."""
    import elmo_service.bilm.kernels.bilstm as bilstm
    from elmo_service.bilm.runner import Runner
    from elmo_service.embedder import Embedder as Emb

    spent: dict[str, float] = {}

    def timed_method(cls, name: str, label: str):
        real = getattr(cls, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - t

        setattr(cls, name, wrapper)
        return real

    sents = sentences_of((16, 24))[WARM:]
    emit(f"ms per request, median of {args.rounds} rounds")
    emit()
    emit("| shape | batch | whole call | character CNN | biLSTM | rest |")
    emit("|---|---|---|---|---|---|")
    saved = [
        (Runner, "token_vectors", timed_method(Runner, "token_vectors", "cnn")),
        (bilstm.BiLstmKernel, "__call__", timed_method(bilstm.BiLstmKernel, "__call__", "lstm")),
    ]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for shape in args.shapes:
                options, weights = shape_files(shape, Path(tmp))
                ours = Emb(our_artifact(str(options), str(weights)), device="cpu",
                           token_cache_size=0, batch_tokens=1 << 30,
                           max_batch_sentences=1 << 20).embed_tokens  # fmt: skip
                for cell_shape, batch in CELLS:
                    if cell_shape != shape:
                        continue
                    n_req = max(1, (8 if shape == "small" else 2) // batch)
                    requests = [sents[k * batch : (k + 1) * batch] for k in range(n_req)]
                    ours(requests[0])
                    per_round: dict[str, list[float]] = {"all": [], "cnn": [], "lstm": []}
                    for _ in range(args.rounds):
                        spent.clear()
                        t = time.perf_counter()
                        for r in requests:
                            ours(r)
                        per_round["all"].append((time.perf_counter() - t) / n_req * 1e3)
                        for k in ("cnn", "lstm"):
                            per_round[k].append(spent.get(k, 0.0) / n_req * 1e3)
                    med = {k: statistics.median(v) for k, v in per_round.items()}
                    rest = med["all"] - med["cnn"] - med["lstm"]
                    emit(
                        f"| {shape} | {batch} | {med['all']:.1f} | {med['cnn']:.1f} | "
                        f"{med['lstm']:.1f} | {rest:.1f} |"
                    )
    finally:
        for cls, name, real in saved:
            setattr(cls, name, real)


# -- kernels --------------------------------------------------------------------------
def kernel_table(emit) -> None:
    """MKL (both layouts) vs pre-packed oneDNN vs MKL's own packed GEMM vs int8 for the
    model's matmul shapes."""
    import torch

    emit("best of 7 x 5 calls")
    emit()
    emit(
        "| weight [N, K] | rows M | MKL x @ W^T | MKL x @ W | oneDNN packed | MKL packed | "
        "int8 mode (fbgemm, 2 passes) |"
    )
    emit("|---|---|---|---|---|---|---|")
    shapes = [(4096, 128, "small W_hh"), (128, 1024, "small W_proj"),
              (16384, 512, "original W_hh"), (512, 4096, "original W_proj"),
              (4096, 2048, "highway (2048 filters)")]  # fmt: skip
    for n, k, name in shapes:
        for m in (1, 4, 20, 32):
            best = time_kernels(torch.randn(n, k) / k**0.5, torch.randn(m, k).clamp(-3, 3))
            cells = [f"{v * 1e3:.3f} ms ({2 * m * n * k / v / 1e9:.0f} GFLOP/s)" for v in best]
            emit(f"| {name} [{n}, {k}] | {m} | " + " | ".join(cells) + " |")


def time_kernels(w, x) -> list[float]:
    """Best seconds per call: MKL on W^T and on W, oneDNN pre-packed, MKL's packed GEMM
    (``_mkl_reorder_linear_weight`` for this row count, as inductor uses it), and the int8 mode
    as shipped (``PackedLinear(int8=True)``: two 7-bit passes of fbgemm, forced on
    every size here)."""
    import torch

    import elmo_service.bilm.kernels.packed as packed_mod
    import elmo_service.bilm.kernels.tuning as tuning

    wt = w.t().contiguous()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    m = x.shape[0]
    mkl_packed = torch.ops.mkl._mkl_reorder_linear_weight(w, m)
    threshold, tuning.INT8_MIN_ELEMENTS = tuning.INT8_MIN_ELEMENTS, 0
    try:
        q = packed_mod.PackedLinear(w, int8=True)
    finally:
        tuning.INT8_MIN_ELEMENTS = threshold
    fns = [
        lambda: torch.mm(x, wt),
        lambda: torch.mm(x, w.t()),
        lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        lambda: torch.ops.mkl._mkl_linear(x, mkl_packed, w, None, m),
        lambda: q(x),
    ]
    best = [float("inf")] * len(fns)
    for _ in range(7):
        for i, f in enumerate(fns):
            t = time.perf_counter()
            for _ in range(5):
                f()
            best[i] = min(best[i], (time.perf_counter() - t) / 5)
    return best


if __name__ == "__main__":
    main()
