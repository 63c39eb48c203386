"""Which torch `make` installs: `make torch-plan` (deploy/torch_plan.py) and what pip resolves from it.

The resolution is checked with pip's dry run while ignoring this machine's pip configuration
(PIP_CONFIG_FILE=/dev/null, no PIP_* variables), so a local wheel folder cannot hide a CUDA pick.
PyTorch's CPU index and PyPI are stood in for by local PEP 503 indexes of small made-up wheels
(the CPU index is out of reach here and the real wheels are gigabytes): one `torch==2.13.0` that
needs an `nvidia-*` wheel, like PyPI's Linux build, and one `torch==2.13.0+cpu`, like PyTorch's
CPU index; the CPU one is indexed by docker/torch_index.py, the script the Docker recipe uses.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
pytestmark = pytest.mark.slow  # pip subprocesses


def clean_env(**extra: str) -> dict[str, str]:
    """The environment minus pip's own settings, with pip's config files switched off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return env | {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"} | extra


def make_wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A minimal pure-Python wheel (enough for pip's resolver)."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {
        f"{name.replace('-', '_')}/__init__.py": "",
        f"{dist}.dist-info/METADATA": meta,
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = "".join(f"{f},,\n" for f in files) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for f, text in {**files, f"{dist}.dist-info/RECORD": record}.items():
            z.writestr(f, text)
    return path


def index(out: Path, wheels: Path) -> str:
    """Index `wheels` with docker/torch_index.py; returns the index URL."""
    subprocess.run(
        [sys.executable, str(ROOT / "docker" / "torch_index.py"), "--out", str(out),
         "--wheels", str(wheels)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return (out / "simple").as_uri()


def torch_plan(env: dict[str, str], *make_args: str) -> list[str]:
    make = shutil.which("make")
    assert make, "make is needed for this test"
    proc = subprocess.run(
        [make, "--no-print-directory", "-s", "-C", str(ROOT), "torch-plan", *make_args],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.split()
    assert words[:2] == ["pip", "install"], proc.stdout
    return words[2:]


def dry_run(tmp: Path, args: list[str], env: dict[str, str]) -> list[tuple[str, str]]:
    report = tmp / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--report", str(report), *args],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    items = json.loads(report.read_text())["install"]
    return sorted((i["metadata"]["name"], i["metadata"]["version"]) for i in items)


@pytest.fixture
def indexes(tmp_path: Path) -> tuple[str, str]:
    """(a PyPI stand-in with the CUDA-style torch, a CPU-index stand-in with torch+cpu)."""
    pypi = tmp_path / "pypi"
    make_wheel(pypi / "w", "torch", "2.13.0", ("nvidia-cublas",))
    make_wheel(pypi / "w", "nvidia-cublas", "13.1.1")
    cpu = tmp_path / "cpu"
    make_wheel(cpu / "w", "torch", "2.13.0+cpu")
    return index(pypi, pypi / "w"), index(cpu, cpu / "w")


def test_cpu_plan_without_local_wheels_adds_the_cpu_index():
    args = torch_plan(clean_env(), "TORCH=cpu")
    assert args == ["torch==2.13.0+cpu", "--extra-index-url", CPU_INDEX]


def test_cpu_plan_with_local_wheels_needs_no_index(tmp_path):
    wheels = tmp_path / "wheels"
    make_wheel(wheels, "torch", "2.13.0+cpu")
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nfind-links = {wheels}\n")
    assert torch_plan(clean_env(PIP_CONFIG_FILE=str(conf)), "TORCH=cpu") == ["torch==2.13.0+cpu"]


def test_unknown_torch_choice_stops_make():
    make = shutil.which("make")
    assert make
    proc = subprocess.run(
        [make, "--no-print-directory", "-s", "-C", str(ROOT), "torch-plan", "TORCH=rocm"],
        env=clean_env(), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode != 0 and "invalid choice: 'rocm'" in proc.stderr
    assert "pip install" not in proc.stdout


def test_auto_follows_nvidia_smi(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    assert torch_plan(clean_env(PATH=path)) == ["torch==2.13.0"]
    assert torch_plan(clean_env(PATH=path), "TORCH_CUDA_INDEX=https://example.invalid/cu126") == [
        "torch==2.13.0", "--index-url", "https://example.invalid/cu126"
    ]  # fmt: skip
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2; exit 9\n")  # driver, no GPU
    assert torch_plan(clean_env(PATH=path))[0] == "torch==2.13.0+cpu"
    assert torch_plan(clean_env(PATH=path), "TORCH=cuda") == ["torch==2.13.0"]


def test_cpu_plan_resolves_the_cpu_build_ignoring_pip_config(tmp_path, indexes):
    pypi, cpu = indexes
    env = clean_env()
    args = torch_plan(env, "TORCH=cpu", f"TORCH_CPU_INDEX={cpu}")
    assert args == ["torch==2.13.0+cpu", "--extra-index-url", cpu]
    # the plan, with the PyPI stand-in as the default index: the CPU build and nothing nvidia
    assert dry_run(tmp_path, ["--index-url", pypi, *args], env) == [("torch", "2.13.0+cpu")]
    # what the Makefile used to run (a bare pin on the default index) takes the CUDA build
    old = dry_run(tmp_path, ["--index-url", pypi, "torch==2.13.0"], env)
    assert old == [("nvidia-cublas", "13.1.1"), ("torch", "2.13.0")]
