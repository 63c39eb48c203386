"""A training run's state: what a checkpoint holds and ``--resume`` restores.

The weights, the optimizer and the loss scaler; where the run is in its data (epoch, batch)
and its schedule (step, lr scale, best held-out figure); the stream mode's carried LSTM
state; every rank's random streams. ``TrainState.checkpoint`` writes it as a dict of
tensors and plain values (``pretrain/checkpoint.py`` saves it hashed and atomic, loaded
with ``weights_only=True``), ``TrainState.resume`` reads the latest verified one back, so a
resumed run takes the steps an uninterrupted one would have (same losses in fp32 eager;
``tests/pretrain/test_train.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elmo_pretrain import ddp
from elmo_pretrain.checkpoint import checkpoint_status, list_checkpoints, load_latest
from elmo_pretrain.config import TrainConfig, config_hash
from elmo_pretrain.lm import LanguageModel
from elmo_pretrain.optim import lr_at
from elmo_pretrain.run_checks import RunDirError


@dataclass(frozen=True)
class Placement:
    """Where this process trains: its rank of ``world`` and its device."""

    rank: int
    world: int
    device: torch.device


@dataclass
class TrainState:
    model: LanguageModel
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler  # fp16 loss scaling; a disabled one (a no-op) elsewhere
    precision: str  # what the steps run in: fp32, bf16, fp16
    step: int = 0  # optimizer steps taken, across resumes
    epoch: int = 0
    index: int = 0  # the next batch of this epoch
    tokens_seen: int = 0
    elapsed: float = 0.0  # training seconds, across resumes
    lr_scale: float = 1.0  # plateau decay and skipped non-finite steps cut the lr
    best_eval: float | None = None  # plateau decay: the best held-out perplexity so far
    lstm_state: Any = None  # stream mode: the carried LSTM state (None: zeros)

    def lr(self, cfg: TrainConfig, step: int) -> float:
        return lr_at(step, cfg.optim, cfg.train.steps) * self.lr_scale

    def checkpoint(self, cfg: TrainConfig, at: Placement) -> dict[str, Any]:
        """The checkpoint's contents. Collective under DDP (every rank's RNG and carried
        state are gathered): every rank calls it, rank 0 saves it."""
        st: dict[str, Any] = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": {
                "step": self.step,
                "lr": self.lr(cfg, max(self.step - 1, 0)),
                "lr_scale": self.lr_scale,
                "best_eval": -1.0 if self.best_eval is None else self.best_eval,
            },
            "rng": {"torch": ddp.gather_rng_states(at.world)},
            "data": {"epoch": self.epoch, "index": self.index, "mode": cfg.data.mode},
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "elapsed": self.elapsed,
            "world_size": at.world,
            "config_hash": config_hash(cfg),
            "precision": self.precision,
        }
        if at.device.type == "cuda":
            st["rng"]["cuda"] = torch.cuda.get_rng_state(at.device)
        if self.scaler.is_enabled():
            st["scaler"] = self.scaler.state_dict()
        if cfg.data.mode == "stream":
            m = cfg.model
            st["lstm_state"] = ddp.gather_stream_state(
                self.lstm_state,
                self.model.direction_names,
                m.n_layers,
                (m.projection_dim, m.lstm_dim),
                cfg.data.rows,
                at.device,
                at.world,
            )
        return st

    def resume(self, run_dir: Path, cfg: TrainConfig, at: Placement, log) -> None:
        """Continue from the run's latest verified checkpoint (or from step 0 if none)."""
        say = log if at.rank == 0 else lambda *_: None
        found = load_latest(run_dir, log=say)
        if found is None:
            say(f"--resume: no checkpoint in {run_dir}; starting from step 0")
            return
        path, st = found
        self._keep_precision(cfg, st.get("precision"), at, say)
        self.model.load_state_dict(st["model"])
        self.optimizer.load_state_dict(st["optimizer"])
        self.step, self.tokens_seen = int(st["step"]), int(st["tokens_seen"])
        self.elapsed = float(st["elapsed"])
        self.epoch, self.index = int(st["data"]["epoch"]), int(st["data"]["index"])
        saved_mode = st["data"].get("mode", "sentences")
        if saved_mode != cfg.data.mode:
            raise RunDirError(
                f"{path.name} was written by a data.mode={saved_mode} run; this is data.mode={cfg.data.mode}",
                field="data.mode",
            )
        sched = st.get("scheduler", {})
        self.lr_scale = float(sched.get("lr_scale", 1.0))
        best = float(sched.get("best_eval", -1.0))
        self.best_eval = None if best < 0 else best
        same_world = int(st["world_size"]) == at.world
        if cfg.data.mode == "stream" and "lstm_state" in st:
            if same_world:
                self.lstm_state = ddp.scatter_stream_state(
                    st["lstm_state"], at.rank, cfg.data.rows, at.device
                )
            else:
                say("warning: the world size changed; the carried LSTM state restarts from zeros")
        if same_world:
            torch.set_rng_state(st["rng"]["torch"][at.rank])
        else:
            say(
                f"warning: checkpoint was written by {st['world_size']} processes, now {at.world}: data order and RNG differ from an uninterrupted run"
            )
        if "cuda" in st["rng"] and at.device.type == "cuda":
            torch.cuda.set_rng_state(st["rng"]["cuda"], at.device)
        if "scaler" in st:
            self.scaler.load_state_dict(st["scaler"])  # a no-op when it is disabled
        say(
            f"resumed from {path.name}: step {self.step}, epoch {self.epoch}, batch {self.index}, {self.tokens_seen} tokens seen"
        )

    def _keep_precision(self, cfg: TrainConfig, saved: str | None, at: Placement, say) -> None:
        """``precision: auto`` on resume: a run that trained in fp32 stays in fp32, even where
        auto now picks bf16 (a faster machine), so its arithmetic does not change mid-run. A
        reduced-precision run moved to a machine without it continues in fp32 (more exact,
        and bf16 emulated on an AVX2 CPU would be many times slower)."""
        if cfg.train.precision != "auto" or saved is None or saved == self.precision:
            return
        if saved == "fp32":
            say(
                f"precision auto: this run trained in fp32, so it goes on in fp32 "
                f"(auto picks {self.precision} on this machine for new runs)"
            )
            self.precision = "fp32"
            self.scaler = torch.amp.GradScaler(at.device.type, enabled=False)
        else:
            say(f"precision auto: this run trained in {saved}; here it goes on in {self.precision}")


def last_good(run_dir: Path) -> str:
    """Which checkpoint a resume would start from, in words (for the refusals)."""
    ckpts = [
        p for p in list_checkpoints(run_dir) if checkpoint_status(p) in ("verified", "unhashed")
    ]
    return (
        f"the last good checkpoint is {ckpts[-1].name}"
        if ckpts
        else "no checkpoint was written yet"
    )
