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
from torch import Tensor

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


# where AllenNLP keeps the parts, relative to the module: (character encoder, LSTM, cached
# word table) for its Elmo, its _ElmoBiLm (the encoder and LSTM one level up) and its
# _ElmoCharacterEncoder (the encoder itself); and where ours keeps its biLM
ELMO_LAYOUT = (ENC, LSTM, "_elmo_lstm._word_embedding.weight", "_elmo_lstm.")
BILM_LAYOUT = ("_token_embedder.", "_elmo_lstm.", "_word_embedding.weight", "_elmo_lstm.")
ENCODER_LAYOUT = ("", None, None, "")
MIXES_ONLY = (None, None, None, None)  # Elmo over a module of the caller's: that module's own


def is_allennlp(
    state_dict: MutableMapping[str, Tensor], prefix: str = "", layout: tuple = ELMO_LAYOUT
) -> bool:
    """Whether ``state_dict`` holds AllenNLP's keys under ``prefix``."""
    enc, lstm, word = (None if x is None else prefix + x for x in layout[:3])
    for k in state_dict:
        if enc is not None and k.startswith(enc) and _encoder_name(k[len(enc) :]) is not None:
            return True
        if lstm is not None and k.startswith(lstm) and _CELL.match(k[len(lstm) :]):
            return True
        if (word is not None and k == word and layout is ELMO_LAYOUT) or _MIX.match(
            k[len(prefix) :]
        ):
            return True
    return False


def from_allennlp(
    state_dict: MutableMapping[str, Tensor], prefix: str = "", layout: tuple = ELMO_LAYOUT
) -> None:
    """Rename, in place, AllenNLP's keys under ``prefix`` to ours (``layout``: where
    AllenNLP's module keeps its parts, ``ELMO_LAYOUT`` for its ``Elmo``).

    Keys already in our names (any earlier version of this project) are left alone."""
    enc, lstm, word, bilm = layout
    ours = prefix + (bilm or "")
    mixes: dict[int, dict[int, Tensor]] = {}
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rest = key[len(prefix) :]
        mix = _MIX.match(rest)
        if mix:
            mixes.setdefault(int(mix[1]), {})[int(mix[2])] = state_dict.pop(key)
        elif rest.startswith("scalar_mix_") and rest.endswith(".gamma"):
            state_dict[key] = state_dict[key].reshape(())  # AllenNLP: shape [1]
        elif word is not None and rest == word:
            state_dict[prefix + "_word_embedding.weight"] = state_dict.pop(key)
        elif (
            enc is not None
            and rest.startswith(enc)
            and (name := _encoder_name(rest[len(enc) :])) is not None
        ):
            value = _encoder_value(rest[len(enc) :], state_dict.pop(key))
            state_dict[ours + "token_encoder." + name] = value
        elif lstm is not None and rest.startswith(lstm):
            cell = _CELL.match(rest[len(lstm) :])
            if cell is None:
                continue  # ours, or unknown: strict loading names it
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


def _encoder_name(rest: str) -> str | None:
    """AllenNLP's character encoder's name -> ours; None for any other."""
    if rest == "_char_embedding_weights":
        return "char_embed.weight"
    if m := re.fullmatch(r"char_conv_(\d+)\.(weight|bias)", rest):
        return f"convs.{m[1]}.{m[2]}"
    if m := re.fullmatch(r"_highways\._layers\.(\d+)\.(weight|bias)", rest):
        return f"highways.{m[1]}.{m[2]}"
    if m := re.fullmatch(r"_projection\.(weight|bias)", rest):
        return f"projection.{m[1]}"
    return None


def _encoder_value(rest: str, value: Tensor) -> Tensor:
    if rest == "_char_embedding_weights":
        # from a 262-row file AllenNLP keeps a 263rd row that no id reaches (ids stop at 261)
        return value[:N_CHAR_IDS]
    if rest.startswith("_highways."):
        return _negate_carry(value)
    return value


class ResetHandle:
    """``elmo._elmo_lstm._elmo_lstm`` as AllenNLP's tests and users reach it (there, the
    ``ElmoLstm`` that carries the state): its ``reset_states`` is :meth:`Elmo.reset_states`."""

    def __init__(self, elmo) -> None:
        self._elmo = elmo

    def reset_states(self, mask: Tensor | None = None) -> None:
        self._elmo.reset_states(mask)


def allennlp_keys(state_dict: dict, prefix: str, layout: tuple) -> None:
    """What a ``load_state_dict`` pre-hook of a module with AllenNLP's ``layout`` does:
    AllenNLP's keys under ``prefix`` -> ours (above); keys in our names pass unchanged."""
    for key in [k for k in state_dict if k.startswith(prefix + "_module.")]:
        # Elmo(module=...) once held the module twice (also as _module): one copy is enough
        value = state_dict.pop(key)
        state_dict.setdefault(prefix + "_elmo_lstm." + key[len(prefix + "_module.") :], value)
    if is_allennlp(state_dict, prefix, layout):
        from_allennlp(state_dict, prefix, layout)


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
