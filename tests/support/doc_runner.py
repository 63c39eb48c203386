"""Runs a page's Python code blocks in order, in one namespace, as a reader following the
page would, and checks what their comments say they give: a line ``EXPR  # LITERAL``
(or ``EXPR  # LITERAL: words``, or with the literal on the comment lines right below it)
must give that Python literal (one holding ``...`` is an illustration, not checked).

    python doc_runner.py PAGE.md URL [--skip TEXT ...]

Standard library only: it runs in a virtual environment holding nothing but the client.
``http://127.0.0.1:8000`` in the blocks becomes URL. Prints one JSON line: the blocks run
and skipped, the checks made, and the first failure (then exits 1).
"""

from __future__ import annotations

import ast
import json
import re
import sys
import traceback
from pathlib import Path

DOC_URL = "http://127.0.0.1:8000"


def blocks(page: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page, flags=re.M | re.S)


def _literal(text: str) -> str | None:
    """The Python literal ``text`` is, or begins with before a ``:`` (its explanation)."""
    cuts = [len(text)] + [m.start() for m in re.finditer(":", text)]
    for cut in cuts:
        try:
            ast.literal_eval(text[:cut].strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        return text[:cut].strip()
    return None


def _is_expression(src: str) -> bool:
    try:
        ast.parse(src.strip(), mode="eval")
    except SyntaxError:
        return False
    return True


def instrument(code: str) -> tuple[str, int]:
    """``code`` with each checkable line turned into ``__check__(EXPR, LITERAL, line)``."""
    lines, out, n = code.splitlines(), [], 0
    i = 0
    while i < len(lines):
        line = lines[i]
        m = re.match(r"^(\s*)(\S.*?)  # (.*)$", line)
        literal = None
        if m and _is_expression(m.group(2)):
            literal = _literal(m.group(3))
            j = i + 1
            if literal is None:  # the value on the comment lines below
                below = []
                while j < len(lines) and re.match(rf"^{m.group(1)}# ", lines[j]):
                    below.append(lines[j].strip()[2:])
                    j += 1
                literal = _literal(" ".join(below)) if below else None
        if literal is not None and "..." not in literal:
            out.append(f"{m.group(1)}__check__(({m.group(2)}), {literal!r}, {i + 1})")
            n += 1
        else:
            out.append(line)
        i += 1
    return "\n".join(out) + "\n", n


def _plain(x):
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


class Mismatch(AssertionError):
    pass


def main() -> int:
    page_path, url = sys.argv[1], sys.argv[2]
    skip = sys.argv[sys.argv.index("--skip") + 1 :] if "--skip" in sys.argv else []
    page = Path(page_path).read_text(encoding="utf-8")
    report = {"run": 0, "skipped": [], "checks": 0, "failure": None}

    def check(value, literal, line):
        want = ast.literal_eval(literal)
        if _plain(value) != _plain(want):
            raise Mismatch(f"line {line}: the page says {literal}, the code gives {value!r}")

    namespace = {"__check__": check, "__name__": "__main__"}
    for k, code in enumerate(blocks(page)):
        if any(s in code for s in skip):
            report["skipped"].append(k)
            continue
        src, n = instrument(code.replace(DOC_URL, url))
        try:
            exec(compile(src, f"{page_path} block {k}", "exec"), namespace)
        except BaseException as e:  # noqa: BLE001 - reported
            report["failure"] = f"block {k}: {''.join(traceback.format_exception_only(e)).strip()}"
            print(json.dumps(report))
            return 1
        report["run"] += 1
        report["checks"] += n
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
