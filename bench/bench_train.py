"""Training throughput: the trainer's model vs a plain eager implementation, in one run.

    .venv/bin/python bench/bench_train.py [--config configs/default.yaml] [--steps 30] [--warmup 3] [--threads 2]

Both sides train the same network (character CNN, highway, projection,
2-layer biLSTM with projection and clipping, the configured softmax, Adam) on
the same batches, alternating so that machine noise hits both alike:

* ``trainer``: ``elmo_pretrain.lm.LanguageModel`` as `elmo-pretrain train` runs it
  (CNN once per distinct token, input matmul hoisted out of the time loop,
  the config's precision and ``torch.compile`` setting);
* ``plain``: a straightforward eager fp32 version: the CNN on every
  position, an ``nn.LSTMCell``-style step ``x W_ih + h W_hh`` inside the time
  loop, no compile.

Batches: length-bucketed sentences of a Zipf-distributed synthetic vocabulary
of sentencepiece-like strings (the vocabulary size of the config's data or
``--vocab``), sentence lengths drawn like English prose (mean ~27 tokens).
Reports real (non-padding) tokens/s, the ratio, and effective GFLOP/s:
model FLOPs per token (CNN + highway + projection + LSTM + softmax, the CNN
counted for every token as the plain model runs it) x 3 for forward+backward;
and the trainer's actual GFLOP/s, with the encoder counted per distinct token.
The machine is shared: compare the two sides of one run, not runs.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `elmo-pretrain` does; before torch loads

import numpy as np
import torch
import torch._dynamo
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import fair  # noqa: E402
from elmo_pretrain.config import TrainConfig, load_config  # noqa: E402
from elmo_pretrain.data import Batch, padded_len  # noqa: E402
from elmo_pretrain.lm import LanguageModel  # noqa: E402
from elmo_pretrain.optim import make_optimizer  # noqa: E402
from elmo_service.bilm.char_ids import bos_ids, eos_ids, token_ids  # noqa: E402
from elmo_service.bilm.model import length_mask, reverse_padded  # noqa: E402
from elmo_service.runtime import autocast, resolve_precision, set_threads  # noqa: E402
from tests.support import reference  # noqa: E402

# ---------------------------------------------------------------- FLOPs


def flops_per_token(cfg: TrainConfig, vocab: int) -> dict[str, float]:
    """Forward FLOPs per token (2 per multiply-add), by component."""
    m = cfg.model
    w = m.max_chars_per_token
    conv = sum((w - width + 1) * n * m.char_dim * width * 2 for width, n in m.filters)
    f = m.n_filters
    highway = m.n_highway * f * 2 * f * 2
    proj = f * m.projection_dim * 2
    dirs = 1 if cfg.train.directions == "forward" else 2
    p, c = m.projection_dim, m.lstm_dim
    lstm = dirs * m.n_layers * (p * 4 * c * 2 + p * 4 * c * 2 + c * p * 2)
    classes = vocab if cfg.softmax.kind != "sampled" else min(vocab, cfg.softmax.n_samples + 1)
    softmax = dirs * classes * p * 2
    return {"cnn": conv, "highway": highway, "projection": proj, "lstm": lstm, "softmax": softmax}


# ---------------------------------------------------------------- data


def synthetic_vocab(v: int, rng: np.random.Generator) -> list[str]:
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    words = ["<S>", "</S>", "<unk>"]
    for i in range(3, v):
        n = int(np.clip(rng.poisson(2 + math.log(i + 1) / 1.5), 1, 14))
        words.append(
            ("\u2581" if rng.random() < 0.7 else "") + "".join(rng.choice(letters, n)) + str(i)
        )
    return words


def make_batches(cfg: TrainConfig, vocab: int, n: int, rng: np.random.Generator) -> list[Batch]:
    d = cfg.data
    ranks = np.arange(1, vocab - 2)
    p = 1.0 / ranks**1.05
    p /= p.sum()
    out = []
    for _ in range(n):
        length = int(np.clip(rng.gamma(3.0, 9.0), 3, d.max_tokens - 2))
        t = padded_len(length + 2, d.pad_multiple)
        b = max(1, d.tokens_per_batch // t)
        lo = max(1, t - d.pad_multiple - 1)
        lens = rng.integers(lo, min(t - 2, d.max_tokens - 2) + 1, size=b)
        ids = np.full((b, t), 1, dtype=np.int64)
        for r, n_tok in enumerate(lens):
            ids[r, 0] = 0
            ids[r, 1 : n_tok + 1] = 3 + rng.choice(len(p), size=n_tok, p=p)
            ids[r, n_tok + 1] = 1
        lengths = torch.from_numpy(lens + 2)
        uniq, inverse = np.unique(ids, return_inverse=True)
        out.append(
            Batch(
                ids=torch.from_numpy(ids),
                targets=torch.from_numpy(ids),
                lengths=lengths,
                uniq=torch.from_numpy(uniq),
                inverse=torch.from_numpy(inverse.reshape(b, t)),
                n_tokens=int(lengths.sum()),
            )
        )
    return out


def char_table(words: list[str], w: int) -> torch.Tensor:
    t = np.stack([token_ids(x, w) for x in words]).astype(np.int32)
    t[0], t[1] = bos_ids(w), eos_ids(w)
    return torch.from_numpy(t)


# ---------------------------------------------------------------- the plain model


class PlainLM(nn.Module):
    """Eager fp32, no tricks: CNN on every position, LSTMCell-style loop (input matmul per step)."""

    def __init__(self, lm: LanguageModel) -> None:
        super().__init__()
        self.lm = lm  # same parameters and softmax; only the computation differs

    def cell_layer(self, layer, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = x.new_zeros(b, layer.proj_dim)
        cell = x.new_zeros(b, layer.cell_dim)
        outs = []
        for s in range(t):  # the one reference's cell (tests/support/reference.py)
            h, cell = reference.lstmp_cell(x[:, s], h, cell, layer, x.dtype)
            outs.append(h)
        return torch.stack(outs, 1)

    def forward(self, batch: Batch) -> torch.Tensor:
        lm = self.lm
        b, t = batch.ids.shape
        chars = lm.char_table[batch.ids.reshape(-1)].long()
        tokens = lm.bilm.token_encoder(chars).reshape(b, t, -1)
        saved = lm.loss_fn
        # the same graph around the cell, the plain cell inside, the eager softmax
        lm.hidden, lm.loss_fn = self.hidden, lm.softmax.loss
        try:
            return lm.core(tokens, batch.lengths, batch.targets, lm.softmax.sample())[0]
        finally:
            del lm.hidden
            lm.loss_fn = saved

    def _direction(self, layers, x: torch.Tensor) -> torch.Tensor:
        drop, residual = self.lm.bilm.dropout, self.lm.bilm.cfg.residual
        for i, layer in enumerate(layers):
            y = self.cell_layer(layer, drop(x))
            x = y + x if (residual and i > 0) else y
        return drop(x)

    def hidden(self, tokens: torch.Tensor, lengths: torch.Tensor):
        bilm = self.lm.bilm
        tokens = tokens * length_mask(lengths, tokens.shape[1]).unsqueeze(-1).to(tokens.dtype)
        h_f = self._direction(bilm.forward_layers, tokens)
        if self.lm.directions == "forward":
            return h_f, None
        h_b = self._direction(bilm.backward_layers, reverse_padded(tokens, lengths))
        return h_f, reverse_padded(h_b, lengths)


# ---------------------------------------------------------------- timing


def train_step(fn, opt, model, batch, device, precision) -> None:
    with autocast(device, precision):
        loss = fn(batch)
    if isinstance(loss, tuple):
        loss = loss[0]
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 10.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--config", default=str(Path(__file__).resolve().parents[1] / "configs" / "default.yaml")
    )
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per side")
    ap.add_argument(
        "--warmup", type=int, default=3, help="untimed steps per side (and per compiled shape)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print("\n".join(fair.header(a.threads)))
    set_threads(a.threads)
    cfg = load_config(a.config, a.overrides)
    device = torch.device("cpu")
    rng = np.random.default_rng(a.seed)
    torch.manual_seed(a.seed)
    words = synthetic_vocab(a.vocab, rng)
    lm = LanguageModel(
        cfg.model,
        cfg.softmax,
        a.vocab,
        char_table(words, cfg.model.max_chars_per_token),
        cfg.train.directions,
    )
    lm.train()
    plain = PlainLM(lm)
    opt = make_optimizer(lm.parameters(), cfg.optim)
    precision = resolve_precision(device, cfg.train.precision)
    if cfg.train.compile:
        torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
        lm.encode_fn = torch.compile(lm.bilm.token_encoder.forward)
        lm.bilm.use_compiled_steps()
        lm.loss_fn = torch.compile(lm.softmax.loss)
    batches = make_batches(cfg, a.vocab, a.steps, rng)
    shapes = sorted({tuple(b.ids.shape) for b in batches})
    warm = make_batches(cfg, a.vocab, 0, rng)
    # warm-up: every shape the timed batches use, so compile time is not counted
    for shape in shapes:
        for b in batches:
            if tuple(b.ids.shape) == shape:
                warm.append(b)
                break
    t0 = time.time()
    for b in warm + batches[: a.warmup]:
        train_step(lm, opt, lm, b, device, precision)
    warm_s = time.time() - t0
    for b in batches[: a.warmup]:
        train_step(plain, opt, lm, b, device, "fp32")
    times = {"trainer": [], "plain": []}
    toks = {"trainer": 0, "plain": 0}
    for b in batches:  # alternate so that noise from other processes hits both sides alike
        for name, fn, prec in (("trainer", lm, precision), ("plain", plain, "fp32")):
            t = time.perf_counter()
            train_step(fn, opt, lm, b, device, prec)
            times[name].append(time.perf_counter() - t)
            toks[name] += b.n_tokens
    fl = flops_per_token(cfg, a.vocab)
    per_tok = sum(fl.values())
    m = cfg.model
    print(
        f"model: {sum(p.numel() for p in lm.parameters()) / 1e6:.2f}M params; CNN {m.n_filters} filters, "
        f"{m.n_highway} highway; LSTM {m.lstm_dim}/{m.projection_dim} x {m.n_layers}; "
        f"softmax {cfg.softmax.kind} (V={a.vocab}, n={cfg.softmax.n_samples}); {cfg.optim.name}"
    )
    print(
        f"batches: {len(batches)} timed, shapes {shapes}; threads {a.threads}; warm-up/compile {warm_s:.0f} s"
    )
    mean_uniq = statistics.mean(len(b.uniq) / b.ids.numel() for b in batches)
    print(f"distinct tokens per batch position: {mean_uniq:.2f}")
    print(
        "forward MFLOP/token: "
        + ", ".join(f"{k} {v / 1e6:.2f}" for k, v in fl.items())
        + f"; total {per_tok / 1e6:.2f}"
    )
    res = {}
    for name in ("plain", "trainer"):
        total = sum(times[name])
        tps = toks[name] / total
        med = statistics.median(times[name])
        res[name] = tps
        label = (
            "plain (eager fp32, per-step input matmul, CNN on every position)"
            if name == "plain"
            else (
                f"trainer ({precision}{' + compile' if cfg.train.compile else ''}, distinct-token CNN, hoisted input matmul)"
            )
        )
        print(
            f"{label}: {tps:,.0f} tokens/s (median step {med * 1e3:.0f} ms), effective {3 * per_tok * tps / 1e9:.1f} GFLOP/s"
        )
    # what the trainer really computes: the token encoder once per distinct token
    encoder = fl["cnn"] + fl["highway"] + fl["projection"]
    actual = per_tok - (1 - mean_uniq) * encoder
    print(
        f"trainer actual (encoder FLOPs counted per distinct token, {actual / 1e6:.2f} MFLOP/token): "
        f"{3 * actual * res['trainer'] / 1e9:.1f} GFLOP/s"
    )
    print(f"speed-up trainer / plain: {res['trainer'] / res['plain']:.2f}x")


if __name__ == "__main__":
    main()
