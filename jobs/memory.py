"""How much memory a training job needs, estimated from its config, and the bound on it.

A job is refused at submit (422 naming the field) when its estimate exceeds
``ELMO_JOBS_MAX_MEMORY`` (default: ``ELMO_JOBS_MEMORY_FRACTION`` of this
machine's memory, the smaller of physical RAM and a cgroup limit), and a
worker refuses it again before training (its own machine may be smaller).

The estimate, in bytes, fp32 master weights whatever the compute precision:

* state: parameters x (4 weights + 4 gradients + optimizer: 8 for adam/adamw
  moments, 4 for adagrad's accumulator). Parameters: the char CNN
  (embedding, convolutions, highway ``2F x F`` each, projection ``F x P``),
  ``2 x n_layers`` LSTM layers (``4C x 2P`` input and recurrent weights,
  ``4C`` bias, ``C x P`` projection) and the softmax (``V x P``);
* activations kept for the backward pass, per batch of ``T`` tokens
  (``data.tokens_per_batch``; in stream mode ``data.rows x data.unroll``): per LSTM layer and direction ``6C + 2P``
  floats a token (gates, cell, its tanh, output, projection), the char CNN's
  ``max_chars x F`` conv outputs (and activations) per distinct token, the
  softmax's logits and their gradients (``V``, ``n_samples + 1`` or the
  adaptive head per token and direction);
* a fixed ``RUNTIME_BYTES`` for the interpreter, torch and the data.

It is an estimate (allocator slack, compile caches and evaluation are not in
it): the default fraction leaves room for them. Which field to name: the one
whose reset to its default shrinks the estimate most (``lstm_dim=1e7`` names
``config.model.lstm_dim``, a huge batch ``config.data.tokens_per_batch``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elmo_service.errors import ConfigError

RUNTIME_BYTES = 512 * 2**20  # python + torch + the corpus index
CHAR_VOCAB = 262  # bilm-tf char ids: 256 bytes + markers + padding
DEFAULT_VOCAB = 16000  # prepare's default --vocab-size

# fields a job may set that the estimate depends on, with what a reset means
_MODEL_FIELDS = ("lstm_dim", "projection_dim", "n_layers", "filters", "n_highway", "char_dim",
                 "max_chars_per_token")  # fmt: skip
_OTHER_FIELDS = (("data", "tokens_per_batch"), ("data", "rows"), ("data", "unroll"),
                 ("softmax", "n_samples"), ("softmax", "kind"))  # fmt: skip


@dataclass(frozen=True)
class Estimate:
    parameters: int
    state_bytes: int
    activation_bytes: int

    @property
    def total(self) -> int:
        return self.state_bytes + self.activation_bytes + RUNTIME_BYTES


def estimate(cfg: dict[str, Any], vocab: int) -> Estimate:
    """``cfg``: a resolved training config (``TrainConfig.to_dict()``); ``vocab``: softmax size."""
    m, d, s = cfg["model"], cfg["data"], cfg["softmax"]
    P, C, L = int(m["projection_dim"]), int(m["lstm_dim"]), int(m["n_layers"])
    D, K, H = int(m["char_dim"]), int(m["max_chars_per_token"]), int(m["n_highway"])
    filters = [(int(w), int(n)) for w, n in m["filters"]]
    F = sum(n for _, n in filters)
    V = int(vocab)
    # tokens a step (per process): stream windows are rows x unroll, whatever tokens_per_batch says
    T = (
        int(d["rows"]) * int(d["unroll"])
        if d.get("mode") == "stream"
        else int(d["tokens_per_batch"])
    )
    dirs = 1 if cfg["train"].get("directions") == "forward" else 2

    cnn = CHAR_VOCAB * D + sum(n * w * D + n for w, n in filters) + H * (2 * F * F + 2 * F)
    cnn += F * P + P
    lstm = 2 * L * (4 * C * 2 * P + 4 * C + C * P)  # both directions are built
    softmax = V * P + V
    params = cnn + lstm + softmax
    opt = 4 if cfg["optim"]["name"] == "adagrad" else 8
    state = params * (4 + 4 + opt)

    uniq = min(T, V)  # the char CNN runs once per distinct token of the batch
    act = T * dirs * L * (6 * C + 2 * P)
    act += uniq * (2 * K * F + 3 * H * F + P)
    if s["kind"] == "full":
        classes = V
    elif s["kind"] == "sampled":
        classes = min(int(s["n_samples"]), V) + 1
    else:
        cutoffs = [c for c in s.get("cutoffs", []) if c < V]
        classes = (cutoffs[0] if cutoffs else V) + len(cutoffs)
    act += 2 * T * dirs * classes
    return Estimate(parameters=params, state_bytes=state, activation_bytes=4 * act)


def machine_memory() -> int:
    """Bytes this machine (or its container's cgroup) can give a process."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for f in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = Path(f).read_text().strip()
        except OSError:
            continue
        if raw.isdigit():
            total = min(total, int(raw))
    return total


def memory_limit(max_memory: int | None, fraction: float) -> int:
    return int(max_memory) if max_memory else int(fraction * machine_memory())


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_memory(
    cfg: dict[str, Any], vocab: int, limit: int, vocab_field: str = "prepare.vocab_size"
) -> Estimate:
    """Raise ConfigError naming the dominating field when the estimate exceeds ``limit``."""
    from elmo_pretrain.config import TrainConfig

    est = estimate(cfg, vocab)
    if est.total <= limit:
        return est
    defaults = TrainConfig().to_dict()
    shrink: dict[str, int] = {}
    for key in _MODEL_FIELDS:
        alt = {**cfg, "model": {**cfg["model"], key: defaults["model"][key]}}
        shrink[f"config.model.{key}"] = est.total - estimate(alt, vocab).total
    for sec, key in _OTHER_FIELDS:
        alt = {**cfg, sec: {**cfg[sec], key: defaults[sec][key]}}
        shrink[f"config.{sec}.{key}"] = est.total - estimate(alt, vocab).total
    shrink[vocab_field] = est.total - estimate(cfg, min(vocab, DEFAULT_VOCAB)).total
    field, gain = max(shrink.items(), key=lambda kv: kv[1])
    if gain <= 0:
        field = "config"
    raise ConfigError(
        f"{field}: this job needs about {_gib(est.total)} of memory ({est.parameters:,} parameters: "
        f"{_gib(est.state_bytes)} weights, gradients and optimizer state; {_gib(est.activation_bytes)} "
        f"activations a batch), more than a worker may use ({_gib(limit)}, ELMO_JOBS_MAX_MEMORY); "
        f"{field.rsplit('.', 1)[-1]} weighs most",
        field=field,
    )
