"""The optimizer and its learning-rate schedule, as the trainer builds them from ``optim``."""

from __future__ import annotations

import math

import torch

from pretrain.config import OptimConfig


def lr_at(step: int, o: OptimConfig, total: int) -> float:
    """Linear warm-up to ``lr``, then the configured decay over the remaining steps.

    ``plateau`` is constant here; the trainer scales it after each epoch's evaluation.
    """
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.decay in ("none", "plateau"):
        return o.lr
    if o.decay == "inverse_sqrt":
        w = max(1, o.warmup_steps)
        return o.lr * math.sqrt(w / max(step + 1, w))
    progress = min(1.0, (step - o.warmup_steps) / max(1, total - o.warmup_steps))
    if o.decay == "linear":
        return o.lr * (1 - (1 - o.min_lr_ratio) * progress)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(params, o: OptimConfig) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if o.name == "sgd":  # Kim et al. 2016: plain SGD, lr 1, halved on plateaus
        return torch.optim.SGD(params, lr=o.lr, weight_decay=o.weight_decay)
    if o.name == "adagrad":  # bilm-tf: lr 0.2, initial accumulator 1.0
        return torch.optim.Adagrad(
            params, lr=o.lr, initial_accumulator_value=o.adagrad_init_acc, eps=1e-10
        )
    cls = torch.optim.AdamW if o.name == "adamw" else torch.optim.Adam
    return cls(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
