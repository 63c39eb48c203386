"""2-process DDP on CPU (gloo) launched by torchrun: it runs, and the replicas stay identical."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from elmo_pretrain import checkpoint as ckpt
from elmo_pretrain.prepare import PrepareOptions, prepare
from elmo_pretrain.sources.synthetic import write_corpus
from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.ddp]  # two processes under torchrun


def torchrun() -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")
def test_two_process_gloo_ddp(tmp_path):
    text = write_corpus(tmp_path / "book.txt", n_sentences=600, seed=5)
    opts = PrepareOptions(vocab_size=200, byte_fallback=False, heldout_fraction=0.05)
    prepare([str(text)], tmp_path / "prepared", opts, progress=False, log=lambda *_: None)
    run = tmp_path / "run"
    cmd = torchrun() + [
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
    ]
    cmd += [
        "-m",
        "elmo_pretrain.cli",
        "train",
        str(ROOT / "configs" / "tiny.yaml"),
        "--run-dir",
        str(run),
    ]
    cmd += [
        "--set",
        f"data.path={tmp_path / 'prepared'}",
        "--set",
        "train.steps=8",
        "--set",
        "train.progress=false",
    ]
    cmd += ["--set", "checkpoint.every_steps=4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    check = [r for r in recs if "ddp_params_identical" in r]
    assert check == [{"step": 8, "ddp_world": 2, "ddp_params_identical": True}]
    st = ckpt.load_checkpoint(ckpt.list_checkpoints(run)[-1])
    assert st["world_size"] == 2 and len(st["rng"]["torch"]) == 2
    assert not torch.equal(st["rng"]["torch"][0], st["rng"]["torch"][1])  # per-rank dropout streams
    # both ranks' batches are counted: two [B, T] batches per step
    per_step = [r["tokens_seen"] for r in recs if "loss" in r]
    assert per_step[-1] > 8 * 48  # more than one rank's worth of the smallest batches
    shutil.rmtree(run)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")
def test_two_nodes_c10d_rendezvous(tmp_path):
    """Two torchrun "nodes" (one process each) meet through c10d rendezvous on loopback,
    as on two machines (docs/multi-node.md): one shared run folder and data, identical
    parameters after the run."""
    text = write_corpus(tmp_path / "book.txt", n_sentences=300, seed=7)
    opts = PrepareOptions(vocab_size=200, byte_fallback=False, heldout_fraction=0.05)
    prepare([str(text)], tmp_path / "prepared", opts, progress=False, log=lambda *_: None)
    run = tmp_path / "run"  # "shared storage": both nodes read and write it
    port = free_port()
    node = torchrun() + [
        "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
        "--rdzv-id", f"test-{port}",
        "-m", "elmo_pretrain.cli", "train", str(ROOT / "configs" / "tiny.yaml"), "--run-dir", str(run),
        "--set", f"data.path={tmp_path / 'prepared'}", "--set", "train.steps=6",
        "--set", "train.progress=false", "--set", "checkpoint.every_steps=3",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def start() -> subprocess.Popen:
        return subprocess.Popen(
            node, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    # the first node hosts the rendezvous store (as the first machine would); the second
    # joins once it listens, so the two never race to bind the endpoint
    nodes = [start()]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and nodes[0].poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            break
        time.sleep(0.1)
    nodes.append(start())
    try:
        logs = [p.communicate(timeout=240)[0] for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(logs)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    check = [r for r in recs if "ddp_params_identical" in r]
    assert check == [{"step": 6, "ddp_world": 2, "ddp_params_identical": True}]
    st = ckpt.load_checkpoint(ckpt.list_checkpoints(run)[-1])
    assert st["world_size"] == 2 and st["step"] == 6 and len(st["rng"]["torch"]) == 2
    shutil.rmtree(run)
