"""One finetune from checked data to results: build the task, train the arms, pick the mix."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from elmo_pretrain.finetune.data import Vocab, elmo_layers, encode
from elmo_pretrain.finetune.options import FinetuneConfig
from elmo_pretrain.finetune.train import ArmResult, Log, Task, increase, is_bio, run_arms, task_spec
from elmo_pretrain.probe.tasks import SPLITS, labels_of
from elmo_service.artifact import Artifact
from elmo_service.scalar_mix import MixSpec


@dataclass
class Finetuned:
    task: Task
    results: list[ArmResult]
    spec: MixSpec | None  # the ELMo + baseline arm's best mix
    adaptation: dict | None = None  # finetune --adapt: what the adaptation measured
    adapted_spec: MixSpec | None = None  # the adapted arm's best mix (for the adapted model)

    def arm(self, name: str) -> ArmResult | None:
        return next((r for r in self.results if r.arm == name), None)

    def increase_of(self, name: str) -> dict[str, float] | None:
        """Arm ``name`` against the baseline (absolute, relative error reduction)."""
        base, other = self.arm("baseline"), self.arm(name)
        return increase(base, other) if base and other else None

    @property
    def increase(self) -> dict[str, float] | None:
        return self.increase_of("elmo+baseline")


def choose_metric(metric: str, task_name: str, tokens: bool, classes: list) -> str:
    if metric != "auto":
        return metric
    if tokens and (task_name == "ner" or is_bio(list(map(str, classes)))):
        return "span-f1"
    return "accuracy"


def build_task(
    art: Artifact,
    data: dict[str, list[tuple]],
    classes: list,
    tokens: bool,
    metric: str,
    crf: bool,
    cfg: FinetuneConfig,
    cache_dir: Path,
    log: Log = print,
) -> Task:
    """``data[split]``: (words, tags) or (text, label) rows, already checked (probe.tasks).

    A dev/test label never seen in training gets an id past ``classes``: no network
    predicts it, so each token (or sentence) carrying one is scored wrong."""
    labels_in = {s: labels_of("tokens" if tokens else "sentences", data[s]) for s in SPLITS}
    trained = set(labels_in["train"])
    unseen = sorted({y for s in ("dev", "test") for y in labels_in[s]} - trained, key=str)
    counts = {s: (sum(y in unseen for y in labels_in[s]), len(labels_in[s])) for s in SPLITS[1:]}
    names = list(classes) + [u for u in unseen if u not in classes]
    index = {c: i for i, c in enumerate(names)}
    if tokens:
        sents = {s: [list(w) for w, _ in data[s]] for s in SPLITS}
        labels = {s: [[index[t] for t in tags] for _, tags in data[s]] for s in SPLITS}
    else:
        sents = {s: [text.split() for text, _ in data[s]] for s in SPLITS}
        labels = {s: [index[y] for _, y in data[s]] for s in SPLITS}
    layers = elmo_layers(art, sents, cache_dir, cfg.precision, cfg.embed_batch_tokens, log)
    vocab = Vocab.build(sents["train"], cfg.min_word_count)
    splits = {s: encode(sents[s], labels[s], vocab, cfg.max_word_chars, layers[s]) for s in SPLITS}
    return Task(
        tokens=tokens,
        classes=list(classes),
        metric=metric,
        crf=crf,
        vocab=vocab,
        splits=splits,
        n_layers=layers["train"].shape[1],
        elmo_dim=layers["train"].shape[2],
        unseen=unseen,
        unseen_counts=counts,
    )


def finetune(
    art: Artifact,
    task: Task,
    cfg: FinetuneConfig,
    arms: list[str],
    seeds: int | list[int],
    name: str,
    log: Log = print,
    adapted: tuple[Artifact, Task, dict] | None = None,
) -> Finetuned:
    """Train ``arms`` over ``seeds``. ``adapted``: the adapted model, the task over its
    layers and the adaptation's record, for the ``adapted+baseline`` arm."""
    seeds = list(range(seeds)) if isinstance(seeds, int) else seeds
    tasks = dict.fromkeys(arms, task)
    if "adapted+baseline" in arms:
        if adapted is None:
            raise ValueError("the adapted+baseline arm needs the adapted model and task")
        tasks["adapted+baseline"] = adapted[1]
    results = run_arms(arms, tasks, cfg, seeds, log)
    ft = Finetuned(task, results, None, adaptation=adapted[2] if adapted else None)
    elmo = ft.arm("elmo+baseline")
    if elmo is not None:
        ft.spec = task_spec(elmo, name, art.version, task, cfg)
    if (arm := ft.arm("adapted+baseline")) is not None:
        ft.adapted_spec = task_spec(arm, name, adapted[0].version, adapted[1], cfg)
    return ft
