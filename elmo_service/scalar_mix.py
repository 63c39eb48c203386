"""ELMo's task-weighted mix of the biLM layers.

Standard (Peters et al. 2018, eq. 1), over the L+1 layers ``h_j [.., 2P]``::

    mix = gamma * sum_j softmax(s)_j * h_j

Per direction, with 2L+1 weights ``(s_0, f_1..f_L, b_1..b_L)`` softmax-normalised
together, layer 0 being the token vector ``e``::

    mix = gamma * [ w_0 e + sum_j w_fj h_fwd_j ; w_0 e + sum_j w_bj h_bwd_j ]

``layer_norm`` normalises each layer before mixing, as AllenNLP's
``do_layer_norm`` does, but per sentence (AllenNLP normalises over the whole
batch, which makes a sentence's vector depend on its batch mates).

Two forms of one formula: :class:`ScalarMix`, a torch module whose weights train
(the task probes), and :func:`apply_mix`, numpy on one sentence's layers, which
the library and the HTTP API apply to embedded (or cached) layers.
``tests/elmo_service/test_scalar_mix.py`` holds them to each other.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn

from elmo_service.errors import ConfigError


def expected_weights(n_layers: int, per_direction: bool) -> int:
    """Number of mix weights for a model with ``n_layers`` output layers (L+1)."""
    return 2 * n_layers - 1 if per_direction else n_layers


# Bounds that keep a mix finite in float32 for any real layer values. Softmax is
# shift-invariant, so weights beyond +-MAX_MIX_WEIGHT say nothing a bounded weight
# cannot (exp(-100) is already 0 in float32), while 1e308 becomes inf in float32
# and inf - inf = NaN. gamma scales vectors whose entries are O(1..100): 1e4 keeps
# every product far below float32's 3.4e38 (float16 output is checked on the result).
MAX_MIX_WEIGHT = 1e4
MAX_GAMMA = 1e4


TASK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_task_name(name: str) -> str:
    """A task name is also a file name (``tasks/NAME.json``) and a URL segment."""
    if not TASK_NAME.match(name):
        raise ConfigError(
            "task names are 1-64 characters: letters, digits, '_', '.', '-', starting with a letter or digit",
            field="name",
        )
    return name


@dataclass
class MixSpec:
    """Mix weights as stored in a task file: unnormalised ``s`` and ``gamma``."""

    weights: list[float]
    gamma: float = 1.0
    per_direction: bool = False
    layer_norm: bool = False
    meta: dict = field(default_factory=dict)

    def validate(
        self, n_layers: int, field_name: str = "mix", gamma_field: str | None = None
    ) -> MixSpec:
        """Raise ConfigError naming ``field_name`` (``field_name[i]`` for one weight) or
        ``gamma_field`` (default ``field_name``) unless the mix is usable and stays finite."""
        want = expected_weights(n_layers, self.per_direction)
        if len(self.weights) != want:
            kind = "per-direction " if self.per_direction else ""
            raise ConfigError(
                f"{kind}mix needs {want} weights for a model with {n_layers} output layers, "
                f"got {len(self.weights)}",
                field=field_name,
            )
        for i, w in enumerate(self.weights):
            if not _finite(w) or abs(w) > MAX_MIX_WEIGHT:
                raise ConfigError(
                    f"mix weight {i} is {w!r}: weights must be finite and within "
                    f"+-{MAX_MIX_WEIGHT:g} (softmax is shift-invariant; larger values add nothing)",
                    field=f"{field_name}[{i}]",
                )
        if not _finite(self.gamma) or abs(self.gamma) > MAX_GAMMA:
            raise ConfigError(
                f"gamma is {self.gamma!r}: it must be finite and within +-{MAX_GAMMA:g}",
                field=gamma_field or field_name,
            )
        return self

    def to_dict(self) -> dict:
        return {
            "weights": list(map(float, self.weights)),
            "gamma": float(self.gamma),
            "per_direction": self.per_direction,
            "layer_norm": self.layer_norm,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: dict) -> MixSpec:
        try:
            return cls(
                weights=[float(w) for w in d["weights"]],
                gamma=float(d.get("gamma", 1.0)),
                per_direction=bool(d.get("per_direction", False)),
                layer_norm=bool(d.get("layer_norm", False)),
                meta=dict(d.get("meta", {})),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"bad mix spec: {e}", field="mix") from e

    @classmethod
    def average(cls, n_layers: int) -> MixSpec:
        return cls(weights=[0.0] * n_layers)


def _finite(x: float) -> bool:
    try:
        return math.isfinite(x)
    except TypeError:
        return False


def _masked_layer_norm(h: Tensor, mask: Tensor | None, eps: float = 1e-12) -> Tensor:
    """Normalise ``h [B, T, D]`` per sentence over its real positions."""
    if mask is None:
        mask = torch.ones(h.shape[:2], dtype=h.dtype, device=h.device)
    m = mask.to(h.dtype).unsqueeze(-1)  # [B, T, 1]
    n = (m.sum(dim=(1, 2)) * h.shape[-1]).clamp_min(1.0)  # [B]
    mean = (h * m).sum(dim=(1, 2)) / n
    var = (((h - mean[:, None, None]) * m) ** 2).sum(dim=(1, 2)) / n
    return (h - mean[:, None, None]) / torch.sqrt(var[:, None, None] + eps)


class ScalarMix(nn.Module):
    """Learnable (or fixed) mix of ``[L+1, ..., 2P]`` layers -> ``[..., 2P]``."""

    def __init__(
        self,
        n_layers: int,
        per_direction: bool = False,
        layer_norm: bool = False,
        weights: Sequence[float] | None = None,
        gamma: float = 1.0,
        trainable: bool = True,
    ) -> None:
        super().__init__()
        self.n_layers, self.per_direction, self.layer_norm = n_layers, per_direction, layer_norm
        n = expected_weights(n_layers, per_direction)
        init = [0.0] * n if weights is None else list(weights)
        MixSpec(init, gamma, per_direction).validate(n_layers)
        self.scalars = nn.Parameter(
            torch.tensor(init, dtype=torch.float32), requires_grad=trainable
        )
        self.gamma = nn.Parameter(torch.tensor(float(gamma)), requires_grad=trainable)

    @classmethod
    def from_spec(cls, spec: MixSpec, n_layers: int, trainable: bool = False) -> ScalarMix:
        spec.validate(n_layers)
        return cls(
            n_layers, spec.per_direction, spec.layer_norm, spec.weights, spec.gamma, trainable
        )

    def to_spec(self, **meta) -> MixSpec:
        return MixSpec(
            weights=self.scalars.detach().cpu().tolist(),
            gamma=float(self.gamma.detach()),
            per_direction=self.per_direction,
            layer_norm=self.layer_norm,
            meta=meta,
        )

    def normalized_weights(self) -> Tensor:
        return torch.softmax(self.scalars, dim=0)

    def forward(self, layers: Tensor, mask: Tensor | None = None) -> Tensor:
        """``layers [L+1, B, T, 2P]`` (or ``[L+1, T, 2P]``), ``mask [B, T]`` -> ``[B, T, 2P]``."""
        if layers.shape[0] != self.n_layers:
            raise ConfigError(
                f"mix was built for {self.n_layers} layers, got {layers.shape[0]}", field="mix"
            )
        unbatched = layers.dim() == 3
        if unbatched:
            layers = layers.unsqueeze(1)
            mask = None if mask is None else mask.unsqueeze(0)
        if self.layer_norm:
            layers = torch.stack([_masked_layer_norm(h, mask) for h in layers])
        w = self.normalized_weights().to(layers.dtype)
        if not self.per_direction:
            out = torch.einsum("l,l...->...", w, layers)
        else:
            p = layers.shape[-1] // 2
            nl = self.n_layers - 1
            tok = layers[0, ..., :p]  # e (both halves of layer 0 are equal)
            fwd = torch.einsum("l,l...->...", w[1 : 1 + nl], layers[1:, ..., :p])
            bwd = torch.einsum("l,l...->...", w[1 + nl :], layers[1:, ..., p:])
            out = torch.cat([w[0] * tok + fwd, w[0] * tok + bwd], dim=-1)
        out = self.gamma.to(out.dtype) * out
        return out.squeeze(0) if unbatched else out


def softmax(x: Sequence[float]) -> np.ndarray:
    """Stable softmax: shifted by the max in float64, so any finite weights give finite
    probabilities (a float32 cast first would turn 1e308 into inf, and inf - inf into NaN)."""
    a = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):  # a gap beyond float64 is -inf: exp gives 0, as it should
        e = np.exp(a - a.max())
    return (e / e.sum()).astype(np.float32)


def _layer_norm_np(h: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """Normalise one sentence's layer ``[T, D]`` over all its positions and features."""
    if h.size == 0:
        return h
    mean = h.mean(dtype=np.float64)
    var = ((h - mean) ** 2).mean(dtype=np.float64)
    return ((h - mean) / np.sqrt(var + eps)).astype(np.float32)


def apply_mix(layers: np.ndarray, spec: MixSpec) -> np.ndarray:
    """One sentence's ``[L+1, T, D]`` -> ``[T, D]`` float32: ``gamma * sum_j softmax(s)_j h_j``
    (per direction if the spec says). Overflow gives inf, never an exception: callers
    that must answer finite values check the result."""
    n = layers.shape[0]
    spec.validate(n)
    if spec.layer_norm:
        layers = np.stack([_layer_norm_np(h) for h in layers])
    w = softmax(spec.weights)
    if not spec.per_direction:
        out = np.tensordot(w, layers, axes=1)
    else:
        p = layers.shape[-1] // 2
        nl = n - 1
        tok = layers[0, :, :p]
        fwd = np.tensordot(w[1 : 1 + nl], layers[1:, :, :p], axes=1)
        bwd = np.tensordot(w[1 + nl :], layers[1:, :, p:], axes=1)
        out = np.concatenate([w[0] * tok + fwd, w[0] * tok + bwd], axis=-1)
    with np.errstate(over="ignore", invalid="ignore"):
        return (np.float32(spec.gamma) * out).astype(np.float32, copy=False)
