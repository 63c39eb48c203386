"""One install per audience (#45): ``pip install elmo-service`` is the library, nothing of the
server's; ``serve`` in it says which extra to add. Real installs into fresh virtual
environments (slow: pip builds and installs the library; torch is linked in, not copied)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from elmo_service import Embedder
from tests.support.determinism import same_vectors

ROOT = Path(__file__).resolve().parents[2]
SERVER_PACKAGES = ("fastapi", "uvicorn", "starlette", "redis", "rq", "prometheus_client", "httpx")

pytestmark = pytest.mark.slow


def _source_copy(dest: Path) -> Path:
    """The tracked and new files as they are now (pip builds in the source folder: not ours)."""
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for f in files:
        src = ROOT / f
        if f.startswith(("models/", "tests/", "docs/", "bench/")) or not src.is_file():
            continue
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / f, follow_symlinks=True)
    return dest


def _linked_torch(dest: Path) -> Path:
    """A folder of links to this suite's torch and what it needs (its requirements, walked):
    torch is the build the suite runs on (the Makefile's rule: pip never picks a build), and
    linking it spares copying ~1 GB per run (most of this test's minute and a half)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    dest.mkdir(parents=True)
    seen, todo = set(), ["torch"]
    while todo:
        dist = metadata.distribution(todo.pop())
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
        for top in {f.parts[0] for f in dist.files or []}:
            src = Path(dist.locate_file(top))
            keep = top not in ("..", "__pycache__") and not top.endswith(".pth")
            if keep and src.exists() and not (dest / top).exists():
                (dest / top).symlink_to(src)
    return dest


def _venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    py = path / "bin" / "python"
    purelib = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    links = _linked_torch(path.parent / "torch-links")
    (Path(purelib) / "suite_torch.pth").write_text(f"{links}\n")  # torch is installed: pip sees it
    return py


def test_the_library_installs_alone_and_gives_the_same_vectors(tmp_path):
    src = _source_copy(tmp_path / "src")
    py = _venv(tmp_path / "venv")
    subprocess.run([py, "-m", "pip", "install", "-q", str(src)], check=True, timeout=900)
    probe = f"""
import importlib.util, json, sys
from elmo_service import Elmo, Embedder, batch_to_ids
import elmo_pretrain.train, elmo_cli.core
emb = Embedder.load({str(ROOT / "models" / "default")!r}, threads=1)
out = emb.embed(["The bank of the river.", ["pre", "tokenized"]])
print(json.dumps({{
    "missing": [m for m in {SERVER_PACKAGES!r} if importlib.util.find_spec(m) is None],
    "shadowing": [m for m in ("api", "jobs", "storage", "pretrain", "bulk", "cli")
                  if importlib.util.find_spec(m) is not None],
    "layers": [o.layers.tolist() for o in out],
}}))
"""
    res = subprocess.run(
        [py, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert sorted(got["missing"]) == sorted(SERVER_PACKAGES), got["missing"]
    assert got["shadowing"] == [], "generic top-level names installed: " + str(got["shadowing"])
    ours = Embedder.load(ROOT / "models" / "default", threads=1).embed(
        ["The bank of the river.", ["pre", "tokenized"]]
    )
    for a, b in zip(ours, got["layers"], strict=True):
        assert same_vectors(np.asarray(b, dtype=np.float32), a.layers)

    # the service's commands name the extra they need, in one line, before any work
    cli = tmp_path / "venv" / "bin" / "elmo-service"
    res = subprocess.run([cli, "serve"], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "pip install 'elmo-service[server]'" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    size = sum(f.stat().st_size for f in (tmp_path / "venv").rglob("*") if f.is_file())
    print(f"library install: {size / 2**20:.0f} MiB in the venv")
