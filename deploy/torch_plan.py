"""Which torch build `make` installs, as pip arguments: ``python deploy/torch_plan.py [--torch ...]``.

Prints the arguments for ``pip install`` on stdout (one line) and why, on stderr.

  auto (default)  cuda when ``nvidia-smi -L`` lists a GPU, else cpu
  cpu             Linux: ``torch==V+cpu``, the CPU build (~200 MB), from PyTorch's CPU wheel index,
                  which is added only when pip cannot already resolve that pin without an index
                  (a local wheel folder in pip's configuration, or ``--find-links``); the ``+cpu``
                  pin means pip cannot take the CUDA build instead, whatever the indexes hold.
                  macOS / Windows: ``torch==V`` from the default index (CPU builds there).
  cuda            ``torch==V`` from the default index: on Linux x86_64 PyPI's torch is the CUDA
                  build (several GB with its nvidia-* wheels); ``--cuda-index`` picks another
                  CUDA flavour (PyTorch's ``.../whl/cu<XYZ>`` indexes).

Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def has_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def resolvable_without_index(pip: str, spec: str) -> bool:
    """True when pip, as configured, finds `spec` with no index at all (local wheels)."""
    cmd = [pip, "install", "--dry-run", "--quiet", "--no-index", "--no-deps", "--ignore-installed",
           "--disable-pip-version-check", spec]  # fmt: skip
    try:
        return subprocess.run(cmd, capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def plan(
    torch: str, version: str, pip: str, cpu_index: str, cuda_index: str, platform: str
) -> tuple[list[str], str]:
    """(pip arguments, reason) for installing torch `version` as `torch` (auto|cpu|cuda)."""
    if torch == "auto":
        torch = "cuda" if has_gpu() else "cpu"
        why = "a GPU answered nvidia-smi" if torch == "cuda" else "no GPU (nvidia-smi)"
    else:
        why = "TORCH=" + torch
    if torch == "cuda":
        args = [f"torch=={version}"] + (["--index-url", cuda_index] if cuda_index else [])
        return args, f"CUDA build ({why}) from {cuda_index or 'the default index'}"
    if not platform.startswith("linux"):
        return [f"torch=={version}"], f"CPU build ({why}): the default index's torch on {platform}"
    spec = f"torch=={version}+cpu"
    if resolvable_without_index(pip, spec):
        return [spec], f"CPU build ({why}) from pip's local wheels"
    return [spec, "--extra-index-url", cpu_index], f"CPU build ({why}) from {cpu_index}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--torch", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--version", default="2.13.0", help="exact torch version")
    p.add_argument("--pip", default="pip", help="the pip that will install it")
    p.add_argument("--cpu-index", default=CPU_INDEX, help="index of the CPU builds")
    p.add_argument("--cuda-index", default="", help="index of the CUDA builds (default: pip's)")
    args = p.parse_args(argv)
    pip_args, why = plan(
        args.torch, args.version, args.pip, args.cpu_index, args.cuda_index, sys.platform
    )
    print(f"torch {args.version}: {why}", file=sys.stderr)
    print(" ".join(pip_args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
