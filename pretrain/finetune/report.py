"""The finetune's results: the paper's table (markdown) and its rows as JSON, written atomically."""

from __future__ import annotations

from pathlib import Path

from elmo_pretrain.finetune.run import Finetuned
from elmo_pretrain.finetune.train import METRIC_NAMES, Task, pct
from elmo_service import atomic

TITLES = {
    "baseline": "baseline (word embedding + character CNN)",
    "elmo+baseline": "ELMo + baseline",
    "adapted+baseline": "ELMo adapted to the task's text (§3.4) + baseline",
    "probe": "linear probe (ELMo mix + linear)",
}


def rows(ft: Finetuned) -> list[dict]:
    """One row per arm: ``name``, ``dev``, ``test`` (means over seeds), ``std`` (of test),
    the per-seed scores; the ELMo + baseline and adapted rows also hold the increase over
    the baseline, the adapted row what the adaptation measured (``adaptation``)."""
    out = []
    for r in ft.results:
        row = {
            "name": r.arm,
            "metric": ft.task.metric,
            "dev": r.dev,
            "test": r.test,
            "std": r.std,
            "dev_std": r.dev_std,
            "seeds": [
                {
                    "seed": x.seed,
                    "dev": x.dev,
                    "test": x.test,
                    "epochs": x.epochs,
                    "seconds": round(x.seconds, 1),
                }
                for x in r.runs
            ],  # fmt: skip
        }
        inc = ft.increase_of(r.arm) if r.arm != "baseline" else None
        if r.arm in ("elmo+baseline", "adapted+baseline") and inc is not None:
            row["increase"] = inc["absolute"]
            row["relative_error_reduction"] = inc["relative_error_reduction"]
        if r.arm == "adapted+baseline" and ft.adaptation is not None:
            row["adaptation"] = ft.adaptation
        if ft.task.unseen:
            row["unseen_labels"] = unseen_summary(ft.task)
        out.append(row)
    return out


def unseen_summary(task: Task) -> dict:
    """The dev/test labels never seen in training and how many units carry one."""
    out: dict = {"labels": [str(u) for u in task.unseen]}
    for split, (n, total) in task.unseen_counts.items():
        out[split] = {"count": n, "of": total}
    return out


def unseen_line(task: Task) -> str | None:
    """One sentence on labels never seen in training (always predicted wrong), or None."""
    if not task.unseen:
        return None
    unit = "tokens" if task.tokens else "sentences"
    what = "tags" if task.tokens else "classes"
    parts = [
        f"{n:,} of {total:,} {split} {unit} ({pct(n / total if total else 0.0)})"
        for split, (n, total) in task.unseen_counts.items()
        if n
    ]
    return (
        f"{' and '.join(parts)} carry {what} never seen in training "
        f"({', '.join(map(str, task.unseen))}): no network predicts them, so they score as wrong."
    )


def results_table(ft: Finetuned) -> str:
    n = len(ft.results[0].runs)
    lines = [
        f"| network input | dev | test (mean ± std, {n} seed{'s' if n > 1 else ''}) |",
        "|---|---|---|",
    ]
    for r in ft.results:
        lines.append(f"| {TITLES[r.arm]} | {pct(r.dev)} | {pct(r.test, r.std)} |")
    for arm, what in (("elmo+baseline", "Increase"), ("adapted+baseline", "With adaptation")):
        inc = ft.increase_of(arm)
        if inc is not None:
            lines += [
                "",
                f"{what}: **{100 * inc['absolute']:+.2f} points** absolute, "
                f"**{100 * inc['relative_error_reduction']:.1f} %** relative error reduction.",
            ]
    if ft.adaptation is not None:
        lines += ["", adaptation_line(ft.adaptation)]
    unseen = unseen_line(ft.task)
    if unseen:
        lines += ["", unseen]
    return "\n".join(lines)


def perplexity_text(x: float | None) -> str:
    # a head initialised from token vectors can start at 1e50: keep that readable
    return "n/a" if x is None else f"{x:.1f}" if x < 1e6 else f"{x:.2e}"


def adaptation_line(a: dict) -> str:
    """The adaptation's perplexities (held-out task text, and the model's own held-out
    text where it ships one: forgetting) and its time."""
    text = (
        f"Adaptation (§3.4): the biLM continued on the task's training and dev text "
        f"({a['sentences']:,} sentences; never test) in {a['seconds']:.0f} s"
        f"{' (reused from the cache)' if a.get('reused') else ''}: held-out perplexity "
        f"**{perplexity_text(a['perplexity_before'])} → {perplexity_text(a['perplexity_after'])}**"
    )
    if a.get("original_perplexity_before") is not None:
        text += (
            f"; on the model's original held-out text {perplexity_text(a['original_perplexity_before'])} "
            f"→ {perplexity_text(a['original_perplexity_after'])}"
        )
    return text + f". Adapted model: `{a['model']}`."


def write_report(path: Path, title: str, ft: Finetuned, command: str) -> None:
    """``path`` (markdown) and ``path.json``: each whole or not at all (atomic writes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    metric = METRIC_NAMES[ft.task.metric]
    body = f"## {title}\n\nMetric: {metric}.\n\n```\n{command}\n```\n\n{results_table(ft)}\n"
    atomic.write_json(path.with_suffix(".json"), rows(ft))
    atomic.write_text(path, body)
