"""Pool `elmo-pretrain finetune` reports into one row of the paper's table.

A finetune can be split over processes (``--seeds 1 --first-seed K``, one per
seed, or one per arm with ``--no-baseline``); this pools their ``report.json``
rows seed by seed and prints the arms' means ± sample standard deviations and
the increase, as the command's own report would for all seeds in one process.
A process stopped after some runs has no report, but its log has one line per
finished run (``[finetune] ARM seed K done: dev D test T (...)``): pass logs
too, and those lines are pooled.

    .venv/bin/python bench/finetune_table.py runs/finetune/bench/pos-seed*/report.json
    .venv/bin/python bench/finetune_table.py runs/finetune/bench/ner-seed*.log runs/finetune/bench/ner-elmo-*/report.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

DONE = re.compile(
    r"\[finetune\] (\S+)\s+seed (\d+) done: dev ([\d.]+)(?: %)? test ([\d.]+)(?: %)? "
    r"\(best epoch \d+ of (\d+), (\d+)s\)"
)


def _rows(path: Path) -> list[dict]:
    """A report's rows, or a log's finished runs in the same shape (metric unknown)."""
    if path.suffix == ".json":
        return json.loads(path.read_text())
    rows: dict[str, dict] = {}
    for m in DONE.finditer(path.read_text(errors="replace")):
        arm, seed, dev, test, epochs, seconds = m.groups()
        row = rows.setdefault(arm, {"name": arm, "metric": "?", "seeds": []})
        row["seeds"].append(
            {"seed": int(seed), "dev": float(dev) / 100, "test": float(test) / 100,
             "epochs": int(epochs), "seconds": float(seconds)}
        )  # fmt: skip
    return list(rows.values())


def pool(paths: list[Path]) -> dict[str, dict]:
    """``arm -> {"metric", "dev": [...], "test": [...], "seeds": [...], "seconds": [...]}``."""
    arms: dict[str, dict] = {}
    for path in paths:
        for row in _rows(path):
            arm = arms.setdefault(
                row["name"],
                {"metric": row["metric"], "dev": [], "test": [], "seeds": [], "seconds": []},
            )
            if arm["metric"] == "?":
                arm["metric"] = row["metric"]
            for s in row["seeds"]:
                if s["seed"] in arm["seeds"]:
                    raise SystemExit(f"{path}: seed {s['seed']} of {row['name']} seen twice")
                arm["seeds"].append(s["seed"])
                arm["dev"].append(s["dev"])
                arm["test"].append(s["test"])
                arm["seconds"].append(s["seconds"])
    return arms


def _ms(xs: list[float]) -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{100 * statistics.fmean(xs):.2f} ± {100 * sd:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", type=Path)
    arms = pool(ap.parse_args().reports)
    for name, a in arms.items():
        print(
            f"{name:14s} {a['metric']:9s} seeds {sorted(a['seeds'])}: dev {_ms(a['dev'])}, "
            f"test {_ms(a['test'])}; {statistics.fmean(a['seconds']):.0f}s per run"
        )
    for arm in ("elmo+baseline", "adapted+baseline"):
        if "baseline" in arms and arm in arms:
            base = statistics.fmean(arms["baseline"]["test"])
            other = statistics.fmean(arms[arm]["test"])
            print(
                f"{arm} increase: {100 * (other - base):+.2f} points absolute, "
                f"{100 * (other - base) / (1 - base):.1f} % relative error reduction"
            )


if __name__ == "__main__":
    main()
