#!/usr/bin/env python3
"""A local package index of torch's CPU wheels, for image builds that cannot reach PyTorch's index.

    python3 docker/torch_index.py                 # build/torch-index/simple/...
    python3 docker/torch_index.py --serve 8901    # ... and serve it on 127.0.0.1:8901 (Ctrl-C stops)

then build with ``TORCH_INDEX_URL=http://127.0.0.1:8901/simple BUILD_NETWORK=host make stack``
(host networking: the build's pip must reach the host's loopback).

The wheels come from ``pip download`` with the host pip's own configuration (its index, proxies,
local wheel folders), ``torch==VERSION+cpu`` and, unless ``--no-deps``, its dependencies: the
image's torch install uses this index alone, so they must be in it. ``--wheels DIR`` indexes wheel
files already on disk instead. The layout is PEP 503's: ``simple/index.html`` and one
``simple/<normalized-name>/index.html`` per project, links with ``#sha256=`` digests.
Standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import html
import http.server
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

ROOT = Path(__file__).resolve().parents[1]


def normalize(name: str) -> str:
    """PEP 503 project name normalization."""
    return re.sub(r"[-_.]+", "-", name).lower()


def project_of(wheel: Path) -> str:
    # wheel file names: {distribution}-{version}(-{build})?-{python}-{abi}-{platform}.whl
    return normalize(wheel.name.split("-", 1)[0])


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download(dest: Path, version: str, deps: bool, pip: list[str]) -> None:
    cmd = [*pip, "download", "--dest", str(dest), "--only-binary", ":all:", f"torch=={version}+cpu"]
    if not deps:
        cmd.append("--no-deps")
    print("+", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)


def write_index(out: Path, wheels: list[Path]) -> dict[str, list[Path]]:
    """PEP 503 pages under out/simple for `wheels` (files under out/simple/files)."""
    simple = out / "simple"
    files = simple / "files"
    files.mkdir(parents=True, exist_ok=True)
    projects: dict[str, list[Path]] = {}
    for wheel in sorted(wheels):
        target = files / wheel.name
        if target.resolve() != wheel.resolve():
            shutil.copy2(wheel, target)
        projects.setdefault(project_of(wheel), []).append(target)
    for name, paths in projects.items():
        links = "\n".join(
            f'<a href="../files/{quote(p.name)}#sha256={sha256(p)}">{html.escape(p.name)}</a><br>'
            for p in paths
        )
        page = simple / name / "index.html"
        page.parent.mkdir(exist_ok=True)
        page.write_text(f"<!DOCTYPE html>\n<html><body>\n{links}\n</body></html>\n")
    root = "\n".join(f'<a href="{n}/">{n}</a><br>' for n in sorted(projects))
    (simple / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{root}\n</body></html>\n")
    return projects


def serve(out: Path, port: int) -> None:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(out))
    with http.server.ThreadingHTTPServer(("127.0.0.1", port), handler) as httpd:
        print(f"serving http://127.0.0.1:{port}/simple (Ctrl-C stops)", file=sys.stderr)
        with contextlib.suppress(KeyboardInterrupt):
            httpd.serve_forever()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "build" / "torch-index")
    p.add_argument("--version", default="2.13.0", help="torch version (the +cpu build is taken)")
    p.add_argument("--no-deps", action="store_true", help="torch alone, not its dependencies")
    p.add_argument(
        "--wheels", type=Path, help="index the .whl files in this folder, download nothing"
    )
    p.add_argument("--pip", default=f"{sys.executable} -m pip", help="pip command for the download")
    p.add_argument("--serve", type=int, metavar="PORT", help="then serve it on 127.0.0.1:PORT")
    args = p.parse_args(argv)

    if args.wheels is None:
        wheel_dir = args.out / "simple" / "files"
        wheel_dir.mkdir(parents=True, exist_ok=True)
        download(wheel_dir, args.version, not args.no_deps, args.pip.split())
    else:
        wheel_dir = args.wheels
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not any(project_of(w) == "torch" for w in wheels):
        p.error(f"no torch wheel in {wheel_dir}")
    projects = write_index(args.out, wheels)
    print(f"{args.out / 'simple'}: {', '.join(sorted(projects))}", file=sys.stderr)
    if args.serve:
        serve(args.out, args.serve)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
