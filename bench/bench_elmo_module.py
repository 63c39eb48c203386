"""One training step of a tagger on top of ``Elmo``: this project's drop-in vs AllenNLP 2.10.

    PYTHONPATH=. .venv/bin/python bench/bench_elmo_module.py [--shape small original] [--rounds 3] [--threads 2]

The tagger is the tutorial's: ``Elmo`` (one representation, dropout 0.5) -> a linear
layer over the tags -> masked cross-entropy, Adam; one step = zero_grad, forward,
loss, backward, optimizer step, on a batch of 32 sentences (word lengths drawn like
English prose, 3-45 words, a Zipf vocabulary). Sides, each built from the same
``options.json`` + ``weights.hdf5`` (random weights in bilm-tf's format,
``tests/support/bilm_fixtures.py``), alternating step by step so that machine noise
hits both alike:

* ``frozen``: ``requires_grad=False`` (only the mixes and the tagger learn);
* ``fine-tuned``: ``requires_grad=True`` (every biLM weight learns).

Shapes: AllenNLP's "small" (2048 filters, 1 highway, LSTM 1024 -> 128, 2 layers) and
the original ELMo (2048 filters, 2 highways, LSTM 4096 -> 512, 2 layers). Reports the
median step time of each side and the ratio. Needs AllenNLP
(``tests/install_parity_deps.sh``). The machine may be shared: compare the two sides
of one run; the first lines name the CPU, its ISA, torch and the load.

Fair by construction (``bench/fair.py``): AllenNLP's tagger runs in a process of its own
with its defaults (no OpenMP / MKL variable of ours, ``torch.set_num_threads(n)``), ours
in another as the README says (``configure_process("library", n)``); both build the
same batches from the same seeds, and take turns step by step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import fair  # noqa: E402
from elmo_service.bilm.config import ELMO_FILTERS  # noqa: E402
from tests.support.bilm_fixtures import write_bilm  # noqa: E402

SHAPES = {
    "small": {"lstm_dim": 1024, "projection_dim": 128, "n_highway": 1},
    "original": {"lstm_dim": 4096, "projection_dim": 512, "n_highway": 2},
}
N_TAGS = 17
BATCH = 32


def sentences(rng: np.random.Generator, n: int) -> list[list[str]]:
    """``n`` sentences of 3-45 words from a Zipf vocabulary of word-like strings."""
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    vocab = ["".join(rng.choice(letters, size=int(rng.integers(1, 11)))) for _ in range(5000)]
    out = []
    for _ in range(n):
        length = int(np.clip(rng.gamma(4.0, 6.0), 3, 45))
        out.append([vocab[min(int(rng.zipf(1.3)) - 1, len(vocab) - 1)] for _ in range(length)])
    return out


class Tagger(nn.Module):
    def __init__(self, elmo: nn.Module) -> None:
        super().__init__()
        self.elmo = elmo
        self.out = nn.Linear(elmo.get_output_dim(), N_TAGS)

    def loss(self, char_ids: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        out = self.elmo(char_ids)
        logits = self.out(out["elmo_representations"][0])
        mask = out["mask"]
        return nn.functional.cross_entropy(logits[mask], tags[mask])


def step(model: Tagger, opt: torch.optim.Optimizer, ids: torch.Tensor, tags: torch.Tensor) -> float:
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    model.loss(ids, tags).backward()
    opt.step()
    return time.perf_counter() - t0


class ModuleSide:
    """One side's tagger in its own process (``bench/fair.py``): ``side`` "ours" (our
    ``Elmo``) or "allennlp" (AllenNLP's, imported only in its process)."""

    def __init__(self, side: str, options: str, weights: str, fine_tune: bool) -> None:
        torch.manual_seed(0)
        if side == "ours":
            from elmo_service.elmo import Elmo, batch_to_ids

            elmo = Elmo(options, weights, 1, requires_grad=fine_tune)
        else:
            from tests.support.allennlp_shim import import_allennlp_elmo

            module = import_allennlp_elmo()
            elmo, batch_to_ids = (
                module.Elmo(options, weights, 1, requires_grad=fine_tune),
                (module.batch_to_ids),
            )
        self.batch_to_ids = batch_to_ids
        self.model = Tagger(elmo).train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.Adam(params, lr=1e-4)

    def step(self, r: int) -> float:
        """One training step on batch ``r`` (the same sentences and tags on both sides)."""
        rng = np.random.default_rng(1000 + r)
        ids = self.batch_to_ids(sentences(rng, BATCH))
        tags = torch.from_numpy(rng.integers(0, N_TAGS, size=tuple(ids.shape[:2])))
        return step(self.model, self.opt, ids, tags)


def run_shape(name: str, rounds: int, warmup: int, threads: int) -> list[tuple[str, float, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        options, weights = write_bilm(
            tmp,
            n_characters=262,
            filters=[list(f) for f in ELMO_FILTERS],
            char_dim=16,
            **SHAPES[name],
        )
        files = dict(options=str(options), weights=str(weights))
        rows = []
        for fine_tune in (False, True):
            factory = "bench.bench_elmo_module:ModuleSide"
            with fair.Side("ours", factory, threads, side="ours", fine_tune=fine_tune,
                           **files) as ours, \
                    fair.Side("rival", factory, threads, side="allennlp", fine_tune=fine_tune,
                              **files) as theirs:  # fmt: skip
                sides = {"ours": ours, "allennlp": theirs}
                times: dict[str, list[float]] = {s: [] for s in sides}
                for r in range(warmup + rounds):
                    for s in list(sides) if r % 2 == 0 else list(sides)[::-1]:
                        time.sleep(fair.PAUSE_S)
                        t = sides[s].call("step", r=r)
                        if r >= warmup:
                            times[s].append(t)
            ours_t, theirs_t = (statistics.median(times[s]) for s in ("ours", "allennlp"))
            kind = "fine-tuned" if fine_tune else "frozen"
            rows.append((f"{name} {kind}", ours_t, theirs_t))
            print(
                f"{name:8s} {kind:10s} ours {ours_t * 1e3:8.1f} ms  allennlp "
                f"{theirs_t * 1e3:8.1f} ms  ratio {theirs_t / ours_t:5.2f}x",
                flush=True,
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    for line in fair.header(args.threads):
        print(line)
    print(f"batch {BATCH}; each side in its own process, taking turns step by step")
    for name in args.shape:
        run_shape(name, args.rounds, args.warmup, args.threads)
    print(fair.footer())


if __name__ == "__main__":
    main()
