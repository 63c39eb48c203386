"""The device path: what `pytest -m cuda` runs on a GPU machine (bench/gpu_check.py calls it).

Every test here needs a CUDA device and is skipped, with that reason, where there is
none (this project's CPU machines and CI): the markers select, and on a CPU there is
nothing to select. The CPU dry run of the whole GPU check is tests/e2e/test_gpu_check.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from elmo_service import Embedder

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "default"

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SENTS = [
    "The bank raised its rates .",
    "We sat on the river bank and watched the water .",
    "A much longer sentence , with commas , numbers like 1984 and rare words : zyzzyva .",
]


def test_embedder_on_cuda_matches_the_cpu():
    cpu = Embedder.load(MODEL, device="cpu", threads=2, token_cache_size=0)
    gpu = Embedder.load(MODEL, device="cuda", threads=2, token_cache_size=0)
    assert gpu.device.type == "cuda"
    for a, b in zip(cpu.embed(SENTS), gpu.embed(SENTS), strict=True):
        assert np.isfinite(b.layers).all()
        assert np.abs(a.layers - b.layers).max() <= 1e-4


def test_a_sentence_alone_equals_it_in_a_batch_on_cuda():
    gpu = Embedder.load(MODEL, device="cuda", threads=2, token_cache_size=0)
    batched = gpu.embed(SENTS)
    for s, b in zip(SENTS, batched, strict=True):
        alone = gpu.embed([s])[0]
        assert np.abs(alone.layers - b.layers).max() <= 1e-4


def test_bf16_training_on_cuda_lowers_the_loss(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

    def cli(*args: str) -> None:
        subprocess.run(
            [sys.executable, "-m", "elmo_pretrain.cli", *args], env=env, cwd=ROOT, check=True
        )

    cli("synthetic", "--out", str(tmp_path / "c.txt"), "--sentences", "800")
    cli("prepare", str(tmp_path / "c.txt"), "--out", str(tmp_path / "data"), "--vocab-size",
        "160", "--no-byte-fallback", "--split", "none", "--no-progress")  # fmt: skip
    run = tmp_path / "run"
    cli("train", "configs/tiny.yaml", "--run-dir", str(run), "--set", f"data.path={tmp_path / 'data'}",
        "--set", "train.device=cuda", "--set", "train.precision=bf16", "--set", "train.steps=30",
        "--set", "train.log_every=1")  # fmt: skip
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in lines if "loss" in m and "event" not in m]
    assert all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < np.mean(losses[:5])
