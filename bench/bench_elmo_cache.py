"""The frozen ``Elmo``'s layer cache and its weights watch, measured side by side.

    PYTHONPATH=. .venv/bin/python bench/bench_elmo_cache.py [--model models/default]
        [--sentences 300] [--epochs 5] [--threads 2]

1. **Training a tagger over a frozen Elmo** (``Elmo`` -> linear -> masked
   cross-entropy, Adam, batches of 32 shuffled each epoch, ``--sentences`` sentences
   of prose-like lengths): without the cache (every epoch runs the biLM) and with
   ``cache_bytes`` (epoch 1 fills it, later epochs run the mixes and the tagger),
   epochs interleaved side by side. Prints each epoch's time and the total.
2. **The weights watch's cost** (``WeightsWatch``: each frozen forward checks the
   biLM's weights for writes, by integer reads): a frozen forward with it and with it
   switched off (the kernel kept as is), alternating, at batch 1 and batch 32, and how
   many times it read a weight's content (0 expected: nothing handed out).

Prints the CPU, its ISA, torch's version and the load: on a shared machine compare
the two sides of one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import fair  # noqa: E402
from elmo_service.bilm import layer_cache  # noqa: E402
from elmo_service.elmo import Elmo, batch_to_ids  # noqa: E402


def cpu() -> str:
    """The CPU and its ISA, as every bench names them (``bench/fair.py``)."""
    return f"{fair.cpu_model()} ({fair.isa()}), {os.cpu_count()} cpus"


def sentences(rng: np.random.Generator, n: int) -> list[list[str]]:
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    vocab = ["".join(rng.choice(letters, size=int(rng.integers(1, 9)))) for _ in range(3000)]
    zipf = 1.0 / np.arange(1, len(vocab) + 1)
    zipf /= zipf.sum()
    out = []
    for _ in range(n):
        length = int(np.clip(rng.gamma(4.0, 6.0), 3, 45))
        out.append([vocab[i] for i in rng.choice(len(vocab), size=length, p=zipf)])
    return out


class Tagger:
    def __init__(self, model: str, cache_bytes: int, seed: int) -> None:
        torch.manual_seed(seed)
        self.elmo = Elmo.from_pretrained(model, 1, dropout=0.5, cache_bytes=cache_bytes)
        self.head = torch.nn.Linear(self.elmo.get_output_dim(), 17)
        params = [*self.elmo.parameters(), *self.head.parameters()]
        self.opt = torch.optim.Adam([p for p in params if p.requires_grad], lr=1e-3)
        self.rng = np.random.default_rng(seed)
        self.torch_rng = torch.get_rng_state()  # each side its own dropout stream

    def epoch(self, data: list[list[str]], tags: list[np.ndarray]) -> tuple[float, float]:
        torch.set_rng_state(self.torch_rng)
        t0 = time.perf_counter()
        total = 0.0
        order = self.rng.permutation(len(data))
        for start in range(0, len(data), 32):
            idx = order[start : start + 32]
            out = self.elmo(batch_to_ids([data[i] for i in idx]))
            mask = out["mask"]
            gold = torch.zeros(mask.shape, dtype=torch.long)
            for j, i in enumerate(idx):
                gold[j, : len(tags[i])] = torch.from_numpy(tags[i])
            logits = self.head(out["elmo_representations"][0])
            loss = torch.nn.functional.cross_entropy(logits[mask], gold[mask])
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            total += float(loss.detach())
        seconds = time.perf_counter() - t0
        self.torch_rng = torch.get_rng_state()
        return seconds, total


def training(args) -> None:
    rng = np.random.default_rng(0)
    data = sentences(rng, args.sentences)
    tags = [rng.integers(0, 17, len(s)) for s in data]
    sides = {"no cache": Tagger(args.model, 0, 1), "cache": Tagger(args.model, 2**31, 1)}
    times: dict[str, list[float]] = {k: [] for k in sides}
    losses: dict[str, list[float]] = {k: [] for k in sides}
    for epoch in range(1, args.epochs + 1):
        for name, side in sides.items():
            seconds, loss = side.epoch(data, tags)
            times[name].append(seconds)
            losses[name].append(loss)
        print(
            f"epoch {epoch}: "
            + "  ".join(f"{k} {times[k][-1]:6.2f} s (loss {losses[k][-1]:.4f})" for k in sides),
            flush=True,
        )
    a, b = sum(times["no cache"]), sum(times["cache"])
    rel = max(abs(x - y) / abs(x) for x, y in zip(losses["no cache"], losses["cache"], strict=True))
    print(
        f"{args.epochs} epochs of {args.sentences} sentences: no cache {a:.1f} s, cache {b:.1f} s: "
        f"{a / b:.2f}x; epoch losses' largest relative difference {rel:.1e}; "
        f"cache {sides['cache'].elmo.cache_stats}",
        flush=True,
    )


def watch_cost(args) -> None:
    rng = np.random.default_rng(1)
    elmo = Elmo.from_pretrained(args.model, 1, dropout=0.0).eval()
    follow = elmo._follow_weights
    reads = [0]  # content reads of a weight by the watch (none while no handle is out)
    fingerprint = layer_cache._fingerprint

    def counted(t):
        reads[0] += 1
        return fingerprint(t)

    layer_cache._fingerprint = counted
    for batch in (1, 32):
        ids = batch_to_ids(sentences(rng, batch))
        with torch.no_grad():
            elmo(ids)
            t = {"watch": [], "off": []}
            for _ in range(args.rounds):
                for side in ("watch", "off"):
                    elmo._follow_weights = follow if side == "watch" else (lambda: None)
                    t0 = time.perf_counter()
                    elmo(ids)
                    t[side].append(time.perf_counter() - t0)
        w, o = statistics.median(t["watch"]), statistics.median(t["off"])
        print(
            f"batch {batch:2d} ({int(ids.shape[1])} tokens max): forward with the watch "
            f"{w * 1e3:7.2f} ms, without {o * 1e3:7.2f} ms: +{100 * (w / o - 1):.1f} % "
            f"(target: +10 % at most); content reads {reads[0]}",
            flush=True,
        )
    elmo._follow_weights = follow
    layer_cache._fingerprint = fingerprint
    n = sum(p.numel() for p in elmo._elmo_lstm.parameters())
    t0 = time.perf_counter()
    for _ in range(args.rounds):
        elmo._watch.changed(list(elmo._elmo_lstm.parameters()))
    print(
        f"the watch alone: {(time.perf_counter() - t0) / args.rounds * 1e3:.2f} ms for "
        f"{n:,} weights",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/default")
    ap.add_argument("--sentences", type=int, default=300)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{cpu()}; torch {torch.__version__}, {args.threads} threads; load {os.getloadavg()}")
    training(args)
    watch_cost(args)
    print(f"load at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
