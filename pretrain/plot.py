"""`elmo-pretrain plot`: a run's ``metrics.jsonl`` as a PNG learning curve.

Four panels over optimizer steps: perplexity (training windows, and the
held-out evaluations as points), learning rate, gradient norm and tokens/s.
Needs matplotlib (``pip install 'elmo-service[plot]'``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from elmo_pretrain.run_dir import METRICS_FILE
from elmo_service.errors import ConfigError, InputError


def _finite(v: Any) -> bool:
    """A figure to draw: a diverged run logs null (or, before that was fixed, NaN)."""
    return isinstance(v, int | float) and math.isfinite(v)


def read_metrics(source: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training windows, held-out evaluations), one record per step, by step.

    ``source`` is a run folder or a metrics file. The log is appended across
    resumes, so a step logged twice (after a stop past the last checkpoint)
    keeps its last record.
    """
    path = Path(source)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise InputError(f"{path} not found (a run folder or its {METRICS_FILE})", field="run_dir")
    train: dict[int, dict[str, Any]] = {}
    heldout: dict[int, dict[str, Any]] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{n}: not JSON ({e.msg})", field="run_dir") from e
        if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
            continue
        if isinstance(rec.get("heldout"), dict):
            heldout[rec["step"]] = rec["heldout"]
        elif "loss" in rec:
            train[rec["step"]] = rec
    if not train and not heldout:
        raise InputError(f"{path} holds no training metrics yet", field="run_dir")
    return (
        [train[s] for s in sorted(train)],
        [{"step": s, **heldout[s]} for s in sorted(heldout)],
    )


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError(
            "plot needs matplotlib: pip install 'elmo-service[plot]' (or pip install matplotlib)",
            field="matplotlib",
        ) from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_metrics(source: str | Path, out: str | Path, title: str | None = None) -> Path:
    """Draw the learning curve of ``source`` (run folder or metrics file) into ``out`` (PNG)."""
    train, heldout = read_metrics(source)
    plt = _pyplot()
    steps = [r["step"] for r in train]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex=True, layout="constrained")
    ax = axes[0][0]
    if train:
        ax.plot(steps, [r["ppl"] for r in train], lw=1, color="tab:blue", label="training (window)")
    for key, label, marker in (
        ("avg_ppl", "held-out (fwd/bwd average)", "o"),
        ("forward_ppl", "held-out forward", "s"),
    ):
        pts = [(r["step"], r[key]) for r in heldout if _finite(r.get(key))]
        if pts:
            ax.plot(
                *zip(*pts, strict=True),
                marker=marker,
                ms=4,
                lw=1.5,
                color="tab:orange",
                label=label,
            )
            last_step, last = pts[-1]
            ax.annotate(f"{last:.1f}", (last_step, last), textcoords="offset points",
                        xytext=(-6, 8), ha="right", fontsize=9)  # fmt: skip
            break  # the average when both directions were trained, else forward
    values = [r["ppl"] for r in train if _finite(r.get("ppl"))] + [
        v for r in heldout for k, v in r.items() if k.endswith("ppl") and _finite(v)
    ]
    if values and max(values) > 10 * min(values):  # a log axis only where it spans a decade
        ax.set_yscale("log")
        ax.set_ylabel("perplexity (log scale)")
    else:
        ax.set_ylabel("perplexity")
    ax.set_title("perplexity")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper right", fontsize=9)
    panels = [
        (axes[0][1], "lr", "learning rate", "learning rate"),
        (axes[1][0], "grad_norm", "gradient norm (before clipping)", "gradient norm"),
        (axes[1][1], "tok_s", "tokens/s", "throughput"),
    ]
    for ax, key, ylabel, name in panels:
        pts = [(r["step"], r[key]) for r in train if key in r]
        if pts:
            ax.plot(*zip(*pts, strict=True), lw=1, color="tab:gray" if key != "lr" else "tab:green")
        ax.set_ylabel(ylabel)
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("optimizer step")
    src = Path(source)
    fig.suptitle(title or (src.name if src.is_dir() else f"{src.parent.name}/{src.name}"))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
