"""Train the arms (baseline, ELMo + baseline, linear probe) over several seeds and compare them.

Each run trains with Adam, clips the gradient norm, evaluates on dev after
every epoch, stops after ``patience`` epochs without a better dev score (or
``epochs``), and keeps the best dev epoch's weights for the test score. The
stored task mix is the ELMo + baseline run with the best dev score.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from elmo_pretrain.finetune.data import Split, Vocab, batches, make_batch
from elmo_pretrain.finetune.network import TaskNetwork
from elmo_pretrain.finetune.options import FinetuneConfig
from elmo_service.scalar_mix import MixSpec

Log = Callable[[str], None]

METRIC_NAMES = {"accuracy": "accuracy", "span-f1": "span F1 (exact BIO spans)"}
# a report row -> the network it trains: the adapted row is ELMo + baseline over the adapted biLM
NETWORK_OF = {"adapted+baseline": "elmo+baseline"}


def pct(x: float, std: float | None = None) -> str:
    """A score (a fraction) as a percentage, always with its sign: ``40.12 %``,
    ``40.12 ± 1.27 %`` (a bare ``0.68`` reads as a fraction)."""
    return f"{100 * x:.2f}" + ("" if std is None else f" ± {100 * std:.2f}") + " %"


def spans(tags: Sequence[str]) -> set[tuple[int, int, str]]:
    """Exact BIO spans ``(start, end, type)``, as conlleval reads them: an ``I-X`` that
    does not continue an ``X`` span starts one."""
    out, start, kind = set(), None, None
    for i, t in enumerate([*tags, "O"]):
        prefix, _, typ = t.partition("-")
        inside = prefix == "I" and kind == typ
        if start is not None and not inside:
            out.add((start, i, kind))
            start, kind = None, None
        if prefix in ("B", "I") and not inside:
            start, kind = i, typ
    return out


def span_f1(gold: Sequence[Sequence[str]], pred: Sequence[Sequence[str]]) -> float:
    tp = n_gold = n_pred = 0
    for g, p in zip(gold, pred, strict=True):
        gs, ps = spans(g), spans(p)
        tp, n_gold, n_pred = tp + len(gs & ps), n_gold + len(gs), n_pred + len(ps)
    return 2 * tp / (n_gold + n_pred) if n_gold + n_pred else 1.0


def is_bio(tags: Sequence[str]) -> bool:
    return all(t == "O" or (t[:2] in ("B-", "I-") and len(t) > 2) for t in tags)


@dataclass
class Task:
    """What every run of one task shares."""

    tokens: bool  # a tag per word (else a label per sentence)
    classes: list  # what the networks predict; label ids past these are never predicted
    metric: str  # "accuracy" | "span-f1"
    crf: bool
    vocab: Vocab
    splits: dict[str, Split]
    n_layers: int
    elmo_dim: int
    # dev/test labels never seen in training, and per split (units carrying one, units)
    unseen: list = field(default_factory=list)
    unseen_counts: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def names(self) -> list:
        """Label id -> label: the classes, then unseen labels outside them (always wrong)."""
        return self.classes + [u for u in self.unseen if u not in self.classes]


@dataclass
class Run:
    arm: str
    seed: int
    dev: float
    test: float
    epochs: int
    seconds: float
    network: TaskNetwork


# sentences per evaluation batch, sorted by length: the batches evaluation always had (64 and
# 128 gave the same POS predictions and were ~20 % faster, but the same bits are not promised)
EVAL_BATCH = 256


@torch.inference_mode()
def evaluate(net: TaskNetwork, task: Task, split: Split, batch_size: int = EVAL_BATCH) -> float:
    """The network's score on ``split`` (dropout off). The character CNN runs once per
    distinct spelling of the split, not once per word of every batch; the scores are the
    per-word evaluation's (tests/pretrain/test_finetune.py keeps it and holds them equal)."""
    net.eval()
    features = None
    if getattr(net, "tokens_in", None) is not None and split.char_table is not None:
        features = net.tokens_in.chars(torch.from_numpy(split.char_table).unsqueeze(0))[0]
    gold, pred = [], []
    for idx in batches(split, batch_size, None):
        batch = make_batch(split, idx, task.tokens, chars=features is None)
        batch.char_features = features
        pred += net.predict(batch)
        gold += [split.labels[i].tolist() if task.tokens else int(split.labels[i][0]) for i in idx]
    return score(task, gold, pred)


def score(task: Task, gold: list, pred: list) -> float:
    """Accuracy or span F1 of per-sentence predictions (tag id lists, or class ids)."""
    if not task.tokens:
        return float(np.mean([g == p for g, p in zip(gold, pred, strict=True)]))
    if task.metric == "span-f1":
        names = task.names
        return span_f1([[names[t] for t in g] for g in gold], [[names[t] for t in p] for p in pred])
    right = sum(
        int(np.sum(np.asarray(g) == np.asarray(p))) for g, p in zip(gold, pred, strict=True)
    )
    return right / max(sum(len(g) for g in gold), 1)


def train_run(arm: str, task: Task, cfg: FinetuneConfig, seed: int, log: Log = print) -> Run:
    """One network, trained with early stopping on dev; scored on test at its best dev epoch."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    net = TaskNetwork(
        NETWORK_OF.get(arm, arm),
        task.tokens,
        len(task.classes),
        len(task.vocab.words) + 2,
        len(task.vocab.chars) + 2,
        task.n_layers,
        task.elmo_dim,
        cfg,
        crf=task.crf,
    )
    opt = torch.optim.Adam(net.parameters(), lr=cfg.lr)
    train, dev = task.splits["train"], task.splits["dev"]
    # early stopping reads a slice of a big dev split (POS: 6k sentences); the run's dev
    # score is the whole split's, at the chosen epoch
    watch = dev.head(cfg.max_dev_sentences) if cfg.max_dev_sentences else dev
    best, best_state, best_epoch, epoch = -1.0, None, 0, 0
    t0 = time.monotonic()
    for epoch in range(1, cfg.epochs + 1):
        net.train()
        total, steps = 0.0, 0
        for idx in batches(train, cfg.batch_size, rng):
            batch = make_batch(train, idx, task.tokens)
            loss = net.loss(net(batch), batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), cfg.clip_norm)
            opt.step()
            total, steps = total + float(loss.detach()), steps + 1
        if not np.isfinite(total):
            raise FloatingPointError(f"{arm} seed {seed}: the loss became {total} in epoch {epoch}")
        score = evaluate(net, task, watch)
        if score > best:
            best, best_epoch = score, epoch
            best_state = {k: v.detach().clone() for k, v in net.state_dict().items()}
        log(
            f"[finetune] {arm:16s} seed {seed} epoch {epoch:2d}: loss {total / max(steps, 1):.4f} "
            f"dev {pct(score)} (best {pct(best)} @{best_epoch}) "
            f"{time.monotonic() - t0:.0f}s"
        )
        if best > 0 and epoch - best_epoch >= cfg.patience:
            break
    net.load_state_dict(best_state)
    dev_score = best if watch is dev else evaluate(net, task, dev)
    test = evaluate(net, task, task.splits["test"])
    seconds = time.monotonic() - t0
    log(
        f"[finetune] {arm:16s} seed {seed} done: dev {pct(dev_score)} test {pct(test)} "
        f"(best epoch {best_epoch} of {epoch}, {seconds:.0f}s)"
    )
    return Run(arm, seed, dev_score, test, epoch, seconds, net)


@dataclass
class ArmResult:
    """One arm over its seeds."""

    arm: str
    runs: list[Run]
    extra: dict = field(default_factory=dict)

    @property
    def dev(self) -> float:
        return statistics.fmean(r.dev for r in self.runs)

    @property
    def test(self) -> float:
        return statistics.fmean(r.test for r in self.runs)

    @property
    def std(self) -> float:
        """Sample standard deviation of the test score over seeds (0 for one seed)."""
        return statistics.stdev(r.test for r in self.runs) if len(self.runs) > 1 else 0.0

    @property
    def dev_std(self) -> float:
        return statistics.stdev(r.dev for r in self.runs) if len(self.runs) > 1 else 0.0

    def best(self) -> Run:
        return max(self.runs, key=lambda r: (r.dev, -r.seed))


# The task networks are small (a 64-wide biLSTM, batches of 16): on two threads each op's
# OpenMP hand-off costs more than it saves, and once another process shares the cores the
# spinning collapses: a POS arm took 30-43 s on 2 threads against 5-6 s on 1 (same scores;
# docs/finetune.md). The biLM's embedding, before, keeps the command's threads.
TRAIN_THREADS = 1


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` inside, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_arms(
    arms: Sequence[str],
    task: Task | dict[str, Task],
    cfg: FinetuneConfig,
    seeds: Sequence[int],
    log: Log = print,
) -> list[ArmResult]:
    """``task``: one for every arm, or arm -> its task (the adapted arm's layers differ)."""
    tasks = task if isinstance(task, dict) else dict.fromkeys(arms, task)
    # seed by seed, every arm: an interrupted benchmark still has paired runs in its log
    runs: dict[str, list[Run]] = {arm: [] for arm in arms}
    with torch_threads(TRAIN_THREADS):
        for seed in seeds:
            for arm in arms:
                runs[arm].append(train_run(arm, tasks[arm], cfg, seed, log))
    out = []
    for arm in arms:
        r = ArmResult(arm, runs[arm])
        log(
            f"[finetune] {arm}: dev {pct(r.dev, r.dev_std)}, "
            f"test {pct(r.test, r.std)} over {len(seeds)} seed(s)"
        )
        out.append(r)
    return out


def increase(baseline: ArmResult, elmo: ArmResult) -> dict[str, float]:
    """The paper's two figures: absolute increase and relative error reduction (test means)."""
    err = 1.0 - baseline.test
    return {
        "absolute": elmo.test - baseline.test,
        "relative_error_reduction": (elmo.test - baseline.test) / err if err > 0 else 0.0,
    }


def task_spec(
    result: ArmResult, name: str, version: str, task: Task, cfg: FinetuneConfig
) -> MixSpec:
    """The best ELMo + baseline run's mix, as a task to store or register."""
    run = result.best()
    spec = run.network.stored_mix.to_spec()
    spec.meta = {
        "task": name,
        "model_version": version,
        "metric": task.metric,
        "dev_score": round(run.dev, 4),
        "test_score": round(run.test, 4),
        "seed": run.seed,
        "elmo_at": cfg.elmo_at if cfg.elmo_at != "both" else "both (the input mix)",
        "labels": list(task.classes),
        "learned_by": "elmo-pretrain finetune",
    }
    return spec
