"""#45: the client installs on its own (``pip install ./clients/python``): httpx, numpy,
orjson, no torch, and its ``Client`` gives the library's vectors against a running server.
#57: docs/client.md's code runs there and gives what the page says; the docs name what it
installs.

A fresh virtual environment with pip, the client installed with its real dependencies
from the package index, then a script run in it against a real ``elmo-service serve``;
its vectors are compared here with ``Embedder`` on the same artifact. The installed size
is printed (``-s``) for the record (docs/client.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from elmo_service.embedder import Embedder
from tests.support.core_fixtures import tiny_artifact
from tests.support.determinism import same_vectors
from tests.support.replicas import REPO, Replica

pytestmark = pytest.mark.slow  # a venv and a package index install, a server process

SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from elmo_client import Client, EmbeddedSentence
    import elmo_client.values as values
    with Client(sys.argv[1]) as c:
        got = c.embed(["the river bank", ["pre", "tokenized", "words"], "", "a b c d"],
                      mix="shipped" if len(sys.argv) > 3 else None)
    np.savez(sys.argv[2], *[s.layers for s in got])
    print(json.dumps({
        "tokens": [[t.text for t in s.tokens] for s in got],
        "version": got.model_version,
        "values_file": values.__file__,
        "loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "elmo_service")),
    }))
""")


def _run(py: Path, *args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(py), *args], capture_output=True, text=True, check=check, **kw)


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory) -> Path:
    """A fresh virtual environment holding the client alone; its python."""
    venv = tmp_path_factory.mktemp("client-venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    pip = _run(py, "-m", "pip", "install", "--quiet", str(REPO / "clients" / "python"),
               check=False, timeout=600)  # fmt: skip
    assert pip.returncode == 0, pip.stdout + pip.stderr
    return py


def test_the_client_alone_has_no_torch_and_gives_the_librarys_vectors(client_venv, tmp_path):
    py = client_venv
    # nothing of the server: no torch, no library, no web framework
    for module in ("torch", "elmo_service", "fastapi", "numba"):
        r = _run(py, "-c", f"import {module}", check=False)
        assert r.returncode != 0 and "ModuleNotFoundError" in r.stderr, module
    site = Path(_run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
                .stdout.strip())  # fmt: skip
    installed = site / "elmo_client" / "values.py"
    assert not installed.is_symlink()  # the wheel holds the file itself: one source
    assert installed.read_bytes() == (REPO / "elmo_service" / "values.py").read_bytes()
    size = subprocess.run(["du", "-sm", str(site)], capture_output=True, text=True).stdout
    print(f"\nclient install: {size.split()[0]} MB in {site}")
    assert int(size.split()[0]) < 150  # torch alone is several hundred MB

    model = tiny_artifact(tmp_path / "models" / "a")
    rep = Replica({"ELMO_MODELS_DIR": str(tmp_path / "models"), "ELMO_MODEL": "a",
                   "ELMO_DATA_DIR": str(tmp_path / "data"),
                   "ELMO_RUNS_DIR": str(tmp_path / "runs")}, tmp_path, "alone").start()  # fmt: skip
    try:
        rep.wait_ready(120)
        (tmp_path / "script.py").write_text(SCRIPT)
        out = tmp_path / "got.npz"
        r = _run(py, str(tmp_path / "script.py"), rep.url, str(out), check=False, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        rep.stop()
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["loaded"] == []  # neither torch nor the library was imported
    assert seen["values_file"].startswith(str(site))
    lib = Embedder.load(model, threads=1)
    want = lib.embed(["the river bank", ["pre", "tokenized", "words"], "", "a b c d"])
    got = np.load(out)
    assert seen["version"] == lib.version
    for i, w in enumerate(want):
        assert seen["tokens"][i] == [t.text for t in w.tokens]
        assert same_vectors(got[f"arr_{i}"], w.layers), i


# docs/client.md's blocks that are not run here, and why: a job trains a model (minutes),
# and OpenAI's SDK is not the client's
NOT_RUN = ("client.jobs.submit(", "from openai import")


def test_docs_client_md_runs_with_the_client_alone_and_gives_what_it_says(client_venv, tmp_path):
    """Every Python block of docs/client.md, in order, in the client-only environment,
    against `elmo-service serve` on the bundled model: no import of the library (the
    inline mix is a plain list or dict), and each ``EXPR  # VALUE`` the page shows is what
    the client gives (tokens, ``words()``, shapes, the model version, an error's fields)."""
    page = REPO / "docs" / "client.md"
    (tmp_path / "corpus.txt").write_text("The bank raised rates.\n\nWe sat on the bank.\n" * 5)
    (tmp_path / "report.txt").write_text("The river bank flooded. " * 40)
    env = {"ELMO_MODELS_DIR": str(REPO / "models"), "ELMO_MODEL": "default",
           "ELMO_DATA_DIR": str(tmp_path / "data"), "ELMO_RUNS_DIR": str(tmp_path / "runs"),
           "ELMO_ADMIN_KEYS": "ADMIN-KEY"}  # fmt: skip
    rep = Replica(env, tmp_path, "docs").start()
    try:
        rep.wait_ready(180)
        r = _run(client_venv, str(REPO / "tests" / "support" / "doc_runner.py"), str(page),
                 rep.url, "--skip", *NOT_RUN, check=False, timeout=300, cwd=tmp_path)  # fmt: skip
    finally:
        rep.stop()
    assert r.stdout.strip(), r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["failure"] is None and r.returncode == 0, report["failure"] or r.stderr
    blocks = page.read_text(encoding="utf-8").count("```python")
    assert len(report["skipped"]) == len(NOT_RUN)  # each reason skips one block, no more
    assert report["run"] == blocks - len(NOT_RUN) and report["checks"] >= 7, report
