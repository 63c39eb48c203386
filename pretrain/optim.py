"""The optimizer, its learning-rate schedule and the starting weights, as the trainer builds
them from ``optim`` (and the model from ``model`` / ``softmax``)."""

from __future__ import annotations

import math

import torch

from elmo_pretrain.config import OptimConfig, TrainConfig
from elmo_pretrain.data import Corpus
from elmo_pretrain.lm import LanguageModel


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


def build_model(cfg: TrainConfig, corpus: Corpus) -> LanguageModel:
    table = corpus.char_table(cfg.model.max_chars_per_token)
    lm = LanguageModel(cfg.model, cfg.softmax, corpus.softmax_size, table, cfg.train.directions)
    lm.loss_reduction = cfg.optim.loss_reduction
    if cfg.optim.init_range > 0:
        # the PTB literature's init: one small uniform range for every weight and bias, which
        # keeps SGD at lr 1 stable where the modules' own (wider) initialisations diverge
        with torch.no_grad():
            for p in lm.parameters():
                if p.requires_grad:  # not a frozen identity projection (model.lstm_projection)
                    p.uniform_(-cfg.optim.init_range, cfg.optim.init_range)
            for m in lm.modules():  # an embedding's padding row stays zero, as it is built
                if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None:
                    m.weight[m.padding_idx].zero_()
    if cfg.optim.highway_gate_bias is not None:
        with torch.no_grad():
            for hw in lm.bilm.token_encoder.highways:
                # rows [transform ; gate]: the gate's half (Kim et al. add -2 as a constant;
                # with a trained bias that is the same function, started at -2)
                hw.bias[hw.out_features // 2 :] += cfg.optim.highway_gate_bias
    return lm
