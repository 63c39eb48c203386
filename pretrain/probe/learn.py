"""Learn a task's scalar mix on frozen layers: the mix + linear probe, and the two task shapes.

ELMo's recipe (Peters et al. 2018, §3.3): freeze the biLM, learn the task's
softmax-normalised layer weights ``s`` and scale ``γ`` together with the
downstream model. Here the downstream model is linear, so the numbers are a
probe of what each layer encodes (Liu et al. 2019). One run reports test
accuracy for layer 0 alone (context-free), each LSTM layer alone, the standard
mix, the per-direction mix, and the same-shaped model with random weights,
and returns the learned standard mix as a :class:`MixSpec` ready to store as a task.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from elmo_pretrain.probe.features import (
    cached,
    fingerprint,
    pooled_features,
    weights_tag,
    word_features,
)
from elmo_pretrain.probe.options import ProbeConfig
from elmo_service.artifact import Artifact, load_artifact
from elmo_service.bilm.model import BiLM
from elmo_service.embedder import Embedder
from elmo_service.scalar_mix import MixSpec, ScalarMix

Log = Callable[[str], None]


@dataclass
class ProbeResult:
    name: str
    dev_acc: float
    test_acc: float
    mix: MixSpec | None = None
    extra: dict = field(default_factory=dict)


class MixProbe(nn.Module):
    """``[B, L+1, D]`` → logits ``[B, C]``: a scalar mix (or one fixed layer) + linear."""

    def __init__(self, n_layers: int, dim: int, n_classes: int, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.mix = None
        if mode in ("mix", "mix_per_direction"):
            self.mix = ScalarMix(n_layers, per_direction=mode == "mix_per_direction")
        self.layer = int(mode.split(":")[1]) if mode.startswith("layer:") else None
        self.linear = nn.Linear(dim, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x[:, self.layer] if self.mix is None else self.mix(x.transpose(0, 1))
        return self.linear(h)


def _batches(n: int, size: int, rng: np.random.Generator | None) -> list[np.ndarray]:
    order = rng.permutation(n) if rng is not None else np.arange(n)
    return [np.sort(order[i : i + size]) for i in range(0, n, size)]


@torch.no_grad()
def accuracy(model: MixProbe, x: np.ndarray, y: np.ndarray, batch: int = 8192) -> float:
    model.eval()
    correct = 0
    for idx in _batches(len(y), batch, None):
        logits = model(torch.from_numpy(np.asarray(x[idx], dtype=np.float32)))
        correct += int((logits.argmax(-1).numpy() == y[idx]).sum())
    return correct / max(len(y), 1)


def train_probe(
    mode: str,
    train: tuple[np.ndarray, np.ndarray],
    dev: tuple[np.ndarray, np.ndarray],
    test: tuple[np.ndarray, np.ndarray],
    n_classes: int,
    cfg: ProbeConfig,
) -> ProbeResult:
    """Train on ``train``, keep the epoch with the best dev accuracy, report test."""
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    (xtr, ytr), (xdv, ydv), (xte, yte) = train, dev, test
    model = MixProbe(xtr.shape[1], xtr.shape[2], n_classes, mode)
    # the mix scalars learn faster than the classifier needs; no decay on them
    groups = [{"params": model.linear.parameters(), "weight_decay": cfg.weight_decay}]
    if model.mix is not None:
        groups.append({"params": model.mix.parameters(), "weight_decay": 0.0, "lr": cfg.lr * 3})
    opt = torch.optim.AdamW(groups, lr=cfg.lr)
    best = (-1.0, None)
    for _ in range(cfg.epochs):
        model.train()
        for idx in _batches(len(ytr), cfg.batch_size, rng):
            x = torch.from_numpy(np.asarray(xtr[idx], dtype=np.float32))
            loss = nn.functional.cross_entropy(model(x), torch.from_numpy(ytr[idx]))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        dev_acc = accuracy(model, xdv, ydv)
        if dev_acc > best[0]:
            best = (dev_acc, {k: v.clone() for k, v in model.state_dict().items()})
    model.load_state_dict(best[1])
    mix = model.mix.to_spec() if model.mix is not None else None
    return ProbeResult(mode, best[0], accuracy(model, xte, yte), mix)


def random_artifact(art: Artifact, seed: int = 0) -> Artifact:
    """The same shape and tokenizer with untrained weights: the no-pretraining baseline."""
    torch.manual_seed(seed)
    model = BiLM(art.config).eval()
    return Artifact(art.path, art.config, art.tokenizer, model, f"random-{seed}-{art.version}")


MODES = ("layer", "mix", "mix_per_direction")


def _mode_names(n_layers: int) -> list[tuple[str, str]]:
    names = [
        (f"layer:{j}", "layer 0 (context-free)" if j == 0 else f"layer {j} alone")
        for j in range(n_layers)
    ]
    return [*names, ("mix", "scalar mix"), ("mix_per_direction", "per-direction mix")]


def run_probe(
    art: Artifact,
    features: Callable[[Embedder, Sequence], np.ndarray],
    inputs: dict[str, Sequence],
    labels: dict[str, np.ndarray],
    n_classes: int,
    cache_dir: Path,
    cfg: ProbeConfig,
    log: Log = print,
) -> list[ProbeResult]:
    """Every mode on the trained model, then the mix on a random-weight model.

    ``features(embedder, inputs[split])`` gives ``[N, L+1, D]``; it is cached
    per model version and split contents.
    """
    keys = {s: fingerprint(inputs[s]) for s in inputs}
    results = []
    for which, artifact in (("trained", art), ("random", random_artifact(art, cfg.seed))):
        # labelled data is not user traffic: no sentence is refused for its length
        emb = Embedder(
            artifact,
            device="cpu",
            precision=cfg.precision,
            weights=cfg.weights,
            batch_tokens=cfg.embed_batch_tokens,
            max_sentence_tokens=1_000_000,
        )
        t0 = time.time()
        feats = {
            split: cached(
                cache_dir
                / artifact.version
                / f"{split}-{keys[split]}-{emb.precision}{weights_tag(emb)}.npy",
                lambda s=split, e=emb: features(e, inputs[s]),
            )
            for split in ("train", "dev", "test")
        }
        log(f"[probe] {which} features ready in {time.time() - t0:.0f}s")
        modes = (
            _mode_names(artifact.config.n_output_layers)
            if which == "trained"
            else [("mix", "random weights, scalar mix")]
        )
        for mode, title in modes:
            r = train_probe(
                mode,
                *((feats[s], labels[s]) for s in ("train", "dev", "test")),
                n_classes=n_classes,
                cfg=cfg,
            )
            r.name = title
            r.extra = {"mode": mode, "weights": which}
            log(f"[probe] {title:32s} dev {r.dev_acc:.4f} test {r.test_acc:.4f}")
            results.append(r)
    return results


def best_mix(results: Sequence[ProbeResult]) -> ProbeResult:
    return next(
        r for r in results if r.extra.get("mode") == "mix" and r.extra.get("weights") == "trained"
    )


def pos_probe(
    model_dir: Path,
    data: dict[str, list[tuple[list[str], list[str]]]],
    tagset: Sequence[str],
    cache_dir: Path,
    cfg: ProbeConfig,
    log: Log = print,
    task: str = "pos",
) -> tuple[list[ProbeResult], MixSpec]:
    """A token-level task. ``data[split]`` = list of (words, tags), every tag in
    ``tagset``. Returns results and the learned task mix."""
    art = load_artifact(model_dir)
    tag_id = {t: i for i, t in enumerate(tagset)}
    labels = {
        s: np.array([tag_id[t] for _, tags in data[s] for t in tags], dtype=np.int64) for s in data
    }
    words = {s: [w for w, _ in data[s]] for s in data}
    results = run_probe(art, word_features, words, labels, len(tagset), cache_dir, cfg, log)
    return results, _task_spec(task, results, art, list(tagset))


def polarity_probe(
    model_dir: Path,
    data: dict[str, list[tuple[str, int]]],
    cache_dir: Path,
    cfg: ProbeConfig,
    log: Log = print,
    task: str = "polarity",
    classes: Sequence[object] = (0, 1),
) -> tuple[list[ProbeResult], MixSpec]:
    """A sentence-level task. ``data[split]`` = list of (sentence, class index
    into ``classes``)."""
    art = load_artifact(model_dir)
    labels = {s: np.array([y for _, y in data[s]], dtype=np.int64) for s in data}
    texts = {s: [t for t, _ in data[s]] for s in data}
    results = run_probe(art, pooled_features, texts, labels, len(classes), cache_dir, cfg, log)
    return results, _task_spec(task, results, art, list(classes))


def _task_spec(
    task: str, results: Sequence[ProbeResult], art: Artifact, labels: list[object]
) -> MixSpec:
    r = best_mix(results)
    spec = r.mix
    spec.meta = {
        "task": task,
        "model_version": art.version,
        "dev_accuracy": round(r.dev_acc, 4),
        "test_accuracy": round(r.test_acc, 4),
        "labels": labels,
        "learned_by": "elmo-pretrain probe",
    }
    return spec
