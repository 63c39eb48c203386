"""The README and the docs say what the code does.

* every command line the README gives parses with the command's own parser (no stale flag);
* its Python examples run, and its `curl` examples get a 200 from the service;
* every relative link in the README and in docs/ names a file that exists;
* every setting is in docs/serving.md's table, and no repository text carries internal
  wording (issue numbers, sessions, branch names).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").glob("*.md"))


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def command_lines(text: str) -> list[str]:
    """Shell commands of the bash blocks: continuation lines and quoted newlines joined,
    comment lines dropped."""
    out = []
    for block in blocks(text, "bash"):
        pending = ""
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            if not pending and (not line.strip() or line.strip().startswith("#")):
                continue
            pending = f"{pending}\n{line}" if pending else line.strip()
            try:
                shlex.split(pending, comments=True)
            except ValueError:  # a quote still open: the command goes on
                continue
            out.append(pending)
            pending = ""
    return out


SHELL_OPERATORS = {"&", "&&", "|", "||", ";", ">", ">>", "<", "2>&1", "2>"}


def until_operator(words: list[str]) -> list[str]:
    """A command's own arguments: the words before a shell operator (``&``, ``|``, ``>`` ...)."""
    for i, w in enumerate(words):
        if w in SHELL_OPERATORS:
            return words[:i]
    return words


def cli_calls(text: str) -> list[tuple[str, list[str]]]:
    calls = []
    for line in command_lines(text):
        words = shlex.split(line, comments=True)
        # a shell variable stands for some value: a number parses as any argument type
        words = ["1" if re.fullmatch(r"\$\{?\w+\}?", w) else w for w in words]
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # VAR=value prefixes
            words = words[1:]
        for i, w in enumerate(words):
            name = Path(w).name
            if name in ("elmo-pretrain", "elmo-service"):
                calls.append((name, until_operator(words[i + 1 :])))
                break
            if w == "elmo_pretrain.cli" and i > 0 and words[i - 1] == "-m":
                calls.append(("elmo-pretrain", until_operator(words[i + 1 :])))
                break
    return calls


DOC_CALLS = [
    call
    for doc in [ROOT / "README.md", *DOCS, ROOT / "models" / "README.md"]
    for call in cli_calls(doc.read_text())
]


@pytest.mark.parametrize(
    "prog,args", DOC_CALLS, ids=lambda v: v if isinstance(v, str) else " ".join(v)[:60]
)
def test_documented_commands_parse(prog, args):
    from elmo_cli.main import parser as service_parser
    from elmo_pretrain.cli import build_parser as pretrain_parser

    parser = service_parser() if prog == "elmo-service" else pretrain_parser()
    try:
        parser.parse_args(args)
    except SystemExit as e:  # argparse's error exit
        pytest.fail(f"`{prog} {' '.join(args)}` does not parse (exit {e.code})")


def test_readme_make_targets_exist():
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))
    used = {m for line in command_lines(README) for m in re.findall(r"\bmake ([a-z][\w-]*)", line)}
    assert used and used <= targets, used - targets


@pytest.mark.slow
def test_readme_python_examples_run():
    for code in blocks(README, "python"):
        # run from the repository root, as the README's reader does
        subprocess.run(
            ["python", "-c", code], cwd=ROOT, check=True, timeout=300,
            env={"PATH": str(Path(__import__("sys").executable).parent), "OMP_NUM_THREADS": "1",
                 "PYTHONPATH": str(ROOT)},
        )  # fmt: skip


def curl_posts(text: str) -> list[tuple[str, dict]]:
    posts = []
    for line in command_lines(text):
        for part in line.split(";"):
            words = shlex.split(part, comments=True)
            if not words or words[0] != "curl" or "-d" not in words:
                continue
            url = next(w for w in words if "localhost" in w)
            body = words[words.index("-d") + 1]
            posts.append((url.split("localhost:8000", 1)[1], json.loads(body)))
    return posts


@pytest.mark.slow
def test_readme_curl_examples_answer_200():
    from elmo_api.main import create_app
    from elmo_api.settings import load_settings

    posts = curl_posts(README)
    assert posts
    settings = load_settings(model_path=ROOT / "models" / "default", threads=1)
    with TestClient(create_app(settings)) as client:
        for path, body in posts:
            r = client.post(path, json=body)
            assert r.status_code == 200, (path, body, r.text[:300])
        for path in ("/v1/models", "/readyz", "/metrics"):
            assert client.get(path).status_code == 200


@pytest.mark.parametrize("doc", [ROOT / "README.md", *DOCS], ids=lambda p: p.name)
def test_relative_links_exist(doc):
    text = doc.read_text()
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (doc.parent / target).exists():
            missing.append(target)
    assert not missing, f"{doc.name} links to missing files: {missing}"


def test_every_setting_is_documented():
    from elmo_api.settings import Settings

    text = (ROOT / "docs" / "serving.md").read_text()
    names = [
        "REDIS_URL" if n == "redis_url" else f"ELMO_{n.upper()}" for n in Settings.model_fields
    ]
    missing = [n for n in names if f"`{n}`" not in text]
    assert not missing, f"docs/serving.md's settings table lacks {missing}"


INTERNAL = re.compile(
    r"\(issue \d+|\(issue:|\bissue #?\d+\b|this workplace|working session|this session|"
    r"\bint-(?:serve|jobs|train)\b"
)


def test_no_internal_wording():
    files = subprocess.run(
        ["git", "ls-files", "*.md", "*.py", "*.yaml", "*.yml", "*.sh", "Makefile"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    hits = []
    for name in files:
        if name.startswith(("docs/logs/", "models/ptb/", "models/default/")) or name.endswith(
            "test_readme.py"
        ):
            continue
        for i, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1):
            if INTERNAL.search(line):
                hits.append(f"{name}:{i}: {line.strip()[:80]}")
    assert not hits, "internal wording:\n" + "\n".join(hits)
