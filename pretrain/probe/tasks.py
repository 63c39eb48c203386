"""The probe's labelled data: built-in tasks (fetched) and a user's own JSONL splits.

Every line is checked before any embedding. For the probe, dev/test may only use
classes seen in training; ``finetune`` takes them (``allow_unseen``): a label never
seen in training is a wrong prediction there, and its report counts them.
"""

from __future__ import annotations

import json
from pathlib import Path

from elmo_service.errors import InputError

# task -> (file prefix, kind). Built-in tasks read data/<prefix>.<split>.jsonl
# (fetched with --fetch); a user's own task reads <split>.jsonl from --data.
TASKS = {
    "pos": ("brown", "tokens"),
    "ner": ("wnut16", "tokens"),
    "polarity": ("polarity", "sentences"),
    "tagging": (None, "tokens"),
    "classification": (None, "sentences"),
}
BUILT_IN = tuple(t for t, (prefix, _) in TASKS.items() if prefix)
SPLITS = ("train", "dev", "test")
ROW_FORMAT = {
    "tokens": '{"words": ["The", "dog"], "tags": ["DET", "NOUN"]}',
    "sentences": '{"text": "A fine film .", "label": "positive"}',
}


def task_file(task: str) -> str | None:
    return TASKS[task][0]


def task_kind(task: str) -> str:
    """``tokens`` (a tag per word) or ``sentences`` (a label per sentence)."""
    return TASKS[task][1]


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


def load_task_data(task: str, data_dir: Path, fetch: bool) -> dict[str, list[tuple]]:
    """The three splits of a built-in (fetched if asked) or user task."""
    files = split_files(task, data_dir)
    missing = [p.name for p in files.values() if not p.is_file()]
    if missing and task in BUILT_IN:
        if not fetch:
            raise InputError(
                f"{data_dir} lacks {task} data; add --fetch to download it", field="data"
            )
        if task == "pos":
            from elmo_pretrain.sources.brown import write_brown

            write_brown(data_dir)
        elif task == "ner":
            from elmo_pretrain.sources.wnut import write_wnut

            write_wnut(data_dir)
        else:
            from elmo_pretrain.sources.polarity import write_polarity

            write_polarity(data_dir)
    elif missing:
        kind = task_kind(task)
        raise InputError(
            f"{data_dir} lacks {', '.join(missing)}: a {task} task reads train.jsonl, "
            f"dev.jsonl and test.jsonl there, each line {ROW_FORMAT[kind]}",
            field="data",
        )
    return {s: read_examples(p, task_kind(task)) for s, p in files.items()}


def load_for_command(
    task: str, data: str | None, fetch: bool, max_train: int = 0, allow_unseen: bool = False
) -> tuple[dict[str, list[tuple]], list]:
    """A command's data (``--data``, default ``data/<task>``; ``--fetch``; ``max_train``
    training examples spread evenly over the file, 0 = all) and its classes."""
    data_dir = Path(data or f"data/{task_file(task) or task}")
    splits = load_task_data(task, data_dir, fetch)
    if max_train:
        splits["train"] = spread(splits["train"], max_train)
    return splits, label_set(task, splits, split_files(task, data_dir), allow_unseen)


def spread(rows: list, n: int) -> list:
    """``n`` rows evenly spaced over ``rows``, in order (all when ``n >= len(rows)``). Not the
    first ``n``: a file sorted by label (the polarity data: every positive first) or by genre
    (Brown) would give a slice of one class or one genre."""
    if n >= len(rows):
        return rows
    return [rows[i * len(rows) // n] for i in range(n)]


def split_files(task: str, data_dir: Path) -> dict[str, Path]:
    return {s: split_path(task, data_dir, s) for s in SPLITS}


def labels_of(kind: str, rows: list[tuple]) -> list:
    """Every row's labels, in order: a tag per word, or a label per sentence."""
    return [t for _, tags in rows for t in tags] if kind == "tokens" else [y for _, y in rows]


def label_set(
    task: str,
    data: dict[str, list[tuple]],
    files: dict[str, Path] | None = None,
    allow_unseen: bool = False,
) -> list:
    """The classes, in index order; dev/test may only use classes seen in training,
    unless ``allow_unseen`` (user tasks: those are not among the classes). A built-in
    task's fixed classes are always enforced.

    With ``files`` (split -> path), an unknown class is reported at its first line.
    """
    kind = task_kind(task)
    if task == "pos":
        from elmo_pretrain.sources.brown import UNIVERSAL_TAGS

        classes: list = list(UNIVERSAL_TAGS)
    elif task == "polarity":
        classes = [0, 1]
    elif kind == "tokens":
        classes = sorted({t for _, tags in data["train"] for t in tags})
    else:
        classes = sorted({y for _, y in data["train"]}, key=lambda y: (isinstance(y, str), y))
    if len(classes) < 2:
        where = f"{files['train']}: " if files else ""
        raise InputError(f"{where}the training data has fewer than 2 classes", field="data")
    known = set(classes)
    fixed = task in ("pos", "polarity")
    for split in SPLITS:
        seen = set(labels_of(kind, data[split]))
        if seen - known and not (allow_unseen and not fixed):
            what = "tags" if kind == "tokens" else "classes"
            where = _first_line_with(files[split], kind, known) if files else split
            raise InputError(
                f"{where}: {what} {sorted(map(str, seen - known))} are not in the "
                f"{'task' if fixed else 'training data'}'s {what} "
                f"{list(map(str, classes))}",
                field="data",
            )
    return classes


def _first_line_with(path: Path, kind: str, known: set) -> str:
    """``path:line`` of the first example using a class outside ``known`` (already parsed once)."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            r = json.loads(line)
            used = {str(t) for t in r["tags"]} if kind == "tokens" else {r["label"]}
            if used - known:
                return f"{path}:{n}"
    return str(path)
