"""Docs that point somewhere point at something (#51): every relative link in README.md and
docs/ reaches a file (and its anchor, where it names one), and every backticked repository
path names a file or folder that exists."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# top-level folders whose paths the docs name as the repository's own (models/, runs/ and
# data/ also hold what a user's commands create, so they are not checked)
SOURCE_DIRS = {
    p.name
    for p in ROOT.iterdir()
    if p.is_dir() and not p.name.startswith(".") and p.name not in ("models", "runs", "data")
} | {".ci"}
# what a documented command writes, named before it exists
OUTPUTS = {"docs/gpu-report.md"}  # bench/gpu_check.py, on a machine with a GPU
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
PATHLIKE = re.compile(r"^[\w.-]+(/[\w.*-]+)+/?$")


def _without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    s = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    s = "".join(c for c in s if c in " -_" or unicodedata.category(c)[0] in "LN")
    return s.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    out, seen = set(), {}
    for line in _without_code_blocks(page.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"^#{1,6}\s+(.*)", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    out |= set(re.findall(r'<a (?:name|id)="([^"]+)"', page.read_text(encoding="utf-8")))
    return out


def test_the_slugs_follow_github():
    assert _slug("Serving kernels against AllenNLP (model side)") == (
        "serving-kernels-against-allennlp-model-side"
    )
    assert _slug("`make test`: the whole suite") == "make-test-the-whole-suite"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_its_target(page):
    text = _without_code_blocks(page.read_text(encoding="utf-8"))
    bad = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_backticked_repository_path_exists(page):
    bad = []
    for span in CODE_SPAN.findall(page.read_text(encoding="utf-8")):
        span = span.split("::")[0].split(":")[0] if "::" in span else span
        if not PATHLIKE.match(span) or span.split("/")[0] not in SOURCE_DIRS or span in OUTPUTS:
            continue
        if "*" in span:
            if not list(ROOT.glob(span)):
                bad.append(span)
        elif not (ROOT / span).exists():
            bad.append(span)
    assert not bad, f"{page.relative_to(ROOT)} names paths that do not exist: " + ", ".join(
        sorted(set(bad))
    )


# a documented command that runs one of the repository's scripts: `python bench/x.py ...`
SCRIPT_COMMAND = re.compile(r"\bpython3?(?:\s+-[A-Za-z]\S*)*\s+([\w./-]+\.py)\b")


def _scripts_run(text: str) -> set[str]:
    """The repository scripts a page's commands run (code blocks included): paths under one
    of the repository's own folders, or a bare name (which must then be at the root)."""
    out = set()
    for path in SCRIPT_COMMAND.findall(text):
        if path.startswith(("/", "~")):
            continue
        if "/" not in path or path.split("/")[0] in SOURCE_DIRS:
            out.add(path)
    return out


def test_script_commands_are_found_in_prose_and_code_blocks(tmp_path):
    text = (
        "run `OMP_NUM_THREADS=2 .venv/bin/python bench/gone.py --rounds 5`\n```\npython3 x.py\n```"
    )
    assert _scripts_run(text) == {"bench/gone.py", "x.py"}
    # an absolute path is no script of the repository's; a module run is none either
    assert _scripts_run(f"python {tmp_path / 'mine.py'}; python -m pytest tests/a.py") == set()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_script_a_command_runs_exists(page):
    """A retired script keeps no runnable command in the docs (#57)."""
    bad = sorted(
        p for p in _scripts_run(page.read_text(encoding="utf-8")) if not (ROOT / p).is_file()
    )
    assert not bad, f"{page.relative_to(ROOT)} runs scripts that do not exist: {', '.join(bad)}"
