"""The probe's results as a markdown table (and JSON beside it)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from elmo_pretrain.probe.learn import ProbeResult
from elmo_service import atomic


def results_table(results: Sequence[ProbeResult]) -> str:
    rows = ["| features | dev acc | test acc |", "|---|---|---|"]
    rows += [f"| {r.name} | {100 * r.dev_acc:.2f} | {100 * r.test_acc:.2f} |" for r in results]
    return "\n".join(rows)


def write_report(path: Path, title: str, results: Sequence[ProbeResult], command: str) -> None:
    """``path`` (markdown) and its ``.json``: each whole or not at all (atomic writes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = f"## {title}\n\n```\n{command}\n```\n\n{results_table(results)}\n"
    atomic.write_json(
        path.with_suffix(".json"),
        [{"name": r.name, "dev": r.dev_acc, "test": r.test_acc, **r.extra} for r in results],
    )
    atomic.write_text(path, body)
