"""AllenNLP's parameter names for :class:`elmo_service.Elmo`, both ways.

A model that held ``allennlp.modules.elmo.Elmo`` saved keys such as::

    _elmo_lstm._token_embedder._char_embedding_weights          [262, d]
    _elmo_lstm._token_embedder.char_conv_0.weight               [n, d, w]
    _elmo_lstm._token_embedder._highways._layers.0.weight       [2F, F]  rows [transform ; -carry]
    _elmo_lstm._token_embedder._projection.weight               [P, F]
    _elmo_lstm._elmo_lstm.forward_layer_0.input_linearity.weight    [4C, P]  gates (i, f, g, o)
    _elmo_lstm._elmo_lstm.forward_layer_0.state_linearity.weight    [4C, P]
    _elmo_lstm._elmo_lstm.forward_layer_0.state_linearity.bias      [4C]
    _elmo_lstm._elmo_lstm.forward_layer_0.state_projection.weight   [P, C]
    _elmo_lstm._word_embedding.weight                           (vocab_to_cache)
    scalar_mix_0.gamma                                          [1]
    scalar_mix_0.scalar_parameters.0                            [1]  one per layer

This project's ``Elmo`` holds the same numbers as ``_elmo_lstm.token_encoder.*``,
``_elmo_lstm.{forward,backward}_layers.k.{w_ih,w_hh,w_proj}`` (gates (i, f, o, g),
the bias on ``w_ih``, the highway's carry half not negated), ``_word_embedding.weight``,
``scalar_mix_k.scalars [L+1]`` and ``scalar_mix_k.gamma []``. The maps are exact
(permutations and sign flips): :func:`from_allennlp` runs as ``Elmo``'s
``load_state_dict`` pre-hook, so an AllenNLP checkpoint loads strictly, and
:func:`to_allennlp` turns any state dict holding our ``Elmo`` into AllenNLP's names.
"""

from __future__ import annotations

import re
from collections.abc import MutableMapping

import torch
from torch import Tensor, nn

from elmo_service.bilm.model import N_CHAR_IDS

ENC = "_elmo_lstm._token_embedder."
LSTM = "_elmo_lstm._elmo_lstm."
_MIX = re.compile(r"scalar_mix_(\d+)\.scalar_parameters\.(\d+)$")
_CELL = re.compile(r"(forward|backward)_layer_(\d+)\.(\w+)\.(weight|bias)$")
_CELL_OURS = re.compile(r"(forward|backward)_layers\.(\d+)\.(w_ih|w_hh|w_proj)\.(weight|bias)$")


def _swap_g_o(w: Tensor) -> Tensor:
    """Gate blocks (i, f, g, o) <-> (i, f, o, g): the same swap both ways."""
    i, f, a, b = w.chunk(4, dim=0)
    return torch.cat([i, f, b, a])


def _negate_carry(w: Tensor) -> Tensor:
    """AllenNLP's highway gate is ``sigmoid(-carry)`` of ours: rows [t ; c] <-> [t ; -c]."""
    n = w.shape[0] // 2
    return torch.cat([w[:n], -w[n:]])


def is_allennlp(state_dict: MutableMapping[str, Tensor], prefix: str = "") -> bool:
    """Whether ``state_dict`` holds an AllenNLP ``Elmo``'s keys under ``prefix``."""
    heads = (prefix + ENC, prefix + LSTM, prefix + "_elmo_lstm._word_embedding.")
    return any(k.startswith(heads) or _MIX.match(k[len(prefix) :]) for k in state_dict)


def from_allennlp(state_dict: MutableMapping[str, Tensor], prefix: str = "") -> None:
    """Rename, in place, the AllenNLP ``Elmo`` keys under ``prefix`` to ours.

    Keys already in our names (any earlier version of this project) are left alone."""
    ours = prefix + "_elmo_lstm."
    mixes: dict[int, dict[int, Tensor]] = {}
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rest = key[len(prefix) :]
        mix = _MIX.match(rest)
        if mix:
            mixes.setdefault(int(mix[1]), {})[int(mix[2])] = state_dict.pop(key)
        elif rest.startswith("scalar_mix_") and rest.endswith(".gamma"):
            state_dict[key] = state_dict[key].reshape(())  # AllenNLP: shape [1]
        elif rest == "_elmo_lstm._word_embedding.weight":
            state_dict[prefix + "_word_embedding.weight"] = state_dict.pop(key)
        elif rest.startswith(ENC):
            state_dict[ours + "token_encoder." + _encoder_name(rest[len(ENC) :])] = _encoder_value(
                rest[len(ENC) :], state_dict.pop(key)
            )
        elif rest.startswith(LSTM):
            cell = _CELL.match(rest[len(LSTM) :])
            if cell is None:
                continue  # unknown: strict loading names it
            d, k, lin, kind = cell.groups()
            value = state_dict.pop(key)
            name = {"input_linearity": "w_ih", "state_projection": "w_proj"}.get(lin, "w_hh")
            if lin == "state_linearity" and kind == "bias":
                name = "w_ih"  # ours carries the gate bias on the input matmul
            if lin != "state_projection":
                value = _swap_g_o(value)
            state_dict[f"{ours}{d}_layers.{k}.{name}.{kind}"] = value
    for k, params in mixes.items():
        state_dict[f"{prefix}scalar_mix_{k}.scalars"] = torch.cat(
            [params[i].reshape(1) for i in sorted(params)]
        )


def _encoder_name(rest: str) -> str:
    if rest == "_char_embedding_weights":
        return "char_embed.weight"
    if rest.startswith("char_conv_"):
        i, kind = rest[len("char_conv_") :].split(".")
        return f"convs.{i}.{kind}"
    if rest.startswith("_highways._layers."):
        return "highways." + rest[len("_highways._layers.") :]
    return rest.removeprefix("_")  # _projection.weight -> projection.weight


def _encoder_value(rest: str, value: Tensor) -> Tensor:
    if rest == "_char_embedding_weights":
        # from a 262-row file AllenNLP keeps a 263rd row that no id reaches (ids stop at 261)
        return value[:N_CHAR_IDS]
    if rest.startswith("_highways."):
        return _negate_carry(value)
    return value


class CarriedState:
    """``elmo._elmo_lstm._elmo_lstm`` as AllenNLP's tests and users reach it (there, the
    ``ElmoLstm`` that carries the state): its ``reset_states`` is :meth:`Elmo.reset_states`."""

    def __init__(self, elmo) -> None:
        self._elmo = elmo

    def reset_states(self, mask: Tensor | None = None) -> None:
        self._elmo.reset_states(mask)


def allennlp_keys(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """``load_state_dict`` pre-hook: AllenNLP's ``Elmo`` keys under ``prefix`` -> ours
    (above); keys in our names pass unchanged."""
    if module._module is None and is_allennlp(state_dict, prefix):
        from_allennlp(state_dict, prefix)


def to_allennlp(state_dict: MutableMapping[str, Tensor]) -> dict[str, Tensor]:
    """A copy of ``state_dict`` (a whole model's, or one ``Elmo``'s) with every
    ``elmo_service.Elmo`` inside it under AllenNLP's names: what the same model
    built with ``allennlp.modules.elmo.Elmo`` loads (``strict=True``)."""
    prefixes = {
        k[: -len("_elmo_lstm.token_encoder.char_embed.weight")]
        for k in state_dict
        if k.endswith("_elmo_lstm.token_encoder.char_embed.weight")
    }
    out: dict[str, Tensor] = {}
    for key, value in state_dict.items():
        prefix = next((p for p in prefixes if key.startswith(p)), None)
        if prefix is None:
            out[key] = value
            continue
        rest = key[len(prefix) :]
        if rest.startswith("_elmo_lstm.token_encoder."):
            name = rest[len("_elmo_lstm.token_encoder.") :]
            if name == "char_embed.weight":
                out[prefix + ENC + "_char_embedding_weights"] = value
            elif name.startswith("convs."):
                _, i, kind = name.split(".")
                out[f"{prefix}{ENC}char_conv_{i}.{kind}"] = value
            elif name.startswith("highways."):
                out[prefix + ENC + "_highways._layers." + name[len("highways.") :]] = _negate_carry(
                    value
                )
            else:
                out[prefix + ENC + "_" + name] = value
        elif cell := _CELL_OURS.match(rest[len("_elmo_lstm.") :]):
            d, k, name, kind = cell.groups()
            cell_key = f"{prefix}{LSTM}{d}_layer_{k}."
            if name == "w_proj":
                out[cell_key + "state_projection.weight"] = value
            elif name == "w_hh":
                out[cell_key + "state_linearity.weight"] = _swap_g_o(value)
            elif kind == "bias":
                out[cell_key + "state_linearity.bias"] = _swap_g_o(value)
            else:
                out[cell_key + "input_linearity.weight"] = _swap_g_o(value)
        elif rest == "_word_embedding.weight":
            out[prefix + "_elmo_lstm._word_embedding.weight"] = value
        elif rest.startswith("scalar_mix_") and rest.endswith(".scalars"):
            head = rest[: -len("scalars")]
            for i, v in enumerate(value):
                out[f"{prefix}{head}scalar_parameters.{i}"] = v.reshape(1).clone()
        elif rest.startswith("scalar_mix_") and rest.endswith(".gamma"):
            out[key] = value.reshape(1)
        else:
            out[key] = value
    return out
