"""The training set-up's steps that are not one line each (``Trainer.__init__`` reads as
a list of them): where the process trains, the corpus, the run folder, compilation."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch._dynamo

from elmo_pretrain import ddp
from elmo_pretrain.config import TrainConfig, config_hash, dump_config
from elmo_pretrain.data import Corpus
from elmo_pretrain.lm import LanguageModel
from elmo_pretrain.run_dir import CONFIG_FILE, RUN_FILE, RUN_STATE
from elmo_pretrain.train_state import Placement
from elmo_service.atomic import write_json, write_text
from elmo_service.runtime import pick_device, set_threads


def place(cfg: TrainConfig) -> Placement:
    """This process's rank, its device (under DDP on CUDA: its local GPU) and threads; the
    process group formed (a no-op for one process)."""
    rank, world, local_rank = ddp.dist_env()
    device = pick_device(cfg.train.device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    set_threads(cfg.train.threads or max(1, (os.cpu_count() or 1) // world))
    ddp.init_group(device, world)
    return Placement(rank, world, device)


def open_corpus(cfg: TrainConfig) -> Corpus:
    """The prepared corpus, its held-out shards opened (and validated) now: a bad or missing
    one fails here, not after every step at the end-of-run evaluation."""
    corpus = Corpus(cfg.data.path)
    if "heldout" in corpus.manifest["shards"]:
        corpus.split("heldout")
    return corpus


def init_run_dir(run_dir: Path, cfg: TrainConfig, corpus: Corpus, world: int, mode: str) -> None:
    """Rank 0: the run folder's record (``run.json``, ``config.yaml``); a restart (``--force``)
    first clears the run's state."""
    if mode == "restart":
        for p in (run_dir / name for name in RUN_STATE):
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    info = {
        "config_hash": config_hash(cfg),
        "config": cfg.to_dict(),
        "corpus": {
            "path": str(Path(cfg.data.path).resolve()),
            "params_hash": corpus.manifest.get("params_hash"),
        },
        "world_size": world,
    }
    write_json(run_dir / RUN_FILE, info)
    write_text(run_dir / CONFIG_FILE, dump_config(cfg))


def wrap(model: LanguageModel, at: Placement) -> torch.nn.Module:
    """What the loop calls: the model, or under DDP the model wrapped to average gradients."""
    if at.world == 1:
        return model
    ids = [at.device.index] if at.device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)


def compile_model(model: LanguageModel) -> None:
    """``train.compile``: small graphs, compiled once each; sizes that vary (U, B, N) turn
    dynamic on their second value."""
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    model.encode_fn = torch.compile(model.bilm.token_encoder.forward)
    model.bilm.use_compiled_steps()  # this model only, not a process-wide swap
    model.loss_fn = torch.compile(model.softmax.loss)


def data_summary(cfg: TrainConfig, batcher, stream: bool, epoch: int) -> str:
    c = cfg.data
    if stream:
        return (
            f"stream mode: {c.rows} rows x {batcher.row_len} tokens per rank, {c.unroll}-token "
            f"windows, {batcher.n_windows} windows/epoch"
        )
    return (
        f"{len(batcher.eligible)} train sentences ({batcher.n_skipped} longer than "
        f"{c.max_tokens} tokens skipped), {len(batcher.plan(epoch))} batches/epoch/rank"
    )
